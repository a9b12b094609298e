"""Data parallelism: every torch and JAX variant, on both models, against its own single-device
reference and the other framework's, the ledger against shared.theory, ZeRO-1's optimizer
memory, and the DDP-like behaviour of the bucketed wrapper (broadcast on wrap, frozen and tied
parameters, no_sync accumulation, no extra parameters). One torch launch per world size runs
everything (MLP and transformer, float64 and float32). XLA compiles each transformer step for
~4 CPU-seconds, so the default run takes the JAX MLP at world size 2 and the transformer at world size 4 in
float64 (and the JAX float32 reference, for torch's cross-framework check); ``-m slow`` adds the JAX transformer in
float32 at world size 2, and the bucketed-vs-DDP step time (measured and reported, not asserted).

Kept free of JAX imports at module level: spawned torch ranks import this module.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from typed_expect import split_params, stated_kinds, zero_ledger

from shared.config import Config
from shared.problem import param_names
from shared.results import comm_bytes, cross_framework_ok, parity, rel_err, within
from shared.theory import adam_state_bytes, dp_comm_bytes, zero1_comm_bytes
from shared.tolerances import FLOAT32, FLOAT64
from torch_impl.harness import run_pattern
from torch_impl.launch import launch
from torch_impl.model import optimizer_state_bytes
from torch_impl.parallel.dp import BucketedDDP, Zero1Optimizer

WORLD_SIZES = (2, 4)
DTYPES = ("float64", "float32")
MODELS = ("mlp", "transformer")
# The lean default: the JAX transformer configs run without -m slow (see the module docstring).
JAX_TRANSFORMER_DTYPES = {2: (), 4: ("float64",)}


def make_cfgs(ws: int, model: str = "mlp", dtypes=DTYPES) -> list[Config]:
    if model == "mlp":
        return [Config(world_size=ws, layers=4, dim=16, batch=16, steps=5, dtype=d) for d in dtypes]
    return [Config(world_size=ws, model="transformer", layers=2, dim=16, heads=4, seq=8, vocab=32, batch=8,
                   steps=3, dtype=d) for d in dtypes]


def all_cfgs(ws: int) -> list[Config]:
    return make_cfgs(ws) + make_cfgs(ws, "transformer")


def jax_cfgs(ws: int, full: bool = False) -> list[Config]:
    """The MLP at world size 2 (both dtypes, every style); at 4 the transformer alone (the MLP's world-size-4
    runs are the same step code at another device count: ~9 s of compiling, issue 46; ``full``: both)."""
    mlp = make_cfgs(ws) if full or ws == 2 else []
    return mlp + make_cfgs(ws, "transformer", DTYPES if full else JAX_TRANSFORMER_DTYPES[ws])


# --- rank-side checks of the wrapper and ZeRO-1 on a module with every awkward case -----------

class Toy(nn.Module):
    """A bias, a frozen layer, one weight shared by two layers, a buffer. Trainable and unique:
    inp.weight (25) + inp.bias (5) + enc.weight (25) = 55 elements, odd: ZeRO-1 must pad."""

    def __init__(self, dim: int = 5):
        super().__init__()
        self.inp = nn.Linear(dim, dim, dtype=torch.float64)
        self.frozen = nn.Linear(dim, dim, bias=False, dtype=torch.float64).requires_grad_(False)
        self.enc = nn.Linear(dim, dim, bias=False, dtype=torch.float64)
        self.dec = nn.Linear(dim, dim, bias=False, dtype=torch.float64)
        self.dec.weight = self.enc.weight  # tied: one Parameter used twice
        self.register_buffer("scale", torch.ones(dim, dtype=torch.float64))

    def forward(self, x):
        h = torch.tanh(self.enc(self.frozen(torch.tanh(self.inp(x)))))
        return self.dec(h) * self.scale


TOY_TRAINABLE_BYTES = 55 * 8


def _toy(seed: int) -> Toy:
    torch.manual_seed(seed)
    model = Toy()
    model.scale.fill_(1.0 + seed)
    return model


def _flat_state(module: nn.Module) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1) for t in module.state_dict().values()]).numpy().copy()


def _grad_err(model: nn.Module, ref: nn.Module) -> float:
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()) if p.requires_grad]
    return rel_err([a.numpy() for a, _ in pairs], [b.numpy() for _, b in pairs])


def wrapper_checks(ctx) -> dict:
    r, n = ctx.rank, ctx.world_size
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(123), dtype=torch.float64)  # (B, D)
    rows = 16 // n
    xl = x[r * rows:(r + 1) * rows]  # (B/dp, D)
    out = {}

    model = _toy(seed=r)  # every rank starts different
    out["before"] = _flat_state(model)
    ddp = BucketedDDP(model, bucket_mb=25.0)
    out["after"] = _flat_state(model)
    out["same_params"] = [id(p) for p in ddp.parameters()] == [id(p) for p in model.parameters()]
    out["same_state"] = sorted(k.removeprefix("module.") for k in ddp.state_dict()) == sorted(model.state_dict())
    names = {id(p): k for k, p in model.named_parameters()}
    out["buckets"] = [[names[id(p)] for p in b["params"]] for b in ddp.buckets]

    ref = Toy()  # one process, whole global batch, rank 0's weights
    ref.load_state_dict(model.state_dict())
    ref(x).pow(2).mean().backward()
    with ctx.ledger.recording():
        ddp(xl).pow(2).mean().backward()
        ddp.finish_gradient_synchronization()
    out["step_comm"] = ctx.ledger.summary()
    out["grad_err"] = _grad_err(model, ref)
    out["frozen_grad_is_none"] = model.frozen.weight.grad is None

    ddp.zero_grad()  # gradient accumulation: two micro-batches, the first without communication
    half = rows // 2
    with ctx.ledger.recording(), ddp.no_sync():
        (ddp(xl[:half]).pow(2).mean() / 2).backward()
    out["no_sync_comm"] = ctx.ledger.summary()
    with ctx.ledger.recording():
        (ddp(xl[half:]).pow(2).mean() / 2).backward()
        ddp.finish_gradient_synchronization()
    out["sync_comm"] = ctx.ledger.summary()
    out["accum_err"] = _grad_err(model, ref)

    tiny = BucketedDDP(_toy(seed=0), bucket_mb=1e-6)  # one bucket per parameter
    names = {id(p): k for k, p in tiny.module.named_parameters()}
    out["tiny_buckets"] = [[names[id(p)] for p in b["params"]] for b in tiny.buckets]
    with ctx.ledger.recording():
        tiny(xl).pow(2).mean().backward()
        tiny.finish_gradient_synchronization()
    out["tiny_comm"] = ctx.ledger.summary()

    model, ref = _toy(seed=0), _toy(seed=0)  # ZeRO-1 around another optimizer, with padding
    opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        model(xl).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
    out["zero1_param_err"] = rel_err(_flat_state(model), _flat_state(ref))
    out["zero1_state_bytes"] = optimizer_state_bytes(opt.local)
    return out


# float16 (mixed, dynamic loss scaling), inside the world-size-2 launch: the tiny MLP, ZeRO-1 (the found-inf
# flag over the slices) and DDP (torch's own wrapper, our scaler around it)
F16 = Config(world_size=2, layers=2, dim=8, batch=4, steps=3, dtype="float16", precision="mixed")
F16_VARIANTS = [("explicit", "zero1"), ("builtin", "ddp")]


def _torch_rank(ctx, cfgs: list[Config]):
    runs = run_pattern(ctx, "dp", cfgs)
    if ctx.world_size != 2:
        return runs, None
    checks = wrapper_checks(ctx)
    checks["float16"] = run_pattern(ctx, "dp", [F16], F16_VARIANTS)  # rank 0's answer (None elsewhere)
    return runs, checks


# --- one launch per world size, one JAX run per world size -------------------------------------

@pytest.fixture(scope="module")
def torch_out():
    cache = {}

    def get(ws):
        if ws not in cache:
            cache[ws] = launch(_torch_rank, ws, all_cfgs(ws))
        return cache[ws]
    return get


@pytest.fixture(scope="module")
def jax_out():
    from jax_impl.harness import run_pattern as jax_run_pattern

    cache = {}

    def get(ws):
        if ws not in cache:  # typed on the MLP only (suite budget): its steps are model-generic
            # (parallel.fsdp.parallelize); the typed transformer trains in test_mesh, test_tp, test_cp
            from jax_impl.dp import VARIANTS as JAX_VARIANTS

            untyped = [sv for sv in JAX_VARIANTS if sv[0] != "typed"]
            cfgs = jax_cfgs(ws)
            cache[ws] = jax_run_pattern("dp", [c for c in cfgs if c.model == "mlp"]) + \
                jax_run_pattern("dp", [c for c in cfgs if c.model != "mlp"], untyped)
        return cache[ws]
    return get


def _entry(entries, dtype, model="mlp"):
    return next((e for e in entries if e["cfg"].dtype == dtype and e["cfg"].model == model), None)


@pytest.fixture(scope="module")
def jax_ref(jax_out):
    """JAX's single-device reference of a config (any world size: the reference ignores it)."""
    cache = {}

    def get(cfg):
        key = (cfg.model, cfg.dtype)
        if key not in cache:
            entry = _entry([e for ws in WORLD_SIZES for e in jax_out(ws)], cfg.dtype, cfg.model)
            if entry is None:
                from jax_impl import reference as jax_reference
                from shared.problem import make_problem

                cache[key] = jax_reference.train(cfg.replace(world_size=1), make_problem(cfg))
            else:
                cache[key] = entry["reference"]
        return cache[key]
    return get


def check_parity(t, j, j_ref, ws):
    """t, j: one config's torch and JAX entries (j None: JAX not run there); j_ref: the JAX reference."""
    dtype, model = t["cfg"].dtype, t["cfg"].model
    for name, entry, other_ref in (("torch", t, j_ref), ("jax", j, t["reference"])):
        if entry is None:
            continue
        # jax: shard_map, jit and typed × dp, zero1 (the default tier's transformer: no typed)
        typed = sum(style == "typed" for style, _, _ in entry["runs"])
        assert len(entry["runs"]) == 4 + typed and typed in ((0,) if name == "torch" else (2,) if model == "mlp"
                                                             else (0, 2)), entry["runs"]
        for style, variant, run in entry["runs"]:
            own, cross = parity(run, entry["reference"]), parity(run, other_ref)
            print(f"{name} {model} {style}/{variant} ws={ws} {dtype}: own {own} cross {cross}")
            assert within(own, dtype), (name, model, style, variant, own)
            assert cross_framework_ok(cross, dtype), (name, model, style, variant, cross)


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", MODELS)
def test_parity(torch_out, jax_out, jax_ref, ws, dtype, model):
    t, j = _entry(torch_out(ws)[0][0], dtype, model), _entry(jax_out(ws), dtype, model)
    check_parity(t, j, jax_ref(t["cfg"]), ws)


def check_ledger(t, j):
    """Ledger == theory for one config's torch entry t and JAX entry j (None: not run)."""
    cfg = t["cfg"]
    phi_b = dp_comm_bytes(cfg)
    runs = {(s, v): r for s, v, r in t["runs"]}
    assert runs["explicit", "naive"].comm == {  # one all-reduce per parameter tensor
        "all_reduce": {"count": len(param_names(cfg)), "bytes": phi_b}}
    assert runs["explicit", "bucketed"].comm == {"all_reduce": {"count": 1, "bytes": phi_b}}
    assert runs["builtin", "ddp"].comm["all_reduce"]["bytes"] == phi_b, runs["builtin", "ddp"].comm
    zero1 = runs["explicit", "zero1"]
    assert zero1.comm == {"reduce_scatter": {"count": 1, "bytes": phi_b},
                          "all_gather": {"count": 1, "bytes": phi_b}}
    assert comm_bytes(zero1.comm) == zero1.comm_theory == zero1_comm_bytes(cfg)
    if j is not None:
        runs = {(s, v): r for s, v, r in j["runs"]}
        assert set(runs["shard_map", "dp"].comm) == {"all_reduce"}  # XLA may merge into a tuple
        assert comm_bytes(runs["shard_map", "dp"].comm) == phi_b
        assert {k: v["bytes"] for k, v in runs["shard_map", "zero1"].comm.items()} == {
            "reduce_scatter": phi_b, "all_gather": phi_b}
        # jit: XLA decides. On CPU it folds the loss (b bytes) into the gradient all-reduce; for ZeRO-1
        # it all-reduces the full gradient and all-gathers the updated weights (no reduce-scatter).
        b = cfg.bytes_per_element
        assert comm_bytes(runs["jit", "dp"].comm) == phi_b + b, runs["jit", "dp"].comm
        assert comm_bytes(runs["jit", "zero1"].comm) == 2 * phi_b + b, runs["jit", "zero1"].comm
        # typed (sharding in types): XLA's choice per platform (tests/typed_expect.py); what was stated
        if ("typed", "dp") not in runs:  # the transformer's typed runs: slow tier only
            return
        for variant in ("dp", "zero1"):
            run = runs["typed", variant]
            want = zero_ledger(cfg, variant, run.where["platform"])
            assert want is None or run.comm == want, (variant, run.comm, want)
        assert runs["typed", "dp"].extra["stated"] == []  # nothing to state: P() weights, P('dp') batch
        n = len(split_params(cfg, "zero1"))  # grads and weights sliced to the rows, updated rows gathered
        assert stated_kinds(runs["typed", "zero1"]) == {"slice": 2 * n, "gather": n}


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("model", MODELS)
def test_ledger_vs_theory(torch_out, jax_out, ws, model):
    for dtype in DTYPES:
        check_ledger(_entry(torch_out(ws)[0][0], dtype, model), _entry(jax_out(ws), dtype, model))


def check_state_bytes(entries):
    """Per-rank params/grads/AdamW bytes == the ZeRO table (shared.theory) with the model's Φ."""
    for entry in entries:
        cfg = entry["cfg"]
        full, zero1 = adam_state_bytes(cfg, "dp"), adam_state_bytes(cfg, "zero1")
        for _, variant, run in entry["runs"]:
            want = zero1 if variant == "zero1" else full
            assert run.state_bytes == {k: int(v) for k, v in want.items()}, (cfg, variant, run.state_bytes)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_state_bytes(torch_out, jax_out, ws):
    check_state_bytes(torch_out(ws)[0][0] + jax_out(ws))


@pytest.mark.slow
def test_jax_transformer_in_float32(torch_out):
    """The JAX transformer in float32 at world size 2, against torch's (float64 at 2 and float32 at 4
    prove no more than the default's float64 at 4 and this)."""
    from jax_impl.harness import run_pattern as jax_run_pattern

    for j in jax_run_pattern("dp", make_cfgs(2, "transformer", ("float32",))):
        t = _entry(torch_out(2)[0][0], j["cfg"].dtype, "transformer")
        check_parity(t, j, j["reference"], 2)
        check_ledger(t, j)
        check_state_bytes([j])

# --- speed: the bucketed wrapper against DistributedDataParallel --------------------------------

SPEED_CFG = Config(world_size=4, layers=8, dim=512, batch=512, steps=8, dtype="float32")


def bucketed_vs_ddp(ctx, cfg: Config = SPEED_CFG, repeats: int = 5) -> dict[str, dict[str, list[float]]]:
    """Rank side: step times and losses of explicit/bucketed and builtin/ddp, both built side by
    side and stepped alternately (bucketed, DDP, bucketed, …) ``repeats`` times after 2 warm-up
    steps each (DDP rebuilds its buckets after the first), so both see the same machine load."""
    import time

    from shared.problem import make_problem
    from torch_impl import dp

    problem = make_problem(cfg)
    setups = {v: dp.make_setup(cfg, problem, s, v, ctx) for s, v in (("explicit", "bucketed"), ("builtin", "ddp"))}
    out = {v: {"times": [], "losses": []} for v in setups}
    for k in range(repeats + 2):
        for variant, setup in setups.items():
            t0 = time.perf_counter()
            loss = setup.forward_backward()
            setup.update()
            out[variant]["losses"].append(loss.item())
            if k >= 2:
                out[variant]["times"].append(time.perf_counter() - t0)
    return out


@pytest.mark.slow
def test_bucketed_step_time_measured_against_ddp(measured):
    """The issue's target, bucketed <= 1.05 x DDP (median over >= 5 interleaved repeats; 41 here), is
    a speed of one machine under its load, not a property of the code: measured and reported in the
    run's summary ("measured, not asserted"), not asserted (1.023-1.025 in three runs on a quiet
    2-core machine, docs/dp.md; single steps vary +-40 % on a shared one). Asserted, on any machine:
    both were timed over the same number of interleaved steps, and they trained alike (every step's
    loss on every rank within the float32 tolerance: the ratio compares the same training, not a
    wrapper that skipped work)."""
    steps = 41
    per_rank = launch(bucketed_vs_ddp, SPEED_CFG.world_size, SPEED_CFG, steps)
    for rank, out in enumerate(per_rank):
        assert [len(out[v]["times"]) for v in ("bucketed", "ddp")] == [steps, steps], rank
        assert all(0 < t < float("inf") for v in out.values() for t in v["times"]), rank
        # float32: the two reduce the same gradients in other bucket layouts (ulps), AdamW on both
        assert rel_err(out["bucketed"]["losses"], out["ddp"]["losses"]) <= FLOAT32, (rank, out)
    times = {v: per_rank[0][v]["times"] for v in ("bucketed", "ddp")}  # rank 0's
    ratio = float(np.median(times["bucketed"]) / np.median(times["ddp"]))
    ms = {v: round(float(np.median(t)) * 1e3, 1) for v, t in times.items()}
    measured(f"bucketed / DDP median step time {ratio:.3f} (target <= 1.05; rank 0, {steps} interleaved steps, "
             f"L=8, D=512, B=512, float32, N=4): bucketed {ms['bucketed']} ms, DDP {ms['ddp']} ms")


# --- the wrapper's DDP-like behaviour (rank-side checks from the world-size-2 launch) ---------------


def test_bucketed_broadcasts_rank0_on_wrap(torch_out):
    checks = [c for _, c in torch_out(2)]
    assert not np.array_equal(checks[0]["before"], checks[1]["before"])  # ranks started different
    for c in checks:
        np.testing.assert_array_equal(c["after"], checks[0]["before"])  # params and buffers


def test_bucketed_skips_frozen_and_sends_tied_once(torch_out):
    for _, c in torch_out(2):
        assert c["buckets"] == [["enc.weight", "inp.bias", "inp.weight"]]  # reverse order, no frozen
        assert c["step_comm"] == {"all_reduce": {"count": 1, "bytes": TOY_TRAINABLE_BYTES}}
        assert c["frozen_grad_is_none"]
        assert c["grad_err"] <= FLOAT64  # = the single-process gradient of the global batch


def test_bucketed_no_sync_accumulates_the_large_batch_gradient(torch_out):
    for _, c in torch_out(2):
        assert c["no_sync_comm"] == {}
        assert c["sync_comm"] == {"all_reduce": {"count": 1, "bytes": TOY_TRAINABLE_BYTES}}
        assert c["accum_err"] <= FLOAT64


def test_bucketed_adds_no_parameters_and_buckets_by_size(torch_out):
    for _, c in torch_out(2):
        assert c["same_params"] and c["same_state"]
        assert c["tiny_buckets"] == [["enc.weight"], ["inp.bias"], ["inp.weight"]]
        assert c["tiny_comm"] == {"all_reduce": {"count": 3, "bytes": TOY_TRAINABLE_BYTES}}


def test_zero1_wraps_any_optimizer_with_padding(torch_out):
    for _, c in torch_out(2):
        assert c["zero1_param_err"] <= FLOAT64
        assert c["zero1_state_bytes"] == 28 * 8  # SGD momentum for ceil(55 / 2) elements


def test_float16_loss_scaling(torch_out):
    """--precision mixed --dtype float16: ok against the single-device float16 run (the same LossScaler)
    within its measured floor; the same skipped steps and final scale; the ledger: + one 4-byte
    all-reduce (the found-inf flag, agreed over the ranks) on top of bf16's float32 reductions."""
    from shared.results import make_result

    (entry,) = torch_out(2)[0][1]["float16"]
    ref = entry["reference"]
    assert [(s, v) for s, v, _ in entry["runs"]] == F16_VARIANTS
    for style, variant, run in entry["runs"]:
        row = make_result("dp", "torch", style, variant, F16, run, ref)
        assert row.ok, (variant, row.extra["mixed"])
        assert (run.extra["skipped_steps"], run.extra["loss_scale"]) == (ref.extra["skipped_steps"],
                                                                        ref.extra["loss_scale"]), run.extra
        assert comm_bytes(run.comm) == run.comm_theory, (variant, run.comm, run.comm_theory)
        assert run.comm["all_reduce"]["count"] == (2 if variant == "ddp" else 1), run.comm  # + the flag


def test_bad_input():
    with pytest.raises(ValueError, match="not divisible"):
        Config(world_size=4, batch=10).check("dp")
    with pytest.raises(ValueError, match="bucket_mb"):
        Config(bucket_mb=0)
    with pytest.raises(ValueError, match="bucket_mb"):
        BucketedDDP(nn.Linear(2, 2), bucket_mb=-1.0)  # before any process group is needed


def test_jax_jit_zero1_with_uneven_dim_keeps_moments_replicated():
    """GSPMD needs even shards: with D % N != 0 jit/zero1 still trains correctly, unsharded."""
    from jax_impl import dp as jax_dp
    from jax_impl import reference as jax_reference
    from shared.problem import make_problem

    cfg = Config(world_size=3, layers=1, dim=16, batch=15, steps=3)
    problem = make_problem(cfg)
    run = jax_dp.train(cfg, problem, "jit", "zero1", jax_dp.mesh_for(cfg))
    assert within(parity(run, jax_reference.train(cfg, problem)), cfg.dtype)
    assert run.state_bytes["optimizer"] == adam_state_bytes(cfg, "dp")["optimizer"]


def test_jax_bad_input():
    from jax_impl import dp as jax_dp
    from shared.problem import make_problem

    cfg = Config(world_size=3, layers=1, dim=16, batch=15)
    with pytest.raises(ValueError, match="unknown style/variant"):
        jax_dp.train(cfg, make_problem(cfg), "pmap", "dp", jax_dp.mesh_for(cfg))
