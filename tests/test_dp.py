"""Data parallelism: every torch and JAX variant against its own single-device reference and the
other framework's, the ledger against shared.theory, ZeRO-1's optimizer memory, and the
DDP-like behaviour of the bucketed wrapper (broadcast on wrap, frozen and tied parameters,
no_sync accumulation, no extra parameters). One torch launch per world size runs everything.

Kept free of JAX imports at module level: spawned torch ranks import this module.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from shared.config import Config
from shared.results import comm_bytes, cross_framework_ok, parity, rel_err, within
from shared.theory import adam_state_bytes, dp_comm_bytes, zero1_comm_bytes
from shared.tolerances import FLOAT64
from torch_impl.dp import BucketedDDP, Zero1Optimizer
from torch_impl.harness import run_pattern
from torch_impl.launch import launch
from torch_impl.model import optimizer_state_bytes

WORLD_SIZES = (2, 4)
DTYPES = ("float64", "float32")


def make_cfgs(ws: int) -> list[Config]:
    return [Config(world_size=ws, layers=4, dim=16, batch=16, steps=5, dtype=d) for d in DTYPES]


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


def _torch_rank(ctx, cfgs: list[Config]):
    runs = run_pattern(ctx, "dp", cfgs)
    return runs, (wrapper_checks(ctx) if ctx.world_size == 2 else None)


# --- one launch per world size, one JAX run per world size -------------------------------------

@pytest.fixture(scope="module")
def torch_out():
    cache = {}

    def get(ws):
        if ws not in cache:
            cache[ws] = launch(_torch_rank, ws, make_cfgs(ws))
        return cache[ws]
    return get


@pytest.fixture(scope="module")
def jax_out():
    from jax_impl.harness import run_pattern as jax_run_pattern

    cache = {}

    def get(ws):
        if ws not in cache:
            cache[ws] = jax_run_pattern("dp", make_cfgs(ws))
        return cache[ws]
    return get


def _entry(entries, dtype):
    return next(e for e in entries if e["cfg"].dtype == dtype)


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_parity(torch_out, jax_out, ws, dtype):
    t, j = _entry(torch_out(ws)[0][0], dtype), _entry(jax_out(ws), dtype)
    assert len(t["runs"]) == 4 and len(j["runs"]) == 4
    for name, entry, other in (("torch", t, j), ("jax", j, t)):
        for style, variant, run in entry["runs"]:
            own, cross = parity(run, entry["reference"]), parity(run, other["reference"])
            print(f"{name} {style}/{variant} ws={ws} {dtype}: own {own} cross {cross}")
            assert within(own, dtype), (name, style, variant, own)
            assert cross_framework_ok(cross, dtype), (name, style, variant, cross)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_ledger_vs_theory(torch_out, jax_out, ws):
    for dtype in DTYPES:
        cfg = make_cfgs(ws)[DTYPES.index(dtype)]
        phi_b = dp_comm_bytes(cfg)
        runs = {(s, v): r for s, v, r in _entry(torch_out(ws)[0][0], dtype)["runs"]}
        assert runs["explicit", "naive"].comm == {"all_reduce": {"count": cfg.layers, "bytes": phi_b}}
        assert runs["explicit", "bucketed"].comm == {"all_reduce": {"count": 1, "bytes": phi_b}}
        assert runs["builtin", "ddp"].comm["all_reduce"]["bytes"] == phi_b, runs["builtin", "ddp"].comm
        zero1 = runs["explicit", "zero1"]
        assert zero1.comm == {"reduce_scatter": {"count": 1, "bytes": phi_b},
                              "all_gather": {"count": 1, "bytes": phi_b}}
        assert comm_bytes(zero1.comm) == zero1.comm_theory == zero1_comm_bytes(cfg)

        runs = {(s, v): r for s, v, r in _entry(jax_out(ws), dtype)["runs"]}
        assert set(runs["shard_map", "dp"].comm) == {"all_reduce"}  # XLA may merge into a tuple
        assert comm_bytes(runs["shard_map", "dp"].comm) == phi_b
        assert {k: v["bytes"] for k, v in runs["shard_map", "zero1"].comm.items()} == {
            "reduce_scatter": phi_b, "all_gather": phi_b}
        # jit: XLA decides. On CPU it folds the loss (b bytes) into the gradient all-reduce; for ZeRO-1
        # it all-reduces the full gradient and all-gathers the updated weights (no reduce-scatter).
        b = cfg.bytes_per_element
        assert comm_bytes(runs["jit", "dp"].comm) == phi_b + b, runs["jit", "dp"].comm
        assert comm_bytes(runs["jit", "zero1"].comm) == 2 * phi_b + b, runs["jit", "zero1"].comm


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_state_bytes(torch_out, jax_out, ws):
    for cfg in make_cfgs(ws):
        full, zero1 = adam_state_bytes(cfg, "dp"), adam_state_bytes(cfg, "zero1")
        for entry in (_entry(torch_out(ws)[0][0], cfg.dtype), _entry(jax_out(ws), cfg.dtype)):
            for _, variant, run in entry["runs"]:
                want = zero1 if variant == "zero1" else full
                assert run.state_bytes == {k: int(v) for k, v in want.items()}, (variant, run.state_bytes)


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
