"""jax_impl/parallel/compose.py and the NNX Llama (jax_impl/parallel/llama.py): the Llama equals
transformers' LlamaForCausalLM (one process: torch for this test only), and examples/compose_jax.py's
composed runs equal its single-device run. Default tier: the parity, a 4-device 2-axis layout (its state
written as a weights checkpoint that transformers' Llama reads), the refusals; slow: the 8-device layouts
(fsdp × tp × pp, dp × tp × cp) and the example as a user runs it.
Every shard_map run also checks Composed.comm_theory() against the compiled step's ledger per mesh axis.

Tolerances: 1e-13 on logits / 1e-12 on losses and parameters, relative: float64 throughout, the shards
only reorder sums (measured ~1e-15); float32 anywhere would show as ~1e-7.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

jax.config.update("jax_enable_x64", True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def example():
    path = os.path.join(ROOT, "examples", "compose_jax.py")
    spec = importlib.util.spec_from_file_location("compose_jax_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def hf_model(monkeypatch, float64: bool):
    """transformers' LlamaForCausalLM in float64 holding shared/llama.py's weights; ``float64``: its
    two float32 casts (RMSNorm, RoPE's angles) patched to float64 for this test."""
    import torch
    import transformers
    import transformers.models.llama.modeling_llama as ml

    from shared.llama import LlamaShape, hf_config, weights

    s = LlamaShape()
    if float64:  # transformers' two float32 casts (RMSNorm, RoPE's angles) kept in float64
        def rms(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

        def rotary(self, x, position_ids):
            inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float64) / s.head_dim))
            freqs = position_ids[..., None].double() * inv
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        monkeypatch.setattr(ml.LlamaRMSNorm, "forward", rms)
        monkeypatch.setattr(ml.LlamaRotaryEmbedding, "forward", rotary)
    cfg = transformers.LlamaConfig(**hf_config(s))
    cfg._attn_implementation = "sdpa"  # eager's softmax is float32
    model = transformers.LlamaForCausalLM(cfg).to(torch.float64)
    w = weights(s, 0)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=True)
    return model, w


def hf_logits(monkeypatch, float64: bool):
    import torch

    from shared.llama import LlamaShape, batch

    model, w = hf_model(monkeypatch, float64)
    tokens = batch(LlamaShape(), 4, 0)[0]
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy(), w, tokens


def test_nnx_llama_equals_transformers(monkeypatch):
    import jax.numpy as jnp

    from jax_impl.parallel.llama import from_numpy, to_numpy

    want, w, tokens = hf_logits(monkeypatch, float64=True)
    model = from_numpy(w)
    got = np.asarray(model(jnp.asarray(tokens)))
    assert np.abs(got - want).max() <= 1e-13 * np.abs(want).max()  # float64 both: measured ~6e-16
    back = to_numpy(model)
    assert back.keys() == w.keys() and all(np.array_equal(back[k], w[k]) for k in w)


def test_transformers_float32_casts_are_why_it_is_patched(monkeypatch):
    """Unpatched, transformers' float64 Llama rounds RMSNorm and RoPE to float32: ~1e-7 from float64."""
    import jax.numpy as jnp

    from jax_impl.parallel.llama import from_numpy

    want, w, tokens = hf_logits(monkeypatch, float64=False)
    gap = np.abs(np.asarray(from_numpy(w)(jnp.asarray(tokens))) - want).max() / np.abs(want).max()
    assert 1e-10 < gap < 1e-5


def assert_theory_is_the_ledger(out):
    """Composed.comm_theory() == jax_impl.ledger.comm_by_axis of the compiled step, axis by axis, op by op
    (count and bytes; one SPMD program: every device alike). jit: no theory (XLA picks)."""
    comm = out["comm"]
    if out["style"] == "jit":
        assert comm["theory"] is None and comm["ledger"], comm
        return
    ledger, theory = ({a: {op: tuple(v) for op, v in ops.items()} for a, ops in c.items()}
                      for c in (comm["ledger"], comm["theory"]))  # JSON turns the pairs into lists
    assert set(ledger) == set(theory), (out["layout"], ledger, theory)
    for axis, ops in ledger.items():
        assert theory[axis] == ops, (out["layout"], axis, ops, theory[axis])


@pytest.fixture(scope="module")
def fsdp_tp(tmp_path_factory):
    """examples/compose_jax.py's fsdp=2 × tp=2 shard_map run, its trained weights saved (a checkpoint)."""
    return example().run({"fsdp": 2, "tp": 2}, "shard_map", save=str(tmp_path_factory.mktemp("weights") / "jax"))


def test_two_axes_equal_single_device(monkeypatch, fsdp_tp):
    """fsdp=2 × tp=2 on 4 simulated devices, shard_map, 3 AdamW steps; and the same 3 steps of
    transformers' Llama (float64-patched) with torch.optim.AdamW give the same losses. The step's
    collectives per axis equal the composition's theory."""
    import torch

    from shared.llama import LlamaShape, batch

    out = fsdp_tp
    assert out["exact"], out  # 1e-12 relative (example.TOL): measured ~1e-15
    assert_theory_is_the_ledger(out)
    assert len(out["losses"]) == 3 and out["max_rel_loss_diff"] <= 1e-12
    model, _ = hf_model(monkeypatch, float64=True)
    s = LlamaShape()
    tokens, targets = (torch.from_numpy(a) for a in batch(s, 8, 0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(tokens).logits.reshape(-1, s.vocab), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # float64 both (measured 2e-16); unpatched transformers (float32 RMSNorm / RoPE) is 2e-10 away
    assert np.allclose(losses, out["losses"], rtol=1e-12, atol=0), (losses, out["losses"])


def test_state_round_trips_into_transformers(fsdp_tp, measured):
    """Part of issue 48: the fsdp × tp trainer's params() written by jax_impl.checkpoint.save_weights (Orbax,
    4 devices) are read by torch_impl.checkpoint.load_weights into transformers' LlamaForCausalLM (RMSNorm
    and RoPE in float64: llama.full_precision): its loss on the same tokens is the NNX model's (float64,
    1e-12 relative: measured ~1e-16); read back into the NNX Llama, the same weights bit for bit."""
    import torch
    import transformers

    from jax_impl.checkpoint import load_weights as jax_load
    from jax_impl.checkpoint import nnx_params
    from jax_impl.parallel import llama
    from shared.llama import LlamaShape, batch, hf_config
    from torch_impl.checkpoint import load_weights as torch_load
    from torch_impl.parallel.compose import cross_entropy
    from torch_impl.parallel.llama import full_precision

    ex, s = example(), LlamaShape()
    config = transformers.LlamaConfig(**hf_config(s))
    config._attn_implementation = "sdpa"  # eager's softmax is float32
    model = torch_load(fsdp_tp["saved"], full_precision(transformers.LlamaForCausalLM(config).to(torch.float64)))
    tokens, targets = batch(s, ex.ROWS, ex.SEED)
    with torch.no_grad():
        got = float(cross_entropy(model(input_ids=torch.from_numpy(tokens)).logits, torch.from_numpy(targets)))
    want = fsdp_tp["source_loss"]
    rel = abs(got - want) / abs(want)
    measured(f"JAX fsdp=2,tp=2 shard_map -> weights checkpoint -> transformers' Llama: loss rel {rel:.1e}")
    assert rel <= 1e-12, (got, want)
    back = jax_load(fsdp_tp["saved"], llama.Llama(s))
    assert ex.loss_of(back, tokens, targets) == want  # the same weights, the same program
    assert all(np.array_equal(a.T if a.ndim == 2 and k.endswith(".kernel") else a,
                              model.get_parameter(k.replace(".kernel", ".weight").replace(".embedding", ".weight"))
                              .detach().numpy()) for k, a in nnx_params(back).items())  # kernel = weightᵀ


def test_clip_is_the_global_norm_in_both_frameworks(monkeypatch):
    """compose(..., clip=0.05) on fsdp=2 × tp=2 (binding: the gradients' norms are ~1) equals one device's
    optax.chain(recipe.clip_by_global_norm, adamw) and transformers' Llama under torch's clip_grad_norm_
    (float64, 1e-12 relative: the sums reordered); its theory is None (XLA reduces the norm's squares)."""
    import torch

    from shared.llama import LlamaShape, batch

    clip = 0.05
    out = example().run({"fsdp": 2, "tp": 2}, "shard_map", clip=clip)
    assert out["exact"] and out["comm"]["theory"] is None, out
    model, _ = hf_model(monkeypatch, float64=True)
    s = LlamaShape()
    tokens, targets = (torch.from_numpy(a) for a in batch(s, 8, 0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses, norms = [], []
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(tokens).logits.reshape(-1, s.vocab), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(loss.item())
    assert min(norms) > clip, norms  # it binds
    assert np.allclose(losses, out["losses"], rtol=1e-12, atol=0), (losses, out["losses"])


def test_refusals(monkeypatch):
    from jax_impl.parallel import llama
    from jax_impl.parallel.compose import ComposeError, compose
    from shared.llama import LlamaShape, batch, weights

    ex = example()
    model = llama.from_numpy(weights(LlamaShape(), 0))
    make = lambda layout, **kw: compose(model, layout, ex.cross_entropy, ex.adamw(),
                                        **({"plan": llama.PLAN, "split": llama.SPLIT} | kw))
    cases = [({"tp": 2}, {"style": "typed"}, "'typed' is refused"),
             ({"tp": 4}, {}, "heads, not divisible by tp=4"),  # kv_heads = 2
             ({"pp": 3}, {}, "do not split evenly over pp=3"),
             ({"sp": 2}, {}, "unknown axes"),
             ({"cp": 2}, {"style": "jit", "cp_variant": "ulysses"}, "under jit is refused"),
             ({"tp": 2}, {"plan": {"lm_head": "colwise"}}, "inside model.layers only"),
             ({"tp": 2}, {"plan": {"model.layers.*.attn.q": "colwise"}}, "matches no module")]
    for layout, kw, words in cases:
        with pytest.raises(ComposeError, match=words.replace("(", r"\(")):
            make(layout, **kw)
    with pytest.raises(ComposeError, match="not a non-empty nnx.List"):
        make({"dp": 2}, split=dataclasses.replace(llama.SPLIT, blocks="model.layers.0"))
    tied = llama.from_numpy(weights(LlamaShape(), 0))
    tied.model.norm = tied.model.layers[0].input_layernorm  # one RMSNorm in two places
    with pytest.raises(ComposeError, match="tied"):
        compose(tied, {"dp": 2}, ex.cross_entropy, ex.adamw(), split=llama.SPLIT)
    trainer = make({"dp": 2})
    with pytest.raises(ComposeError, match="run one train_step first"):  # the theory needs the batch's shape
        trainer.comm_theory()
    with pytest.raises(ComposeError, match="rows do not split"):
        trainer.check_batch(np.zeros((3, 16), np.int64))
    tokens, targets = batch(LlamaShape(), 8, 0)
    no_norm = dataclasses.replace(llama.SPLIT, head=lambda root, mods, h: mods["lm_head"](h))
    with pytest.raises(ComposeError, match="chain"):  # checked eagerly before compiling
        make({"dp": 2}, split=no_norm).train_step(tokens, targets)
    from jax_impl.parallel import cp

    monkeypatch.setattr(llama, "cp", types.SimpleNamespace(attention=cp.causal))  # attention beside the seam
    with pytest.raises(cp.SeamError, match="never called"):  # at the first trace, before compiling
        make({"cp": 2}).train_step(tokens, targets)


def test_specs():
    """Where each array lives: tp on the plan's dims, fsdp on dim 0 after tp (tp-major), pp on the stage
    dim of the stacked blocks, ZeRO units limiting fsdp; the embedding and head replicated over tp."""
    from jax.sharding import PartitionSpec as P

    from jax_impl.parallel import llama
    from jax_impl.parallel.compose import compose
    from shared.llama import LlamaShape, weights

    ex, model = example(), llama.from_numpy(weights(LlamaShape(), 0))
    t = compose(model, {"fsdp": 2, "tp": 2, "pp": 2}, ex.cross_entropy, ex.adamw(), plan=llama.PLAN,
                split=llama.SPLIT)
    b, r = t.specs["blocks"], t.specs["rest"]
    assert b["self_attn.q_proj.kernel"] == P("pp", None, "fsdp", "tp")
    assert b["self_attn.o_proj.kernel"] == P("pp", None, ("tp", "fsdp"), None)
    assert b["input_layernorm.weight"] == P("pp", None, None)
    assert r["model.embed_tokens.embedding"] == P("fsdp", None) and r["lm_head.kernel"] == P("fsdp", None)
    t = compose(model, {"fsdp": 2}, ex.cross_entropy, ex.adamw(), split=llama.SPLIT, units=["model.layers.*"])
    assert t.specs["rest"]["lm_head.kernel"] == P(None, None)
    assert t.specs["blocks"]["mlp.up_proj.kernel"] == P(None, None, "fsdp", None)


def test_fused_qkv_split_by_whole_heads():
    """The project's Transformer (jax_impl/transformer.py's PLAN / SPLIT) under tp=2 × cp=2: its fused
    [q|k|v] kernel (colwise_heads) is held as [q_r|k_r|v_r] per tp device and given back in the fixture's
    column order; the first step's loss is the model's own (its attention through the cp seam, wpe at the
    global positions); under jit (tp=2) too, its columns in order; colwise_heads on a kernel without a
    parent head_dim is refused. The whole run
    (steps, gradients, parameters) against the reference: tests/test_mesh.py's JAX rows."""
    from jax.sharding import PartitionSpec as P

    from jax_impl import transformer
    from jax_impl.model import build_model, inputs, make_optimizer, output_loss, targets
    from jax_impl.parallel import llama
    from jax_impl.parallel.compose import ComposeError, compose
    from shared.config import Config
    from shared.llama import LlamaShape, weights
    from shared.problem import make_problem

    cfg = Config(world_size=4, model="transformer", layers=2, dim=16, heads=4, seq=16, vocab=32, batch=4, steps=1)
    problem = make_problem(cfg)
    model = build_model(cfg, problem)
    x, y = np.asarray(inputs(cfg, problem)), np.asarray(targets(cfg, problem))
    want = float(output_loss(model(x), y))
    t = compose(model, {"tp": 2, "cp": 2}, output_loss, make_optimizer(cfg), plan=transformer.PLAN,
                split=transformer.SPLIT)
    assert t.specs["blocks"]["qkv.kernel"] == P(None, None, None, "tp")
    held, w = np.asarray(t.params_["blocks"]["qkv.kernel"])[0, 0], problem.params["blocks.0.attn.qkv.weight"]
    q, k, v = np.split(w, 3, axis=1)  # device 0's block: its 2 heads (8 columns) of q, k and v
    assert np.array_equal(held[:, :24], np.concatenate([q[:, :8], k[:, :8], v[:, :8]], axis=1))
    assert all(np.array_equal(problem.params[transformer.param_name(p)], a) for p, a in t.params().items())
    # float64, the sums over heads and sequence shards reordered: 1e-12 relative (measured ~1e-16)
    assert np.isclose(t.train_step(x, y), want, rtol=1e-12, atol=0)
    # jit runs the model on the global arrays: the columns stay in the model's order (no heads_perm)
    j = compose(model, {"tp": 2}, output_loss, make_optimizer(cfg), plan=transformer.PLAN, split=transformer.SPLIT,
                style="jit")
    assert np.array_equal(np.asarray(j.params_["blocks"]["qkv.kernel"])[0, 0], w)
    assert np.isclose(j.train_step(x, y), want, rtol=1e-12, atol=0)
    lm = llama.from_numpy(weights(LlamaShape(), 0))
    with pytest.raises(ComposeError, match="needs a fused"):
        compose(lm, {"tp": 2}, output_loss, make_optimizer(cfg), split=llama.SPLIT,
                plan={"model.layers.*.mlp.up_proj": "colwise_heads"})


@pytest.mark.slow  # 8 (4) simulated devices: ~10-20 s each on 2 cores
@pytest.mark.parametrize("layout,style,units,variant", [({"dp": 2, "tp": 2, "cp": 2}, "shard_map", None, "ring"),
                                                        ({"dp": 2, "tp": 2, "cp": 2}, "jit", None, "ring"),
                                                        ({"fsdp": 2, "tp": 2}, "jit", ["model.layers.*"], "ring")])
def test_eight_devices_equal_single_device(layout, style, units, variant):
    out = example().run(layout, style, units=units, cp_variant=variant)
    assert out["exact"], out  # 1e-12 relative: measured ~1e-15
    assert_theory_is_the_ledger(out)


@pytest.mark.slow  # fsdp × tp × pp in a fresh interpreter, as a user runs it: ~30 s
def test_example_json(tmp_path):
    path = tmp_path / "out.json"
    # the script asks for its own devices; the suite's compile-time flags (tests/conftest.py) stay
    flags = [w for w in os.environ.get("XLA_FLAGS", "").split() if not w.startswith("--xla_force_host_platform")]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "compose_jax.py"), "--layout",
                           "fsdp=2,tp=2,pp=2", "--json", str(path)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(path.read_text())
    assert out["framework"] == "jax" and out["layout"] == {"fsdp": 2, "tp": 2, "pp": 2}
    assert set(out) >= {"losses", "reference_losses", "max_abs_param_diff"}
    assert out["exact"] and out["max_rel_loss_diff"] <= 1e-12, out  # exit 0 says the same
    assert_theory_is_the_ledger(out)  # fsdp × tp × pp: gathers, Megatron, GPipe's permutes, per-use sums
    assert "theory per axis == ledger (one SPMD program): True" in done.stdout
