"""compose's expert axis in JAX (jax_impl/parallel/compose_ep.py, issue 48): a user's NNX MoE model
(own_models_jax.MoENet: an embedding, blocks of a biased MLP and a top-2 ``UserMoE`` of 4 stacked experts
through ``parallel.ep.dispatch``, a head; the loss the mean CE plus the layers' balancing losses from
``parallel.ep.global_counts``) under ``compose(..., experts=["layers.*.moe.experts"], aux=model.aux)`` on
layouts naming "ep", each against the SAME model (no code changed) trained on one device from the same
weights: float64, 3 steps of optax.adamw(1e-2, weight_decay=0.1). shard_map runs also check
``comm_theory()`` against the compiled step's ledger per mesh axis.

Default tier (budget: one compile of each kind): ep=2 × tp=2 clipped (binding) in shard_map, the
refusals. Slow: dp=2 × ep=2 accumulating 2 micro-batches (theory = ledger), jit (accumulating, clipped),
the 8-device layouts (fsdp × ep × tp, HSDP × ep), experts= without ep, and compare.py's own MoE mesh runs
(plain, and with the recipe flags).

Tolerance: losses 1e-12 relative, parameters 1e-12 absolute after 3 steps: float64, the layouts add the
same products in another order (the all-to-alls regroup the rows, the all-reduces sum the devices'
means; ~1e-16 per op); the routing's top-2 is the same on every layout as long as no two router
probabilities tie within that error (none do at these weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from own_models_jax import MOE_NET_EXPERTS, MOE_NET_PLAN, STEPS, MoENet, flat, moe_split

from jax_impl import ledger
from jax_impl.parallel import recipe
from jax_impl.parallel.compose import ComposeError, compose

jax.config.update("jax_enable_x64", True)

TOL_LOSS, TOL_PARAM = 1e-12, 1e-12  # float64: see the module docstring
B, T, V = 8, 3, 24
CLIP = 0.05  # binds every step: the gradients' global norm is ~0.5-1 (asserted: norms > 2·CLIP)


def adamw():
    return optax.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)  # weight decay passed explicitly


def cross_entropy(logits, targets):
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def batch():
    rng = np.random.default_rng(7)
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


_REF: dict = {}
_MODEL: list = []


def model():
    """One MoENet for every test (compose and the reference only read it; its eager init compiles op by op)."""
    if not _MODEL:
        _MODEL.append(MoENet(nnx.Rngs(0)))
    return _MODEL[0]


def reference(clip=None, k=1):
    """One device, the whole batch: CE + the layers' balancing losses, (torch's global clip,) AdamW.
    (losses, {path: params}, global norms). One compiled step for both (clip as an argument: inf = none).
    ``k`` > 1: accumulation as one device does it, micro-batch j = rows [j·B/k, (j+1)·B/k), each with its own
    balancing losses (its routing), loss / k each."""
    if (clip, k) in _REF:
        return _REF[clip, k]
    (x, y), tx = batch(), adamw()
    gdef, params = nnx.split(model())

    def loss_of(p):
        m, n, total = nnx.merge(gdef, p), B // k, 0
        for j in range(k):
            total = total + cross_entropy(m(x[j * n:(j + 1) * n]), y[j * n:(j + 1) * n]) + m.aux()
        return total / k

    @jax.jit
    def step(p, opt, max_norm):
        value, g = jax.value_and_grad(loss_of)(p)
        norm_sq = recipe.sumsq(g)
        updates, opt = tx.update(recipe.scale_by_norm(g, norm_sq, max_norm), opt, p)
        return optax.apply_updates(p, updates), opt, value, jnp.sqrt(norm_sq)

    opt, losses, norms = tx.init(params), [], []
    for _ in range(STEPS):
        params, opt, value, norm = step(params, opt, np.inf if clip is None else clip)
        losses.append(float(value))
        norms.append(float(norm))
    _REF[clip, k] = losses, flat(nnx.merge(gdef, params)), norms
    return _REF[clip, k]


def run(layout, style="shard_map", clip=None, **kw):
    m, (x, y) = model(), batch()
    t = compose(m, layout, cross_entropy, adamw(), plan=MOE_NET_PLAN if layout.get("tp", 1) > 1 else None,
                split=moe_split(), units=["layers.*"], experts=MOE_NET_EXPERTS, aux=m.aux, style=style, clip=clip,
                **kw)
    step, state, placed = t.program(x, y)  # train_step's program and checks, compiled ONCE for steps and ledger
    compiled, losses = step.lower(*state, *placed).compile(), []
    for _ in range(STEPS):
        *state, loss = compiled(*state, *placed)
        losses.append(float(loss))
    ref_losses, ref_params, norms = reference(clip, kw.get("microbatches") or 1)
    got = t.to_paths(state[0])
    assert got.keys() == ref_params.keys(), (sorted(got), sorted(ref_params))
    out = {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
           "param_abs": max(float(np.abs(got[k] - ref_params[k]).max()) for k in ref_params),
           "losses": losses, "norms": norms, "trainer": t}
    if style == "shard_map" and clip is None:
        by_axis = ledger.comm_by_axis(compiled.as_text(), t.mesh)
        out["ledger"] = {a: {op: (v["count"], v["bytes"]) for op, v in ops.items()} for a, ops in by_axis.items()}
        out["theory"] = t.comm_theory()
    return out


def assert_exact(out, name, measured):
    measured(f"compose ep {name}: loss rel {out['loss_rel']:.1e}, params {out['param_abs']:.1e}")
    assert out["losses"][-1] < out["losses"][0], out["losses"]  # it trains
    assert out["loss_rel"] <= TOL_LOSS and out["param_abs"] <= TOL_PARAM, (name, out["loss_rel"], out["param_abs"])
    if "theory" in out:  # the compiled step's collectives per axis = compose's theory (the seam's calls)
        assert out["theory"] == out["ledger"], (name, out["ledger"], out["theory"])


def test_ep_tp_clipped_equals_one_device(measured):
    """ep=2 × tp=2, shard_map, clip=0.05 binding: the global norm counts each expert shard once."""
    out = run({"ep": 2, "tp": 2}, clip=CLIP)
    assert min(out["norms"]) > 2 * CLIP, out["norms"]  # the clip binds every step
    assert out["trainer"].specs["blocks"]["moe.experts.w1"] == jax.sharding.PartitionSpec(None, None, "ep", None, None)
    assert_exact(out, "ep=2,tp=2 shard_map clip", measured)


@pytest.mark.slow  # 4-8 simulated devices, one compile each: ~3-6 s apiece on 2 cores
@pytest.mark.parametrize("layout,style,clip,mb", [({"dp": 2, "ep": 2}, "shard_map", None, 2),
                                                  ({"ep": 2, "tp": 2}, "jit", CLIP, 2),
                                                  ({"fsdp": 2, "ep": 2, "tp": 2}, "shard_map", None, None),
                                                  ({"dp": 2, "fsdp": 2, "ep": 2}, "shard_map", CLIP, None),
                                                  ({"dp": 4}, "shard_map", None, None)])
def test_more_layouts_equal_one_device(layout, style, clip, mb, measured):
    """dp × ep (the experts' gradients summed over dp; theory = ledger), jit (shardings only: XLA places the
    collectives; fsdp × ep × tp under jit: compare.py's run below), fsdp × ep × tp and HSDP × ep (the experts
    out of the ZeRO units), and experts= without ep (dp=4: the experts dense, the counts psummed over dp).
    ``mb`` = 2: accumulation, micro-batch j the batch's rows [j·B/2, (j+1)·B/2) with its own routing and
    balancing losses (shard_map: each device's chunk j its share of them; jit: the global rows)."""
    name = ",".join(f"{a}={n}" for a, n in layout.items()) + f" {style}" + (" clip" if clip else "") + \
        (f" microbatches={mb}" if mb else "")
    assert_exact(run(layout, style, clip, **({"microbatches": mb} if mb else {})), name, measured)


REFUSALS = [  # (layout, compose's keywords, the one line's pattern)
    ({"ep": 2, "pp": 2}, {}, r"ep=2 beside pp=2 is not composed"),
    ({"ep": 2, "cp": 2}, {}, r"ep=2 beside cp=2 is not composed"),
    ({"dp": 2, "ep": 2}, {"experts": ()}, r"ep=2 needs experts=\[module path globs\]"),
    ({"ep": 2}, {"experts": ["layers.*.mlp.experts"]}, r"experts glob 'layers\.\*\.mlp\.experts' names no module"),
    ({"ep": 2}, {"experts": ["layers.*.moe"]}, r"experts 'layers\.0\.moe': its Params must all be stacked"),
    ({"ep": 8}, {}, r"4 experts are not divisible by ep=8"),
    ({"ep": 2}, {"experts": ["layers.0.moe.experts"]}, r"in 1 of the 2 blocks"),
    ({"ep": 2, "tp": 2}, {"plan": MOE_NET_PLAN | {"layers.*.moe.experts": "colwise"}},
     r"tp plan entry 'layers\.\*\.moe\.experts' names 'layers\.0\.moe\.experts', inside the experts"),
    ({"fsdp": 2, "ep": 2}, {"units": ["layers.*.moe.experts"]}, r"ZeRO unit glob 'layers\.\*\.moe\.experts' names"),
    ({"dp": 2, "pp": 2}, {"experts": ()}, r"aux= under pp=2"),
]


@pytest.mark.parametrize("layout,kw,words", REFUSALS)
def test_refusals(layout, kw, words):
    """One line each, before anything compiles."""
    args = {"plan": None, "split": moe_split(), "units": ["layers.*"], "experts": MOE_NET_EXPERTS,
            "aux": model().aux} | kw
    with pytest.raises(ComposeError, match=words):
        compose(model(), layout, cross_entropy, adamw(), **args)


@pytest.mark.slow  # compare.py's own runs, 8 simulated devices, three compiles: ~35 s on 2 cores
def test_compare_runs_the_moe_transformer_under_ep_in_jax(tmp_path, capsys):
    """`compare.py --model transformer --experts 4 --mesh fsdp=2,ep=2,tp=2 --frameworks jax` at the tests'
    sizes: shard_map and jit (both through compose) agree with the MoE transformer's single-device reference
    (compare.py's float64 tolerance, 1e-12: the devices reorder sums); shard_map's bytes equal compose's
    theory (comm_theory, from the arrays and the trace), its all-to-alls shared.theory.ep_comm_jax's
    (capacity C = the n local tokens); jit unpriced (XLA's collectives); typed refused in one line."""
    import json

    import compare
    from shared.config import Config
    from shared.theory import ep_comm_jax

    size = ["--layers", "2", "--dim", "16", "--heads", "4", "--seq", "8", "--vocab", "32", "--batch", "8"]
    base = ["--model", "transformer", "--experts", "4", "--mesh", "fsdp=2,ep=2,tp=2", "--frameworks", "jax", *size]
    out = tmp_path / "moe.json"
    assert compare.main(base + ["--steps", "3", "--quiet", "--json", str(out)]) == 0
    runs = {r["style"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"shard_map", "jit"} and all(r["ok"] for r in runs.values()), runs
    sm = runs["shard_map"]
    assert sm["comm_bytes_theory"] == sm["comm_bytes"] > 0 and runs["jit"]["comm_bytes_theory"] is None, runs
    ep = Config(world_size=4, model="transformer", experts=4, layers=2, dim=16, heads=4, seq=8, vocab=32, batch=8)
    count, nbytes = ep_comm_jax(ep, "shard_map")["all_to_all"]  # the 4 data devices' tokens, C = B/4·T
    assert sm["comm"]["all_to_all"] == {"count": count, "bytes": nbytes}, sm["comm"]
    assert compare.main(base + ["--styles", "typed", "--quiet"]) == 2  # refused before any run
    assert "the typed style has no ep axis" in capsys.readouterr().err
    # the recipe flags through compose: a binding clip, 2 micro-batches (each its own routing), schedule, decay
    # mask, frozen routers; shard_map (jit accumulating: test_more_layouts_equal_one_device)
    recipe = ["--clip", "0.05", "--accumulate", "2", "--schedule", "warmup-cosine", "--decay-mask", "--freeze",
              "blocks.*.mlp.router.weight", "--styles", "shard_map"]
    assert compare.main(base + ["--steps", "3", "--quiet", "--json", str(out), *recipe]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["style"] for r in runs] == ["shard_map"] and runs[0]["ok"] and runs[0]["recipe"]["accumulate"] == 2
