"""N-D composition on one DeviceMesh (torch_impl/parallel/compose.py) for transformers' LlamaForCausalLM
(examples/compose_torch.py: shared/llama.py's weights and data, float64, mean CE, AdamW, 3 steps), each
layout against the same model trained on one process.

Default tier: ONE launch of 4 gloo ranks running every 2-axis case one after another (fsdp × tp in both
styles, cp × tp builtin, pp × tp explicit, fsdp × pp in both styles and under 1F1B; ~55 s on 2 shared cores, most of it
importing transformers in 5 processes; and fsdp × tp explicit once more, its state written as a weights
checkpoint that the NNX twin reads; then, on the same ranks, the expert axis's cases on a user's MoE model:
tests/compose_ep_cases.py) and the refusals that need no process group. Slow tier: ONE
launch of 8 ranks, the issue's layouts fsdp=2,tp=2,pp=2 and dp=2,tp=2,cp=2 in both styles (and ep's 8-rank
cases after them). Every case also compares the composition's communication theory per axis
(Trainer.comm_theory, from the model wrapped) with the ledger of step 3.

Tolerance: losses 1e-12 relative (the example's exit criterion; the JAX twin is compared to the same
numbers), parameters 1e-12 absolute after 3 steps: float64, the parallel runs add the same products in
another order (~1e-16 per op; measured ~1e-15 after 3 AdamW steps). RMSNorm and RoPE in float64 too
(``llama.full_precision``: transformers casts them to float32), as the JAX twin computes them.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import compose_ep_cases as ep_cases  # noqa: E402
import compose_torch  # noqa: E402  (the ranks import it by name: spawn hands them this sys.path)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from own_models import MOE_NET_EXPERTS, MoENet, made  # noqa: E402

from shared.llama import LlamaShape  # noqa: E402
from torch_impl.parallel import compose  # noqa: E402

TOL_LOSS, TOL_PARAM = 1e-12, 1e-12  # float64: see the module docstring
KEYS = {"framework", "layout", "losses", "reference_losses", "max_abs_param_diff"}  # the issue's JSON schema

CLIP = 0.05  # binds every step (test_clipping_binds)
CASES_4 = [({"fsdp": 2, "tp": 2}, "builtin"), ({"fsdp": 2, "tp": 2}, "explicit"),
           ({"cp": 2, "tp": 2}, "builtin"), ({"pp": 2, "tp": 2}, "explicit"),
           ({"fsdp": 2, "pp": 2}, "builtin"),  # FSDP2 in GPipe stages: M + 1 gathers per unit
           ({"fsdp": 2, "pp": 2}, "explicit"),  # the FSDP wrapper in stages: M gathers, re-gathers, reduce-scatters
           ({"fsdp": 2, "pp": 2}, "builtin", {"schedule": "1f1b", "microbatches": 4}),  # FSDP2, B0 before F2
           # clipped by the global norm (binding: the gradients' norms are ~1): shards over fsdp and tp, stages
           ({"fsdp": 2, "tp": 2}, "explicit", {"max_norm": CLIP}),
           ({"fsdp": 2, "pp": 2}, "builtin", {"max_norm": CLIP}),
           # transformers' Qwen2 (q/k/v biases, GQA) with its own tp plan and a vocabulary tp does not divide
           ({"fsdp": 2, "tp": 2}, "explicit", {"family": "qwen2", "vocab": 97, "plan": "auto"}),
           # HSDP: replicate over dp × shard over fsdp (FSDP2's 2-D mesh; the wrapper + one dp all-reduce)
           ({"dp": 2, "fsdp": 2}, "builtin"), ({"dp": 2, "fsdp": 2}, "explicit"),
           # accumulation without pp: 2 parts, FSDP2 reducing in the last (M + 1 gathers per unit, as under pp)
           ({"fsdp": 2, "tp": 2}, "builtin", {"microbatches": 2})]
# torch's clip_grad_norm_ inside the optimizer's step (a pre-hook): refused, plain pieces and FSDP2's DTensors
REFUSED_4 = [({"fsdp": 2, "tp": 2}, "explicit", {"clip_in_optimizer": True}),
             ({"fsdp": 2, "pp": 2}, "builtin", {"clip_in_optimizer": True})]
CASES_8 = [({"fsdp": 2, "tp": 2, "pp": 2}, "builtin"), ({"dp": 2, "tp": 2, "cp": 2}, "builtin"),
           ({"fsdp": 2, "tp": 2, "pp": 2}, "explicit"), ({"dp": 2, "tp": 2, "cp": 2}, "explicit"),
           ({"fsdp": 2, "tp": 2, "pp": 2}, "explicit", {"max_norm": CLIP}),
           ({"dp": 2, "tp": 2, "cp": 2}, "explicit", {"max_norm": CLIP}),
           # transformers' Qwen2 (biased q/k/v) with plan="auto": V = 97 explicit (padded), 96 builtin; HSDP × tp.
           # One style per 3-axis layout (the other's Qwen2 rows were the Llama rows' code with biases: issue 46)
           ({"fsdp": 2, "tp": 2, "pp": 2}, "explicit", {"family": "qwen2", "vocab": 97, "plan": "auto"}),
           ({"dp": 2, "tp": 2, "cp": 2}, "builtin", {"family": "qwen2", "vocab": 96, "plan": "auto"}),
           ({"dp": 2, "fsdp": 2, "tp": 2}, "explicit", {"family": "qwen2", "vocab": 97, "plan": "auto",
                                                      "max_norm": CLIP})]


def name(case) -> str:
    layout, style, *pp = case
    options = "".join(f" {v}" for o in pp for v in o.values())  # the pp schedule, M
    return ",".join(f"{a}={n}" for a, n in layout.items()) + f" {style}{options}"


# fsdp × tp explicit, its trained state written as a weights checkpoint (test_state_round_trips_…)
SAVE_4 = ({"fsdp": 2, "tp": 2}, "explicit")


def ep_ranks(ctx, cases):
    """compose_ep_cases' cases after the Llama's on the same ranks (one launch), with compose_torch's labels."""
    return ep_cases.ranks(ctx, cases, compose_torch._LABELS)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    save = [(*SAVE_4, {"save": str(tmp_path_factory.mktemp("weights") / "torch")})]
    results, after = compose_torch.run(CASES_4 + REFUSED_4 + save, then=(ep_ranks, ep_cases.CASES_4))
    return dict(zip([*map(name, CASES_4 + REFUSED_4), "save"], results, strict=True)), \
        ep_cases.compare(ep_cases.CASES_4, after)


@pytest.fixture(scope="module")
def four(launched):
    return launched[0]


@pytest.fixture(scope="module")
def four_ep(launched):
    return launched[1]


@pytest.mark.parametrize("case", [name(c) for c in REFUSED_4])
def test_a_clip_inside_the_optimizer_is_refused(four, case):
    """Each rank would clip its pieces (a tp / fsdp shard, a stage) by their own norm: LocalClipError at the
    first step, naming train_step's max_norm= (every rank raised it: compare_torch reports the message)."""
    message = four[case]["refused"]
    assert message.startswith("compose: a gradient") and "LOCAL norm" in message and "max_norm=" in message, message


def assert_theory_is_the_ledger(r):
    """Per rank, per axis: Trainer.comm_theory() == the ledger of step 3 (op -> count, bytes), every axis."""
    for k, comm in enumerate(r["comm_per_rank"]):
        ledger, theory = comm["ledger"], comm["theory"]
        assert set(ledger) == set(theory), (r["layout"], k, comm)
        for axis, ops in theory.items():
            assert ledger[axis] == ops, (r["layout"], r["style"], k, axis, ledger[axis], ops)


def assert_exact(r, measured):
    measured(f"{r['layout']} {r['style']}: loss rel {r['max_rel_loss_diff']:.1e}, "
             f"params {r['max_abs_param_diff']:.1e}")
    assert KEYS <= set(r) and r["framework"] == "torch", r
    assert len(r["losses"]) == compose_torch.STEPS and r["losses"][-1] < r["losses"][0], r  # it trains
    assert r["max_rel_loss_diff"] <= TOL_LOSS and r["max_abs_param_diff"] <= TOL_PARAM, r


def test_clipping_binds(four):
    """The clipped runs (equal to one process's clip_grad_norm_: test_two_axis_layouts_…) differ from the
    unclipped ones: the clip changed every step after the first."""
    clipped, plain = four[name(({"fsdp": 2, "tp": 2}, "explicit", {"max_norm": CLIP}))], \
        four[name(({"fsdp": 2, "tp": 2}, "explicit"))]
    assert min(abs(a - b) for a, b in zip(clipped["losses"][1:], plain["losses"][1:])) > 1e-6, (clipped, plain)


@pytest.mark.parametrize("case", [name(c) for c in CASES_4])
def test_theory_per_axis_equals_the_ledger(four, case):
    assert_theory_is_the_ledger(four[case])


# examples/compose_jax.py --layout fsdp=2,tp=2 (the NNX Llama, optax.adamw, the same contract), its
# reference_losses: torch's must equal them to 1e-12 relative (the issue's cross-framework criterion;
# measured 4e-16). A change of data, loss, optimizer or precision on one side breaks this.
JAX_LOSSES = [4.155524507888486, 4.089416205854533, 4.034810688692266]


def test_single_process_losses_equal_the_jax_twins(four):
    ref = four[name(CASES_4[0])]["reference_losses"]
    assert max(abs(a - b) / abs(b) for a, b in zip(ref, JAX_LOSSES, strict=True)) <= TOL_LOSS, ref


@pytest.mark.parametrize("case", [name(c) for c in CASES_4])
def test_two_axis_layouts_train_like_one_process(four, case, measured):
    assert_exact(four[case], measured)


def test_state_round_trips_into_the_jax_twin(four, measured):
    """Part of issue 48: the fsdp × tp trainer's full_state_dict() written by torch_impl.checkpoint.save_weights
    (DCP, 4 ranks) is read by jax_impl.checkpoint.load_weights into the NNX Llama twin (transformers' names;
    nn.Linear weights transposed to kernels): its loss on the same tokens is the torch model's (float64,
    1e-12 relative: measured ~1e-16); read back into torch, the same weights bit for bit."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import torch

    from jax_impl.checkpoint import load_weights as jax_load
    from jax_impl.checkpoint import nnx_params
    from jax_impl.parallel import llama
    from shared import llama as shared_llama
    from shared.checkpoint_weights import read_weights
    from torch_impl.checkpoint import load_weights as torch_load

    r, shape = four["save"], shared_llama.LlamaShape()
    assert_exact(r, measured)
    tokens, targets = shared_llama.batch(shape, compose_torch.ROWS, compose_torch.SEED)
    twin = jax_load(r["saved"], llama.Llama(shape))
    logits = twin(jnp.asarray(tokens))
    picked = jnp.take_along_axis(logits, jnp.asarray(targets)[..., None], axis=-1)[..., 0]
    got = float(jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked))
    rel = abs(got - r["source_loss"]) / abs(r["source_loss"])
    measured(f"torch fsdp=2,tp=2 explicit -> weights checkpoint -> JAX Llama: loss rel {rel:.1e}")
    assert rel <= TOL_LOSS, (got, r["source_loss"])
    files = read_weights(r["saved"])
    assert all(np.array_equal(a, files[k.replace(".kernel", ".weight").replace(".embedding", ".weight")])
               for k, a in nnx_params(twin).items())
    back = torch_load(r["saved"], compose_torch.build(shape))
    with torch.no_grad():
        again = float(compose.cross_entropy(back(input_ids=torch.from_numpy(tokens)).logits, torch.from_numpy(targets)))
    assert again == r["source_loss"], (again, r["source_loss"])  # the same weights, the same program


@pytest.mark.slow
def test_issue_layouts_on_8_ranks_train_like_one_process(measured):
    """fsdp × tp × pp (FSDP2 over DTensor TP in pipeline stages) and dp × tp × cp (the cp seam's ring
    over tp-local heads, one gradient all-reduce over dp × cp), builtin and explicit, in one launch; the
    Llama and transformers' Qwen2 (its own tp plan; V = 97 under explicit), every state dict loaded back.
    Then, on the same ranks, ep's 8-rank cases: HSDP × ep (the explicit FSDP folds ep into its dp
    all-reduce; FSDP2 then one all-reduce over ep) and fsdp × ep × tp, both styles, one clipped."""
    results, after = compose_torch.run(CASES_8, then=(ep_ranks, ep_cases.CASES_8))
    for r in results:
        assert_exact(r, measured)
        assert_theory_is_the_ledger(r)
    for r in ep_cases.compare(ep_cases.CASES_8, after).values():
        ep_cases.assert_exact(r, measured)
        ep_cases.assert_theory_is_the_ledger(r)


# --- the expert axis (compose_ep.py) on a user's MoE model: tests/compose_ep_cases.py ----------------


@pytest.mark.parametrize("case", [ep_cases.name(c) for c in ep_cases.CASES_4])
def test_ep_layouts_train_like_one_process(four_ep, case, measured):
    """ep × tp (the MoE layer identical on every tp rank; ep's all-to-alls inside each ep group) and dp × ep
    (ep folded into dp's all-reduce of the dense gradients, the experts' averaged over dp, / ep), explicit and
    builtin, with the balancing loss from every data rank's counts: losses and parameters as one process's
    (1e-12), the clipped run's global norms too (the clip binds), the ledger of step 3 = comm_theory."""
    ep_cases.assert_exact(four_ep[case], measured)
    ep_cases.assert_theory_is_the_ledger(four_ep[case])


@pytest.mark.parametrize("layout, kw, match", ep_cases.REFUSALS)
def test_ep_refusals_in_one_line(layout, kw, match):
    """Refused before anything changes: one line with the fix, the model's weights (E = 4 stacked) untouched."""
    model = made(MoENet)
    before = {k: p.clone() for k, p in model.state_dict().items()}
    kw = {"experts": MOE_NET_EXPERTS, "optimizer": ep_cases.adamw} | kw
    with pytest.raises(compose.ComposeError, match=match) as e:
        compose.parallelize(model, ep_cases.FakeMesh(layout), **kw)
    assert "\n" not in str(e.value) and "fix:" in str(e.value), e.value
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(before[k], p) for k, p in after.items())


@pytest.mark.slow
def test_compiled_llama_trains_like_one_process(measured):
    """compose.parallelize(compile=True) (issue 49): transformers' Llama, each decoder layer torch.compile'd
    between the DTensor TP plan and FSDP2, fsdp=2,tp=2 and builtin tp=2, pp=2 (each stage's layers compiled
    under pipelining), in one launch: equal to the one-process run (1e-12), and the compiled step's collectives
    (torch's profiler: no process group, so summed over the axes) equal to the composition's theory."""
    cases = [({"fsdp": 2, "tp": 2}, "builtin", {"compile": True}), ({"pp": 2, "tp": 2}, "builtin", {"compile": True})]
    for r in compose_torch.run(cases):
        assert_exact(r, measured)
        for comm in r["comm_per_rank"]:
            assert comm["total"] == {op: comm["theory_total"][op] for op in comm["total"]}, (r["layout"], comm)
            assert set(comm["total"]) == set(comm["theory_total"]), (r["layout"], comm)
            assert comm["compiled"].get("all_reduce"), (r["layout"], comm)  # tp's, inside the compiled layers


def test_compile_refused_under_cp_and_without_units():
    with pytest.raises(compose.ComposeError, match="compile=True with cp > 1"):
        compose.parallelize(nn.Linear(2, 2), _FakeMesh({"cp": 2}), optimizer=lambda ps: None, compile=True)
    with pytest.raises(compose.ComposeError, match="compile=True compiles the units"):
        compose.parallelize(nn.Linear(2, 2), _FakeMesh({"tp": 2}), optimizer=lambda ps: None, compile=True)


class _FakeMesh:
    """Just enough of a DeviceMesh for the refusals that need no process group."""

    def __init__(self, layout):
        import torch

        self.mesh_dim_names, self.mesh, self.device_type = tuple(layout), torch.zeros(tuple(layout.values())), "cpu"


# --- refusals before anything changes (no process group) -------------------------------------------


@pytest.mark.parametrize("layout, style, match", [
    ({"data": 2}, "builtin", "unknown mesh axes"),
    ({"tp": 2}, "typed", "unknown style"),
])
def test_layouts_refused_in_one_line(layout, style, match):
    with pytest.raises(compose.ComposeError, match=match):
        compose.check(layout, style, compose.cross_entropy, {})


def test_explicit_tp_refuses_a_loss_it_cannot_split_over_the_vocabulary():
    with pytest.raises(compose.ComposeError, match="vocabulary-parallel CE"):
        compose.check({"tp": 2}, "explicit", lambda out, y: out.sum(), {"lm_head": "colwise_vocab"})


def test_pp_refuses_a_weight_tied_across_stages():
    """tie_word_embeddings: the embedding (stage 0) and the head (stage 1) hold one Parameter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.llama import hf_config
    from torch_impl.parallel.llama import Stage

    config = LlamaConfig(**(hf_config(LlamaShape(layers=2)) | {"tie_word_embeddings": True}))
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tied = r"'model\.embed_tokens\.weight' = 'lm_head\.weight' is held by stages 0 and 1"
    with pytest.raises(compose.ComposeError, match=tied):
        compose.check_stages(model, Stage, 2)
    compose.check_stages(LlamaForCausalLM(LlamaConfig(**hf_config(LlamaShape(layers=2)))), Stage, 2)  # untied: ok
    lossy = lambda m, s, n: nn.Module()  # a stage builder that drops the model: nothing would train
    with pytest.raises(compose.ComposeError, match="in no stage"):
        compose.check_stages(LlamaForCausalLM(LlamaConfig(**hf_config(LlamaShape(layers=2)))), lossy, 2)


def test_builtin_tp_refuses_an_uneven_vocabulary():
    """V = 97 over tp = 2: DTensor would shard it 49 | 48; explicit pads it (parallel/tp.py), builtin refuses."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.llama import hf_config
    from torch_impl.parallel.llama import TP_PLAN

    model = LlamaForCausalLM(LlamaConfig(**hf_config(LlamaShape(vocab=97, layers=2)))).to("meta")
    with pytest.raises(compose.ComposeError, match=r"'model\.embed_tokens' \(vocab_embed\) has 97 rows"):
        compose.check_vocab(model, TP_PLAN, 2, "builtin")
    compose.check_vocab(model, TP_PLAN, 2, "explicit")
