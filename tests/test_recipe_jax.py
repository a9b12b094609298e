"""A real training recipe through the JAX library layer (issue 34): global-norm clipping, decay
masks, frozen parts (multi_transform), compute in a narrower dtype — exact against single-device
training with the same recipe, or refused before anything compiles (jax_impl/parallel/recipe.py).

``Tiny`` (defined here, float64; not a project model): Linear+tanh, Linear+tanh, LayerNorm, Linear —
biases, a norm's scale and bias (replicated vectors under zero2/zero3), kernels N = 2 splits, and a
forward that is a chain of modules (pp) with a colwise/rowwise pair (tp).

Tolerance: float64, 1e-12 (as test_own_model_jax: the sums are split over devices and added in
another order, ~1e-16 relative per op; 3 steps carry that to ~1e-15; a clipping or mask defect is
1e-3 or more). compute_dtype=float32 on the float64 model: 1e-5 (float32 round-off, ~1e-7 relative
per op, of a loss computed on B/N rows per device instead of B; a missing cast is 1e-8, a cast of the
master weights would change the stored dtype, which is asserted).
float16 with dynamic loss scaling: against one device with the same scaling, casts and the batch cut in
the N devices' parts (their gradients added in float64, as the psum does): 1e-12 where the devices run
the split run's ops (shard_map dp / zero1 / zero2: 3e-17 measured; two addends sum in either order
alike). Other programs for the same math round the float16 backward elsewhere: zero3's recomputation
1.4e-5, typed 3.0e-5, jit 1.6e-4 (as the whole batch on one device: 1.6e-4), after 4 steps of AdamW at
lr 3e-2 — TOL16 = 1e-3; a wrongly taken or skipped step moves the parameters by ~lr (3e-2). The skip
itself is asserted exactly (parameters bitwise unchanged, the same skipped steps, the same scale).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_impl  # noqa: F401  (float64)
from jax_impl.devices import make_mesh
from jax_impl.ledger import comm_from_hlo
from jax_impl.parallel import cp, recipe, scaling
from jax_impl.parallel.fsdp import parallelize
from jax_impl.parallel.pp import pipeline
from jax_impl.parallel.tp import PlanError, apply_plan
from jax_impl.parallel.tree import ShardReadError, WrapError, key_of

TOL, TOL32, TOL16 = 1e-12, 1e-5, 1e-3  # see the module docstring
N, B, STEPS, CLIP = 2, 4, 3, 0.2
F64 = jnp.float64


class Act(nnx.Module):
    def __init__(self, i, o, rngs):
        self.lin = nnx.Linear(i, o, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


class Tiny(nnx.Module):
    def __init__(self, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.inp, self.hid = Act(6, 8, rngs), Act(8, 8, rngs)
        self.norm = nnx.LayerNorm(8, param_dtype=F64, rngs=rngs)
        self.out = nnx.Linear(8, 4, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        return self.out(self.norm(self.hid(self.inp(x))))


def mse(pred, y):
    return jnp.mean((pred - y) ** 2)


def loss(m, x, y):
    return mse(m(x), y)


def data():
    rng = np.random.default_rng(1)
    return rng.standard_normal((B, 6)), rng.standard_normal((B, 4)) * 3


def adamw(**kw):
    return optax.adamw(3e-2, weight_decay=0.1, **kw)


def kernels(p):  # decay the matrices only
    return jax.tree.map(lambda a: a.ndim == 2, p)


def frozen(p):  # the first layer frozen
    return {k: "frozen" if k.startswith("inp.") else "train" for k in p}


def freeze():
    return optax.multi_transform({"train": adamw(), "frozen": optax.set_to_zero()}, frozen)


def flat(model):
    return {key_of(p): np.asarray(a) for p, a in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}


def single(tx, clip=None, dtype=None, loss=loss, make=Tiny, batch=None):
    """STEPS on one device: optax sees the {path: array} dict, as the wrappers' whole-tree layouts."""
    model = make()
    gdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = [key_of(p) for p, _ in leaves]
    params = {k: a for k, (_, a) in zip(keys, leaves)}
    tx = tx if clip is None else optax.chain(recipe.clip_by_global_norm(clip), tx)
    merge = lambda p: nnx.merge(gdef, jax.tree_util.tree_unflatten(treedef, [p[k] for k in keys]))
    opt, batch = tx.init(params), batch or data()
    grad = jax.grad(lambda p, *b: loss(merge(recipe.cast(p, dtype)), *b))
    grad = grad if make is Tiny else jax.jit(grad)  # Tiny: eager, its ops cached across the tests
    for _ in range(STEPS):
        grads = grad(params, *batch)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    return {k: np.asarray(a) for k, a in params.items()}


def gap(got: dict, want: dict) -> float:
    return max(float(np.max(np.abs(got[k] - want[k]))) for k in got)


def run(trainer, batch=None):
    for _ in range(STEPS):
        trainer.train_step(*(batch or data()))
    return flat(trainer.module())


# --- refused: the layout would compute another update -----------------------------------------------------

CLIPPED = lambda: optax.chain(optax.clip_by_global_norm(CLIP), adamw())  # noqa: E731


@pytest.mark.parametrize("variant", ["zero1", "zero2", "zero3"])
def test_optax_global_norm_clipping_is_refused_under_shard_map(variant):
    with pytest.raises(WrapError, match=rf"{variant}/shard_map.*scaled otherwise.*clip_by_global_norm.*clip=max_norm"):
        parallelize(Tiny(), loss, CLIPPED(), make_mesh(N, "dp"), variant, "shard_map")


@pytest.mark.parametrize("tx", [freeze, lambda: adamw(mask=kernels)], ids=["multi_transform", "mask"])
def test_masks_and_labels_are_refused_on_zero1s_flat_vector(tx):
    with pytest.raises(WrapError, match=r"zero1/shard_map: .*ONE flat 1-D piece.*style='jit'"):
        parallelize(Tiny(), loss, tx(), make_mesh(N, "dp"), "zero1", "shard_map")


@pytest.mark.parametrize("tx", [freeze, lambda: adamw(mask=kernels)], ids=["multi_transform", "mask"])
def test_masks_and_labels_are_refused_on_pps_packed_stages(tx):
    with pytest.raises(WrapError, match=r"pp: .*ONE packed \(2, Φ_max\) array.*clip=max_norm"):
        pipeline(Tiny(), STAGES, mse, tx(), make_mesh(N, "pp"), microbatches=2)


def test_a_per_tensor_statistic_is_refused_on_row_blocks():
    lamb = optax.lamb(1e-2)  # trust ratio = ‖w‖ / ‖u‖ of each tensor: a row block's is another
    with pytest.raises(WrapError, match=r"zero2/shard_map: .*First difference at 'hid.lin.kernel'"):
        parallelize(Tiny(), loss, lamb, make_mesh(N, "dp"), "zero2", "shard_map")


def test_the_probe_passes_elementwise_optimizers(measured):
    import time
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    params, times = flat(Tiny()), []
    for tx in (adamw(), optax.sgd(1e-2, momentum=0.9), optax.adam(sched)):
        for layout in (recipe.Flat(N), recipe.Rows(N, "zero2"), recipe.Rows(N, "zero3")):
            start = time.perf_counter()
            recipe.check(tx, params, layout, "probe", "-")
            times.append(time.perf_counter() - start)
    measured(f"probe on Tiny: first {times[0] * 1e3:.0f} ms (compiles eager ops unless an earlier test did), median "
             f"{np.median(times[1:]) * 1e3:.1f} ms")


def test_a_large_model_is_probed_on_a_bounded_cut(monkeypatch):
    monkeypatch.setattr(recipe, "BOUND", 100)  # as if the model were large: every dim cut to <= 6·N (12)
    params = {"a.kernel": np.ones((40, 30)), "a.bias": np.ones(31), "b.kernel": np.ones((7, 30))}
    assert {k: a.shape for k, a in recipe._bounded(params, N).items()} == {
        "a.kernel": (12, 12), "a.bias": (13,), "b.kernel": (7, 12)}  # N | 40, 30; N ∤ 31, 7: kept so
    recipe.check(adamw(), params, recipe.Rows(N, "zero2"), "probe", "-")
    with pytest.raises(WrapError, match="'a.kernel'"):
        recipe.check(CLIPPED(), params, recipe.Rows(N, "zero2"), "probe", "-")


def test_clip_must_be_a_positive_number():
    with pytest.raises(WrapError, match=r"clip=-1.*> 0"):
        parallelize(Tiny(), loss, adamw(), make_mesh(N, "dp"), "zero1", clip=-1)


# --- supported: exact against one device with the same recipe ---------------------------------------------


@pytest.mark.parametrize("style", ["shard_map", "jit"])
@pytest.mark.parametrize("variant", ["dp", "zero1", "zero2", "zero3"])
def test_clip_is_the_true_global_norm(variant, style, measured):
    trainer = parallelize(Tiny(), loss, adamw(), make_mesh(N, "dp"), variant, style, clip=CLIP)
    err = gap(run(trainer), single(adamw(), clip=CLIP))
    measured(f"clip={CLIP} {variant}/{style}: params {err:.1e} from one device")
    assert err <= TOL
    if style == "shard_map" and variant != "dp":  # the norm's psum (one float64) is in the ledger and the theory
        ledger = comm_from_hlo(trainer._compiled.as_text())
        assert ledger == {op: {"count": c, "bytes": b} for op, (c, b) in trainer.comm_theory().items()}, ledger


def test_clip_typed():
    got, want = run(parallelize(Tiny(), loss, adamw(), make_mesh(N, "dp"), "zero3", "typed", clip=CLIP)), \
        single(adamw(), clip=CLIP)
    assert gap(got, want) <= TOL
    assert gap(want, single(adamw())) > 1e-3  # the clip acts at this scale


@pytest.mark.parametrize("variant,style", [("zero2", "shard_map"), ("zero3", "shard_map"), ("zero1", "jit")])
def test_frozen_parts_where_each_leaf_keeps_its_path(variant, style):
    got = run(parallelize(Tiny(), loss, freeze(), make_mesh(N, "dp"), variant, style, clip=CLIP))
    assert gap(got, single(freeze(), clip=CLIP)) <= TOL
    assert gap({k: v for k, v in got.items() if k.startswith("inp.")}, flat(Tiny())) == 0  # frozen: unchanged


@pytest.mark.parametrize("variant,style", [("zero2", "shard_map"), ("zero1", "jit")])
def test_decay_masks_where_each_leaf_keeps_its_path(variant, style):
    tx = lambda: optax.chain(optax.clip_by_global_norm(CLIP), adamw(mask=kernels))  # noqa: E731 (jit: optax's own)
    tx = tx if style == "jit" else lambda: adamw(mask=kernels)  # noqa: E731
    got = run(parallelize(Tiny(), loss, tx(), make_mesh(N, "dp"), variant, style))
    assert gap(got, single(tx())) <= TOL


PLAN = {"inp.lin": "colwise", "hid.lin": "rowwise"}


@pytest.mark.parametrize("style", ["shard_map", "jit"])
def test_tp_clip_and_frozen_parts(style):
    got = run(apply_plan(Tiny(), PLAN, loss, freeze(), make_mesh(N, "tp"), style, clip=CLIP))
    assert gap(got, single(freeze(), clip=CLIP)) <= TOL


STAGES = [["inp", "hid"], ["norm", "out"]]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp_clip(schedule):
    got = run(pipeline(Tiny(), STAGES, mse, adamw(), make_mesh(N, "pp"), microbatches=2, clip=CLIP, schedule=schedule))
    assert gap(got, single(adamw(), clip=CLIP)) <= TOL


class Seq(nnx.Module):  # context parallelism's seam: attention through cp.attention, positions given
    def __init__(self, rngs=None):
        rngs, f64 = rngs or nnx.Rngs(0), dict(param_dtype=F64)
        self.tok, self.pos = nnx.Embed(7, 8, rngs=rngs, **f64), nnx.Embed(4, 8, rngs=rngs, **f64)
        self.attn = nnx.MultiHeadAttention(2, 8, attention_fn=cp.attention, decode=False, use_bias=False, rngs=rngs,
                                           **f64)
        self.head = nnx.Linear(8, 7, rngs=rngs, **f64)

    def __call__(self, tokens, positions):
        return self.head(self.attn(self.tok(tokens) + self.pos(positions)))


def seq_loss(m, tokens, targets, positions):
    return optax.softmax_cross_entropy_with_integer_labels(m(tokens, positions), targets).mean()


@pytest.mark.slow  # slow tier (issue 37's budget): clip= under cp is the dp code path (the whole tree), tested on dp
def test_cp_clip_and_frozen_parts():
    rng = np.random.default_rng(2)
    tokens, targets = rng.integers(0, 7, (2, 4)).astype(np.int32), rng.integers(0, 7, (2, 4)).astype(np.int32)
    tx = lambda: optax.multi_transform(  # noqa: E731
        {"train": adamw(), "frozen": optax.set_to_zero()}, lambda p: {k: "frozen" if k.startswith("tok.") else
                                                                       "train" for k in p})
    trainer = cp.context_parallel(Seq(), seq_loss, tx(), make_mesh(N, "cp"), "seq_sharded", clip=CLIP)
    got = run(trainer, (tokens, targets))
    want = single(tx(), clip=CLIP, loss=seq_loss, make=Seq, batch=(tokens, targets, jnp.arange(4)))
    assert gap(got, want) <= TOL


# --- compute in a narrower dtype, master weights as given --------------------------------------------------


@pytest.mark.parametrize("variant,style", [("zero3", "shard_map"), ("zero1", "typed")])
def test_compute_dtype_keeps_the_master_weights(variant, style):
    trainer = parallelize(Tiny(), loss, adamw(), make_mesh(N, "dp"), variant, style, compute_dtype=jnp.float32)
    got = run(trainer)
    assert {a.dtype for a in got.values()} == {np.dtype("float64")}
    want, want64 = single(adamw(), dtype=jnp.float32), single(adamw())
    assert gap(got, want) <= TOL32 < gap(want, want64) * 1e3


def cast_loss(m, x, y):  # the user's own cast: nnx.split -> astype -> nnx.merge
    gdef, state = nnx.split(m)
    return loss(nnx.merge(gdef, jax.tree.map(lambda a: a.astype(jnp.float32), state)), x, y)


def test_compute_dtype_under_tp():
    got = run(apply_plan(Tiny(), PLAN, loss, adamw(), make_mesh(N, "tp"), compute_dtype=jnp.float32))
    assert {a.dtype for a in got.values()} == {np.dtype("float64")}
    assert gap(got, single(adamw(), dtype=jnp.float32)) <= TOL32


def mapped_loss(m, x, y):  # a map over the state that returns every leaf as it is (a freeze written by hand
    gdef, state = nnx.split(m)  # would stop_gradient some): zero3's units are not in that state
    return loss(nnx.merge(gdef, jax.tree.map(lambda a: a, state)), x, y)


@pytest.mark.parametrize("make", [
    lambda: apply_plan(Tiny(), PLAN, cast_loss, adamw(), make_mesh(N, "tp")),
    lambda: parallelize(Tiny(), cast_loss, adamw(), make_mesh(N, "dp"), "zero3", "shard_map"),
    lambda: parallelize(Tiny(), mapped_loss, adamw(), make_mesh(N, "dp"), "zero3", "shard_map")],
    ids=["tp", "zero3", "zero3-identity"])
def test_a_loss_that_casts_the_model_itself_is_refused_with_the_fix(make):
    """tp's split modules and zero3's units are stand-ins in the traced model, not arrays: the user's
    tree map over the state reaches them (it crashed: no attribute 'astype'; zero3: a ShardReadError
    whose cause did not apply). A map that returns them unchanged trained a frozen unit on, silently
    (zero3: nnx.split itself is refused now). Refused at the first trace, before any update, naming
    compute_dtype=."""
    with pytest.raises((PlanError, ShardReadError), match=r"'hid.lin'.*compute_dtype="):
        make().train_step(*data())


def test_a_loss_that_casts_the_model_itself_where_the_model_is_whole():
    got = run(parallelize(Tiny(), cast_loss, adamw(), make_mesh(N, "dp"), "zero2", "shard_map"))
    assert gap(got, single(adamw(), loss=cast_loss)) <= TOL32


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_compute_dtype_under_pp(schedule):
    """pipeline(..., compute_dtype=): every stage computes from its Params cast inside the step, the
    packed master weights and their per-micro-batch gradients summed in the master dtype (1F1B: each
    micro-batch's pulled back through the cast into the packed row)."""
    trainer = pipeline(Tiny(), STAGES, mse, adamw(), make_mesh(N, "pp"), microbatches=2, compute_dtype=jnp.float32,
                       schedule=schedule)
    got = run(trainer)
    assert {a.dtype for a in got.values()} == {np.dtype("float64")} and trainer.state[0].dtype == np.float64
    assert gap(got, single(adamw(), dtype=jnp.float32)) <= TOL32


def test_compute_dtype_under_cp_ring():
    """context_parallel(..., compute_dtype=): the replicated Params made device-varying, then cast, so the
    gradient all-reduce is in the master dtype (the ledger: Φ·8 bytes)."""
    rng = np.random.default_rng(2)
    tokens, targets = rng.integers(0, 7, (2, 4)).astype(np.int32), rng.integers(0, 7, (2, 4)).astype(np.int32)
    trainer = cp.context_parallel(Seq(), seq_loss, adamw(), make_mesh(N, "cp"), "ring", compute_dtype=jnp.float32)
    got = run(trainer, (tokens, targets))
    assert {a.dtype for a in got.values()} == {np.dtype("float64")}
    want = single(adamw(), dtype=jnp.float32, loss=seq_loss, make=Seq, batch=(tokens, targets, jnp.arange(4)))
    assert gap(got, want) <= TOL32
    phi = sum(a.size for a in got.values())
    comm = comm_from_hlo(trainer._compiled.as_text())
    assert comm["all_reduce"]["bytes"] == 8 * phi  # float64 master gradients reduced, not the float32 copies


# --- float16 with dynamic loss scaling (parallel/scaling.py) -----------------------------------------------

SCALE16 = scaling.DynamicScale(init_scale=2.0**10, interval=2)  # Tiny's float16 backward overflows at 2**16;
# 2**10 does not, so only the forced spike skips; interval 2: the scale also grows within the run


def loss16(m, x, y, spike):
    """Tiny in float16 (inputs too), the loss in float32; ``spike``: a per-row term added to the gradient of
    ONE element, out.kernel[0, 0] (row 0: held by device 0 under zero2/zero3, one slice under zero1): inf on
    device 1's rows makes that element's reduced gradient inf on ONE device's piece only."""
    out = mse(m(x.astype(jnp.float16)).astype(jnp.float32), y)
    return out + jnp.mean(spike) * m.out.kernel[0, 0]


def single16(batches, parts=N):
    """One device, SCALE16 and the float16 casts, each batch cut in ``parts`` (the devices' rows)."""
    model = Tiny()
    gdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = [key_of(p) for p, _ in leaves]
    params = {k: a for k, (_, a) in zip(keys, leaves)}
    merge = lambda p: nnx.merge(gdef, jax.tree_util.tree_unflatten(treedef, [p[k] for k in keys]))
    tx, sc, skipped = adamw(), SCALE16.init(), []
    opt = tx.init(params)
    # jitted: eager float16 ops round otherwise than one compiled program (1 ulp of the gradients, measured)
    part = jax.jit(jax.grad(lambda p, s, *b: loss16(merge(recipe.cast(p, jnp.float16)), *b) / parts * s))
    for i, batch in enumerate(batches):
        r = len(batch[0]) // parts
        gs = [part(params, sc["scale"], *(a[k * r:(k + 1) * r] for a in batch)) for k in range(parts)]
        grads = SCALE16.unscale(jax.tree.map(lambda *g: sum(g), *gs), sc)
        bad = scaling.nonfinite(grads)
        updates, new_opt = tx.update(grads, opt, params)
        params, opt = scaling.keep(bad, (optax.apply_updates(params, updates), new_opt), (params, opt))
        sc, skipped = SCALE16.update(sc, bad), skipped + [i] * bool(bad)
    return {k: np.asarray(a) for k, a in params.items()}, float(sc["scale"]), skipped


def test_the_scale_follows_gradscalers_rule():
    sc, seen = SCALE16.init(), []
    for bad in (0, 1, 0, 0, 0, 1):  # skip: x0.5 and the count reset; 2 good in a row: x2
        sc = SCALE16.update(sc, jnp.float32(bad))
        seen.append(float(sc["scale"]))
    assert seen == [1024, 512, 512, 1024, 1024, 512]


SLOW = pytest.mark.slow  # issue 37's budget: the default tier keeps zero1's flat slice and zero3's units


@pytest.mark.parametrize("variant,style", [("zero1", "shard_map"), ("zero3", "shard_map"),
                                           pytest.param("dp", "shard_map", marks=SLOW),
                                           pytest.param("zero2", "shard_map", marks=SLOW),
                                           pytest.param("zero3", "jit", marks=SLOW),
                                           pytest.param("zero1", "typed", marks=SLOW)])
def test_float16_loss_scaling_skips_on_every_device_together(variant, style, measured):
    """Step 0: inf in ONE device's gradient piece only -> every device skips it (params bitwise as they
    were, the scale halved); then 3 steps against one device with the same scaling (1e-12)."""
    x, y = data()
    spike = np.where(np.arange(B) >= B // N, np.inf, 0.0)  # device 1's rows
    units = ["inp", "hid", "norm"] if variant == "zero3" and style == "shard_map" else None  # out: gathered by
    trainer = parallelize(Tiny(), loss16, adamw(), make_mesh(N, "dp"), variant, style, units=units,  # the root
                          compute_dtype=jnp.float16, loss_scale=SCALE16)  # (loss16 reads its kernel)
    before = flat(trainer.module())
    trainer.train_step(x, y, spike)
    assert gap(flat(trainer.module()), before) == 0.0 and float(trainer.state[2]["scale"]) == 512.0
    batches = [(x, y, spike)] + [(x * (1 + 0.1 * k), y, np.zeros(B)) for k in range(STEPS)]
    for batch in batches[1:]:
        trainer.train_step(*batch)
    want, scale, skipped = single16(batches)
    err = gap(flat(trainer.module()), want)
    measured(f"float16 {variant}/{style}: params {err:.1e} from one device (split), "
             f"{gap(single16(batches, parts=1)[0], want):.1e} split vs whole")
    assert skipped == [0] and float(trainer.state[2]["scale"]) == scale == 1024.0  # skipped, grew after 2 good
    same = style == "shard_map" and variant != "zero3"  # the split run's ops; zero3 recomputes (checkpoint)
    assert err <= (TOL if same else TOL16) and TOL < gap(single16(batches, parts=1)[0], want)
    if style == "shard_map" and variant != "dp":  # the flag's pmax (one float32) in the ledger and the theory
        ledger = comm_from_hlo(trainer._compiled.as_text())
        theory = {op: {"count": c, "bytes": b} for op, (c, b) in trainer.comm_theory().items()}
        assert ledger["all_reduce"] == theory["all_reduce"], ledger


def test_float16_under_pp():
    """pipeline(..., compute_dtype=float16): the packed gradient is a global array, the finite check over
    it XLA's (one more all-reduce, of its 1-byte flag: ledger = theory). 2**40 overflows the
    float16 cast's backward: skipped (bitwise unchanged, scale halved); then 3 steps at 2**10 against one
    device with the same cast, unscaled (a power of two: the same numbers but for underflow; the float16
    cotangents are rounded per micro-batch there: 2.5e-4 measured, TOL16)."""
    trainer = pipeline(Tiny(), STAGES, mse, adamw(), make_mesh(N, "pp"), microbatches=2, compute_dtype=jnp.float16,
                       loss_scale=scaling.DynamicScale(init_scale=2.0**40))
    before = flat(trainer.module())
    trainer.train_step(*data())
    assert gap(flat(trainer.module()), before) == 0.0 and float(trainer.state[2]["scale"]) == 2.0**39
    ledger = comm_from_hlo(trainer._compiled.as_text())
    assert ledger == {op: {"count": c, "bytes": b} for op, (c, b) in trainer.comm_theory().items()}, ledger
    trainer.state = (*trainer.state[:2], jax.device_put(SCALE16.init(), trainer.state[2]["scale"].sharding))
    assert gap(run(trainer), single(adamw(), dtype=jnp.float16)) <= TOL16  # 2.5e-4: float16 cotangents per micro-batch


def test_float16_under_cp_ring():
    """context_parallel(..., compute_dtype=float16): the gradients leave the ring whole (the all-reduce of
    the transpose), so the finite check is global as it stands. A scale of 2**40 overflows the float16
    backward: the step is skipped (parameters bitwise unchanged, scale halved); then 3 steps at 2**10
    against one device computing in float16 without scaling (a power of two: the same numbers but for
    underflow; the ring sums in another order: 8.8e-5 measured, TOL16)."""
    rng = np.random.default_rng(2)
    tokens, targets = rng.integers(0, 7, (2, 4)).astype(np.int32), rng.integers(0, 7, (2, 4)).astype(np.int32)
    trainer = cp.context_parallel(Seq(), seq_loss, adamw(), make_mesh(N, "cp"), "ring", compute_dtype=jnp.float16,
                                  loss_scale=scaling.DynamicScale(init_scale=2.0**40))
    before = flat(trainer.module())
    trainer.train_step(tokens, targets)
    assert gap(flat(trainer.module()), before) == 0.0 and float(trainer.state[2]["scale"]) == 2.0**39
    trainer.state = (*trainer.state[:2], jax.device_put(SCALE16.init(), trainer.state[2]["scale"].sharding))
    got = run(trainer, (tokens, targets))
    want = single(adamw(), dtype=jnp.float16, loss=seq_loss, make=Seq, batch=(tokens, targets, jnp.arange(4)))
    assert gap(got, want) <= TOL16 and float(trainer.state[2]["scale"]) == 2.0**10  # 3 good steps of 2000: kept


# --- the held-out audit's findings (scripts/recipe_audit.py) ---------------------------------------------


def test_clip_with_multisteps_is_refused():
    """clip= scales each call's (micro-batch's) gradient by its own norm; MultiSteps steps with the mean of
    K calls, whose norm is another: 4.7e-2 off on the audit's GPT (Llama-style recipe), silently."""
    ms = optax.MultiSteps(adamw(), 2)
    with pytest.raises(WrapError, match=r"parallelize: clip=0.2 with an optax.MultiSteps.*Fix: accumulate in the loss"):
        parallelize(Tiny(), loss, ms, make_mesh(N, "dp"), "dp", "shard_map", clip=CLIP)
    inner = optax.chain(optax.scale(1.0), optax.MultiSteps(adamw(), 2).gradient_transformation())  # found in a chain
    with pytest.raises(WrapError, match="MultiSteps"):
        pipeline(Tiny(), STAGES, mse, inner, make_mesh(N, "pp"), microbatches=2, clip=CLIP)


class Stack(nnx.Module):  # compose's shape: an embedding, an nnx.List of identical blocks, a head
    def __init__(self, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.embed = nnx.Embed(7, 8, rngs=rngs, param_dtype=F64)
        self.blocks = nnx.List([Act(8, 8, rngs) for _ in range(2)])
        self.head = nnx.Linear(8, 7, rngs=rngs, param_dtype=F64)


def test_compose_probes_the_stacked_tree():
    """compose hands optax {"rest": ..., "blocks": (S, L/S, …) stacked}: a mask by ndim decays the blocks'
    biases (3-D there) — refused before compiling; an elementwise optimizer passes."""
    from jax_impl.parallel.compose import Split, compose
    split = Split(first=("embed",), blocks="blocks", last=("head",), embed=lambda r, m, t, p: m["embed"](t),
                  block=lambda r, layer, h, p: layer(h), head=lambda r, m, h: m["head"](h))
    ce = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()  # noqa: E731
    with pytest.raises(WrapError, match=r"compose: .*the layers stacked.*First difference at 'blocks.0.lin.bias'"):
        compose(Stack(), {"dp": N}, ce, adamw(mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)), split=split)
    compose(Stack(), {"dp": N}, ce, adamw(), split=split)


def test_pp_refuses_a_chain_whose_modules_fail():
    """A forward that is not a chain (the audit's GPT: two embeddings added, a tied head) crashed in Flax's own
    check ("Input type must be an integer") at the first step; now one WrapError, before compiling."""
    trainer = pipeline(Tiny(), [["norm", "inp"], ["hid", "out"]], mse, adamw(), make_mesh(N, "pp"), microbatches=2)
    with pytest.raises(WrapError, match=r"pp: the chain of the stages' modules fails at stage 0 .*in order"):
        trainer.train_step(*data())


def test_the_probe_sees_through_multisteps_and_a_warmup_from_zero():
    """MultiSteps(K=2) updates every 2nd call and a warmup from 0 makes its first update 0: the probe's 3 calls
    saw one zero update and passed a mask on zero1's flat vector (the audit: 6.0e-3 off) and optax's clip
    under zero2 (a JAX crash). It now runs 12 calls for an accumulating tx."""
    sched = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 2, 3)
    masked = optax.MultiSteps(optax.adamw(sched, weight_decay=0.1, mask=kernels), 2)
    with pytest.raises(WrapError, match=r"zero1/shard_map: .*ONE flat 1-D piece"):
        parallelize(Tiny(), loss, masked, make_mesh(N, "dp"), "zero1", "shard_map")
    clipped = optax.MultiSteps(optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(sched)), 2)
    with pytest.raises(WrapError, match=r"zero2/shard_map: .*scaled otherwise"):
        parallelize(Tiny(), loss, clipped, make_mesh(N, "dp"), "zero2", "shard_map")
