"""The hand-written FSDP wrapper (torch_impl.parallel.fsdp.FSDP) on its own, in ONE launch at world size 2:
- bit for bit: float32, plain SGD, 3 steps, every parameter torch.equal to non-parallel training of
  the same batch as 2 accumulated micro-batches (the same computation split the same way: what the
  code guarantees on every machine), for the wrapper and for FSDP2; against FULL-batch training
  within the float32 tolerance, the difference in ulp measured and reported, not asserted (it is
  the BLAS kernel's blocking, i.e. the machine's; see docs/fsdp.md);
- mixed precision: compute_dtype=bfloat16 against FSDP2 with MixedPrecisionPolicy(bf16, fp32);
  gradients and master weights stay float32;
- any module: padding (row counts not divisible by N), biases and a tied embedding / head."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from shared.config import Config
from shared.problem import make_problem
from shared.results import rel_err
from shared.tolerances import FLOAT32
from torch_impl.launch import launch
from torch_impl.model import build_model, inputs, loss_fn, targets
from torch_impl.parallel.fsdp import FSDP

STEPS, LR = 3, 0.1


def sgd_steps(model, x, y, fsdp=None):
    """STEPS of plain SGD; returns the losses. ``fsdp``: the wrapper to synchronise."""
    opt, losses = torch.optim.SGD(model.parameters(), lr=LR), []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        if fsdp is not None:
            fsdp.finish_gradient_synchronization()
        opt.step()
        losses.append(loss.item())
    return losses


def sgd_steps_accumulated(model, x, y, n: int):
    """Non-parallel training of the same global batch as n micro-batches (the ranks' shards, in rank
    order), gradients accumulated then divided by n: what every framework's gradient accumulation
    does. Each micro-batch's backward is the very computation one FSDP rank runs on its shard."""
    opt, rows = torch.optim.SGD(model.parameters(), lr=LR), x.shape[0] // n
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for i in range(n):
            part = slice(i * rows, (i + 1) * rows)
            loss_fn(model(x[part]), None if y is None else y[part]).backward()
        for p in model.parameters():
            p.grad.div_(n)
        opt.step()


def fsdp2(model, mp=None):
    mesh = init_device_mesh("cpu", (2,))
    for block in getattr(model, "blocks", None) or model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
    return fully_shard(model, mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())


def full_params(model) -> dict:
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.named_parameters()}


def bit_for_bit(ctx, cfg):
    problem = make_problem(cfg)
    x, y, rows = inputs(cfg, problem), targets(cfg, problem), cfg.batch // 2
    mine = slice(ctx.rank * rows, (ctx.rank + 1) * rows)
    ref = build_model(cfg, problem)
    sgd_steps(ref, x, y)  # non-parallel training on the full batch
    accumulated = build_model(cfg, problem)
    sgd_steps_accumulated(accumulated, x, y, 2)  # non-parallel, the batch as 2 accumulated micro-batches
    wrapped = FSDP(build_model(cfg, problem))
    sgd_steps(wrapped, x[mine], None if y is None else y[mine], wrapped)
    builtin = fsdp2(build_model(cfg, problem))
    sgd_steps(builtin, x[mine], None if y is None else y[mine])
    ours, theirs, want = wrapped.full_state_dict(), full_params(builtin), full_params(ref)
    acc = full_params(accumulated)
    max_ulp = lambda got: max(ulps(got[n], want[n]) for n in want)
    err = lambda got: rel_err([got[n].detach().numpy() for n in want], [want[n].detach().numpy() for n in want])
    return {"keys": list(ours) == list(want),
            "fsdp_equal_accumulated": [n for n in acc if torch.equal(ours[n], acc[n])],
            "fsdp2_equal_accumulated": [n for n in acc if torch.equal(theirs[n], acc[n])],
            # against FULL-batch training (measured: the machine's BLAS decides, see full_batch_ulps)
            "fsdp_equal": [n for n in want if torch.equal(ours[n], want[n])],
            "fsdp2_equal": [n for n in want if torch.equal(theirs[n], want[n])],
            "fsdp_max_ulp": max_ulp(ours), "fsdp2_max_ulp": max_ulp(theirs),
            "accumulated_max_ulp": max_ulp(acc),  # one process, no distributed code at all
            "fsdp_rel_err": err(ours), "fsdp2_rel_err": err(theirs), "names": list(want)}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in float32 units in the last place: the number of float32
    values between them (0: the same bits; across zero counted through it: +0 and -0 are 0 apart)."""
    assert a.dtype == b.dtype == torch.float32, (a.dtype, b.dtype)
    ordered = lambda t: (lambda i: torch.where(i < 0, -(i & 0x7FFFFFFF), i))(t.contiguous().view(torch.int32).long())
    return int((ordered(a) - ordered(b)).abs().max())


def mixed_precision(ctx):
    cfg = Config(world_size=2, model="transformer", layers=2, dim=32, heads=2, seq=8, vocab=64, batch=8,
                 dtype="float32")
    problem = make_problem(cfg)
    x, y = inputs(cfg, problem)[ctx.rank * 4:(ctx.rank + 1) * 4], targets(cfg, problem)[ctx.rank * 4:(ctx.rank + 1) * 4]
    wrapped = FSDP(build_model(cfg, problem), compute_dtype=torch.bfloat16)
    ours = sgd_steps(wrapped, x, y, wrapped)
    dtypes = {str(p.dtype) for p in wrapped.parameters()} | {str(p.grad.dtype) for p in wrapped.parameters()}
    builtin = fsdp2(build_model(cfg, problem), MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                   reduce_dtype=torch.float32))
    theirs = sgd_steps(builtin, x, y)
    a, b = wrapped.full_state_dict(), {n: t.detach() for n, t in full_params(builtin).items()}
    return {"dtypes": dtypes, "losses": (ours, theirs),
            "param_vs_fsdp2": max(float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in a)}


class Toy(nn.Module):
    """Rows not divisible by 2 (vocab 7, 5 outputs), biases, LayerNorm, a tied embedding/head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 6, dtype=torch.float64)
        self.proj = nn.Linear(6, 5, dtype=torch.float64)
        self.norm = nn.LayerNorm(5, dtype=torch.float64)
        self.back = nn.Linear(5, 6, bias=False, dtype=torch.float64)
        self.head = nn.Linear(6, 7, bias=False, dtype=torch.float64)
        self.head.weight = self.emb.weight  # tied

    def forward(self, tokens):
        return self.head(self.back(self.norm(F.gelu(self.proj(self.emb(tokens))))))


def any_module(ctx):
    torch.manual_seed(0)
    ref, tokens = Toy(), torch.randint(0, 7, (4, 3))
    wrapped = FSDP(_copy(ref))
    loss = lambda out, t: F.cross_entropy(out.reshape(-1, 7), t.reshape(-1))
    opt_r, opt_w = torch.optim.SGD(ref.parameters(), lr=LR), torch.optim.SGD(wrapped.parameters(), lr=LR)
    for _ in range(STEPS):
        for opt in (opt_r, opt_w):
            opt.zero_grad()
        loss(ref(tokens), tokens).backward()
        loss(wrapped(tokens[ctx.rank * 2:(ctx.rank + 1) * 2]), tokens[ctx.rank * 2:(ctx.rank + 1) * 2]).backward()
        wrapped.finish_gradient_synchronization()
        opt_r.step()
        opt_w.step()
    got, want = wrapped.full_state_dict(), dict(ref.named_parameters(remove_duplicate=False))  # the tie: both names
    Toy().load_state_dict(got, strict=True)  # the model's own names and shapes: it loads back
    return {"keys": list(got) == list(want),
            "err": max(float((got[n] - want[n]).abs().max()) for n in want),
            "shard_shapes": {n: tuple(p.shape) for n, p in wrapped.module.named_parameters()}}


def _copy(module):
    twin = Toy()
    twin.load_state_dict(module.state_dict())
    return twin


def checks(ctx):
    # the MLP at B = 512: where MKL on the CPU of docs/fsdp.md splits the weight-gradient GEMM exactly
    # (full-batch difference 0 ulp there); elsewhere the measured figure says what this machine does
    mlp = Config(world_size=2, layers=2, dim=16, batch=512, dtype="float32")
    tr = Config(world_size=2, model="transformer", layers=2, dim=16, heads=2, seq=8, vocab=32, batch=64,
                dtype="float32")
    out = {"mlp": bit_for_bit(ctx, mlp), "transformer": bit_for_bit(ctx, tr),
           "mixed": mixed_precision(ctx), "toy": any_module(ctx)}
    return out if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def result():
    return launch(checks, 2)[0]


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_equals_non_parallel_gradient_accumulation_bit_for_bit(result, model):
    """The transformer (embeddings, norms, linears) and the MLP, any batch size: every parameter
    torch.equal to single-process training of the same batch as 2 accumulated micro-batches. Why it
    holds on every machine: each rank's backward is bitwise the reference's backward of that
    micro-batch (same weights, same shapes, same kernels: the launcher gives every rank the same
    thread count, and torch's CPU allocator aligns every buffer alike); the wrapper's reduce-scatter
    then adds 2 terms, and a 2-term float sum is the same in either order; dividing by 2 is exact.
    (At N = 4 the ring's order of 4 terms is not the accumulation's, so this is a world-size-2
    property.)"""
    r = result[model]
    assert r["fsdp_equal_accumulated"] == r["names"], r
    assert r["fsdp2_equal_accumulated"] == r["names"], r  # FSDP2 too, at N = 2


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_full_batch_training_within_round_off_ulps_measured(result, model, measured):
    """Against non-parallel training on the FULL batch (one backward over all B rows) nothing is
    guaranteed bit for bit: each rank's backward reduces over its B/2 rows, and whether a float32
    reduction over B rows (the weight gradient's GEMM, a row sum, the embedding's scatter-add)
    equals the sum of the two halves' bit for bit is up to the kernel's blocking, i.e. the
    machine's BLAS and CPU. Seen: MKL on one CPU split the MLP's GEMM at B = 512 exactly; on an AMD
    EPYC (MKL, AVX2) one process's full-batch gradient differs from the mean of its two half-batch
    gradients by 2 ulp, no distributed code involved. So, asserted: every parameter within the
    float32 tolerance of full-batch training (plain SGD, 3 steps: a few ulps, far inside it; a
    wrong scale or a missing term is >= 1e-3), for the wrapper and FSDP2, and the wrapper's
    difference is exactly FSDP2's and exactly one process's accumulation's (all three are the
    same bits, test above). Measured and reported in the run's summary ("measured, not
    asserted"): the largest difference in ulp."""
    r = result[model]
    assert r["keys"], r
    assert r["fsdp_rel_err"] <= FLOAT32 and r["fsdp2_rel_err"] <= FLOAT32, r
    assert r["fsdp_equal"] == r["fsdp2_equal"], r
    assert r["fsdp_max_ulp"] == r["fsdp2_max_ulp"] == r["accumulated_max_ulp"], r
    n = len(r["names"])
    measured(f"{model}, N=2, float32, 3 SGD steps, vs full-batch non-parallel training: FSDP wrapper max "
             f"{r['fsdp_max_ulp']} ulp, relative error {r['fsdp_rel_err']:.1e} ({len(r['fsdp_equal'])}/{n} "
             f"parameters bit-equal), FSDP2 max {r['fsdp2_max_ulp']} ulp, {r['fsdp2_rel_err']:.1e} "
             f"({len(r['fsdp2_equal'])}/{n}); one process accumulating the two halves: "
             f"{r['accumulated_max_ulp']} ulp (this machine's kernels, not the distributed code)")


def test_mixed_precision_matches_fsdp2_and_keeps_float32_state(result):
    r = result["mixed"]
    assert r["dtypes"] == {"torch.float32"}, r  # master weights and gradients
    ours, theirs = r["losses"]
    # bfloat16 (8 mantissa bits) compute in both; the two differ in where they round (e.g. FSDP2
    # casts the gains too and reduces in its flat buffer), so allow a few bf16 ulps of the loss.
    assert max(abs(a - b) / abs(b) for a, b in zip(ours, theirs)) < 2e-2, r
    assert r["param_vs_fsdp2"] < 2e-2, r


def test_any_module_padding_biases_and_tied_weights(result):
    r = result["toy"]
    assert r["keys"], r
    assert r["err"] < 1e-12, r  # float64: only summation order differs
    assert r["shard_shapes"]["emb.weight"] == (4, 6) and r["shard_shapes"]["proj.weight"] == (3, 6), r
