"""Bring your own model (issue 24, torch): the wrappers and ``tp.apply_plan`` on modules the project
does not own, against single-process training from the same weights, in ONE launch at world size 2.

Models (defined here, float64): ``BiasedMLP`` (biases, LayerNorm, a frozen matrix and a frozen gain,
a buffer, 7 and 5 rows: padding at N = 2); ``TPMLP`` (LayerNorm, biased colwise/rowwise pair; the
DTensor path is its second reference); ``TinyLlama`` (separate q, k, v, o; SwiGLU gate, up, down;
RMSNorm; an untied head — and a tied one through the DTensor plan; V = 25, not divisible by 2;
padding_idx on rank 1's half).

Tolerance: float64 throughout, 1e-12. The parallel runs compute the same sums split over ranks (and
the all-reduces add partial products in another order), ~1e-16 relative per op; 3 AdamW steps
carry that to ~1e-15. 1e-12 leaves three orders of margin and sits ten orders below every defect
these tests pin (2.9e-2 loss error from step 0 for the vocabulary offset, (N−1)·bias in the output).

Refusals (``tp.check_plan``, the preconditions ``apply_plan`` checks first): test_tp_plan.py, no launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from own_models import (
    LLAMA_PLAN,
    LR,
    STEPS,
    TPMLP,
    WD,
    B,
    BiasedMLP,
    D,
    T,
    TiedReader,
    TinyLlama,
    UserMoE,
    V,
    adamw,
    ce,
    full,
    made,
    max_err,
    train,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from shared.config import Config
from shared.theory import (
    adam_state_bytes,
    dp_comm_bytes,
    fsdp_comm,
    fsdp_regathered,
    fsdp_state_bytes,
    zero1_comm_bytes,
)
from torch_impl.launch import launch
from torch_impl.model import empty_model
from torch_impl.parallel import cp, ep, pp, tp, tp_ops
from torch_impl.parallel import theory as mt
from torch_impl.parallel.dp import BucketedDDP, Zero1Optimizer
from torch_impl.parallel.fsdp import FSDP, ShardReadError, Zero2
from torch_impl.parallel.recipe import LocalClipError

DT = torch.float64
TOL = 1e-12  # float64: see the module docstring


# --- rank code -------------------------------------------------------------------------------------














def vocab_smallest(ctx):
    """The issue's smallest case: nn.Embedding(5, 1) rows 0..4 over 2 ranks; a (3 -> 5) head's loss."""
    emb = nn.Embedding(5, 1, dtype=DT)
    with torch.no_grad():
        emb.weight.copy_(torch.arange(5, dtype=DT).view(5, 1))
    holder = nn.Sequential(emb)
    tp.apply_plan(holder, {"0": "vocab_embed"}, ctx.group)
    rows = holder(torch.arange(5)).view(-1).tolist()
    head, y = made(nn.Linear, 3, 5, bias=False, dtype=DT, seed=3), torch.tensor([[0, 2, 3, 4]])
    x = made(torch.randn, 1, 4, 3, dtype=DT, seed=4)
    want = ce(head(x), y).item()
    sharded = nn.Sequential(head)
    tp.apply_plan(sharded, {"0": "colwise_vocab"}, ctx.group)
    got = tp_ops.VocabParallelCrossEntropy.apply(sharded(x), y, ctx.group).item()
    return {"rows": rows, "loss": (got, want), "local_head": tuple(head.weight.shape),
            "full_head": tuple(tp.unshard(head.weight, "colwise_vocab", ctx.group).shape)}


def tp_mlp(ctx, sequence_parallel=False):
    """TPMLP: explicit apply_plan vs single-process vs the DTensor path (its bias handling)."""
    x = made(torch.randn, B, 4, 6, dtype=DT, seed=1)
    ref = made(TPMLP)
    ref_losses, _ = train(lambda: ref(x).pow(2).mean(), ref.parameters())
    model, plan = made(TPMLP), {"up": "colwise", "down": "rowwise"}
    n, r = ctx.world_size, ctx.rank
    if sequence_parallel:  # input and output on this rank's T/tp tokens; the loss a share of the mean
        plan = {"norm": "sequence"} | plan
        styles = tp.apply_plan(model, plan, ctx.group, sequence_parallel=True)
        partial = [p for name, p in model.named_parameters() if styles.get(name) in tp.SEQUENCE_STYLES]
        local = x.chunk(n, dim=1)[r]
        step = lambda: model(local).pow(2).sum() / x[..., 0].numel() / 6  # Σ over ranks = the mean

        def sync():
            tp_ops.reduce_sequence_grads(partial, ctx.group)
        losses, _ = train(step, model.parameters(), sync)
        summed = torch.tensor(losses, dtype=DT)
        torch.distributed.all_reduce(summed, group=ctx.group)
        losses = summed.tolist()
    else:
        styles = tp.apply_plan(model, plan, ctx.group)
        losses, _ = train(lambda: model(x).pow(2).mean(), model.parameters())
    got = tp.full_tensors(model, styles, ctx.group)
    out = {"loss_err": max_err(losses, ref_losses), "param_err": max_err(got, full(ref)), "styles": styles}
    if not sequence_parallel:
        dt = made(TPMLP)
        tp.apply_dtensor_plan(dt, plan, init_device_mesh("cpu", (n,)))
        dt_losses, _ = train(lambda: dt(x).pow(2).mean(), dt.parameters())
        theirs = {k: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for k, p in dt.named_parameters()}
        out |= {"dtensor_loss_err": max_err(dt_losses, ref_losses), "dtensor_vs_explicit": max_err(got, theirs)}
    return out


def llama(ctx, shared_f=True, steps_only=False):
    tokens, y = made(torch.randint, 0, V, (B, T), seed=2), made(torch.randint, 0, V, (B, T), seed=3)
    tokens[0, 1] = 20  # the padding row is looked up too
    model = made(TinyLlama)
    styles = tp.apply_plan(model, LLAMA_PLAN, ctx.group, shared_f=shared_f)
    step = lambda: tp_ops.VocabParallelCrossEntropy.apply(model(tokens), y, ctx.group)
    losses, grads0 = train(step, model.parameters(), ledger=ctx.ledger,
                           grads0=lambda: tp.full_tensors(model, styles, ctx.group, grads=True))
    comm = ctx.ledger.summary()
    out = {"all_reduce": comm["all_reduce"]["count"], "ops": sorted(comm), "losses": losses}
    if steps_only:
        return out
    ref = made(TinyLlama)
    ref_losses, ref_grads0 = train(lambda: ce(ref(tokens), y), ref.parameters(),
                                   grads0=lambda: {n: p.grad.clone() for n, p in ref.named_parameters()})
    return out | {"loss_err": max_err(losses, ref_losses), "grad0_err": max_err(grads0, ref_grads0),
                  "param_err": max_err(tp.full_tensors(model, styles, ctx.group), full(ref)),
                  "local_vocab": (tuple(model.emb.weight.shape), tuple(model.head.weight.shape)),
                  "padding_idx": _every(model.emb.padding_idx, ctx)}


def dtensor_tied_llama(ctx):
    """TinyLlama with head.weight = emb.weight through apply_dtensor_plan (parallelize_module used to
    distribute one copy per holder: two parameters trained apart) vs the single process."""
    tokens, y = made(torch.randint, 0, V, (B, T), seed=2), made(torch.randint, 0, V, (B, T), seed=3)

    def tied():
        model = made(TinyLlama)
        model.head.weight = model.emb.weight
        return model
    ref = tied()
    ref_losses, _ = train(lambda: ce(ref(tokens), y), ref.parameters())
    model = tied()
    tp.apply_dtensor_plan(model, LLAMA_PLAN, init_device_mesh("cpu", (ctx.world_size,)))
    opt, losses = adamw(model.parameters()), []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = ce(model(tokens), y)
            loss.backward()
        opt.step()
        losses.append(loss.item())
    whole = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
    got = {k: whole(model.get_parameter(k)) for k, _ in ref.named_parameters()}  # untied: head.weight apart
    return {"loss_err": max_err(losses, ref_losses), "param_err": max_err(got, full(ref)),
            "one_parameter": model.head.weight is model.emb.weight}


def apply_plan_refuses_first(ctx):
    """apply_plan checks before it changes anything: a bad key leaves the module as it was."""
    model = made(TPMLP)
    before = full(model)
    try:
        tp.apply_plan(model, {"up": "colwise", "dwon": "rowwise"}, ctx.group)
    except tp.PlanError as e:
        return {"message": str(e), "unchanged": max_err(full(model), before) == 0.0,
                "hooks": len(model.up._forward_pre_hooks) + len(model._forward_pre_hooks)}
    return {"message": None}


def data_parallel(ctx):
    """BucketedDDP, Zero1Optimizer, Zero2, FSDP on BiasedMLP: each trains like the single process
    (batch split in 2 halves), and its ledger equals the model-derived theory."""
    x = made(torch.randn, 8, 6, dtype=DT, seed=4)
    mine = x.chunk(ctx.world_size)[ctx.rank]
    ref = made(BiasedMLP)
    ref_losses, _ = train(lambda: ref(x).pow(2).mean(), [p for p in ref.parameters() if p.requires_grad])
    want, n = full(ref), ctx.world_size
    loss_of = lambda m: (lambda: m(mine).pow(2).mean())
    mean = lambda losses: _mean(losses, ctx)  # the ranks' local means -> the global mean
    out = {"phi_all": sum(p.numel() for p in ref.parameters()),
           "phi_trainable": sum(p.numel() for p in ref.parameters() if p.requires_grad)}

    model = made(BiasedMLP)
    ddp = BucketedDDP(model, bucket_mb=25.0)
    losses, _ = train(loss_of(ddp), [p for p in model.parameters() if p.requires_grad],
                      ddp.finish_gradient_synchronization, ctx.ledger)
    out["bucketed"] = {"loss_err": max_err(mean(losses), ref_losses), "param_err": max_err(full(model), want),
                       "ledger": ctx.ledger.summary(), "theory": ddp.comm_theory(),
                       "model": mt.dp_comm(made(BiasedMLP)), "state": ddp.state_theory()}

    model = made(BiasedMLP)
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WD)
    losses, _ = train(loss_of(model), None, ledger=ctx.ledger, opt=opt)
    out["zero1"] = {"loss_err": max_err(mean(losses), ref_losses), "param_err": max_err(full(model), want),
                    "ledger": ctx.ledger.summary(), "theory": opt.comm_theory(),
                    "model": mt.zero1_comm(made(BiasedMLP), n), "state": opt.state_theory(),
                    "measured_optimizer": sum(t.numel() * t.element_size() for s in opt.local.state.values()
                                              for t in s.values() if t.dim() > 0)}

    model = made(BiasedMLP)
    zero2 = Zero2(model)  # crashed here before: a frozen parameter got a gradient hook
    opt2 = adamw(zero2.params)
    losses, _ = train(loss_of(model), None, zero2.finish_gradient_synchronization, ctx.ledger, opt=opt2,
                      after_step=zero2.all_gather_params)
    out["zero2"] = {"loss_err": max_err(mean(losses), ref_losses), "param_err": max_err(full(model), want),
                    "ledger": ctx.ledger.summary(), "theory": zero2.comm_theory(),
                    "model": mt.zero2_comm(made(BiasedMLP), n), "state": zero2.state_theory(),
                    "measured": {"params": sum(p.numel() * 8 for p in model.parameters()),
                                 "grads": sum(p.grad.numel() * 8 for p in zero2.params if p.grad is not None),
                                 "optimizer": sum(t.numel() * 8 for s in opt2.state.values() for t in s.values()
                                                  if t.dim() > 0)}}

    model = made(BiasedMLP)
    fsdp = FSDP(model)
    before = fsdp.comm_theory()  # nothing run yet: every non-embedding unit assumed re-gathered
    trainable = [p for p in fsdp.parameters() if p.requires_grad]
    losses, _ = train(loss_of(fsdp), trainable, fsdp.finish_gradient_synchronization, ctx.ledger)
    got = fsdp.full_state_dict()
    out["fsdp"] = {"loss_err": max_err(mean(losses), ref_losses), "param_err": max_err(got, want),
                   "ledger": ctx.ledger.summary(), "theory": fsdp.comm_theory(), "before_forward": before,
                   "model": mt.zero3_comm(made(BiasedMLP), n, regathered=["down.weight", "fixed.weight"]),
                   "state": fsdp.state_theory(),
                   "measured_params": sum(p.numel() * 8 for p in fsdp.parameters())}
    return out


def _every(obj, ctx):
    out = [None] * ctx.world_size
    torch.distributed.all_gather_object(out, obj, group=ctx.group)
    return out


def _mean(losses, ctx):
    t = torch.tensor(losses, dtype=DT)
    torch.distributed.all_reduce(t, group=ctx.group)
    return (t / ctx.world_size).tolist()


def fsdp_tied_reader(ctx):
    model = made(TiedReader)
    fsdp = FSDP(model)
    try:
        fsdp(torch.randint(0, 11, (2, 3)))
    except ShardReadError as e:
        message = str(e)
    else:
        message = None
    # the guard is gone after forward: optimizer and state dict see the shard as before
    return {"message": message, "after": tuple(model.emb.weight.shape), "is_param": isinstance(model.emb.weight,
                                                                                               nn.Parameter)}


def fsdp_on_project_models(ctx):
    """FSDP.comm_theory() after a step == the ledger == shared.theory's Config formula (our models)."""
    from shared.problem import make_problem
    from torch_impl.model import build_model, inputs, loss_fn, targets
    out = {}
    for cfg in (Config(world_size=2, layers=2, dim=8, batch=4, dtype="float64"),
                Config(world_size=2, model="transformer", layers=1, dim=8, heads=2, seq=4, vocab=16, batch=2,
                       dtype="float64")):
        problem = make_problem(cfg)
        x, y = inputs(cfg, problem)[ctx.rank::2], targets(cfg, problem)
        y = None if y is None else y[ctx.rank::2]
        fsdp = FSDP(build_model(cfg, problem))
        train(lambda f=fsdp, x=x, y=y: loss_fn(f(x), y), fsdp.parameters(), fsdp.finish_gradient_synchronization,
              ctx.ledger)
        out[cfg.model] = {"ledger": ctx.ledger.summary(), "theory": fsdp.comm_theory(),
                          "config": fsdp_comm(cfg, "zero3")}
    return out


def user_moe(ctx):
    """ep.expert_parallel on UserMoE's StackedExperts (E = 4, k = 2): EP inside DP (each rank routes its
    half of the sequences: uneven all-to-alls) against the whole batch on one process; then the wrappers
    refuse the split experts."""
    x = made(torch.randn, 4, 3, 6, dtype=DT, seed=5)
    ref = made(UserMoE)
    ref_losses, ref_grads = train(lambda: ref(x).pow(2).mean(), list(ref.parameters()),
                                  grads0=lambda: {n: p.grad.clone() for n, p in ref.named_parameters()})
    model, n = made(UserMoE), ctx.world_size
    d = ep.expert_parallel(model.experts, ctx.group)
    mine = x.chunk(n)[ctx.rank]

    def whole(t):  # this rank's (E/N, …) experts -> (E, …), rank order = expert order
        out = t.new_empty((n * t.shape[0], *t.shape[1:]))
        torch.distributed.all_gather_single(out, t.detach().contiguous(), group=ctx.group)
        return out
    full_of = lambda ts: {k: whole(t) if k.startswith("experts.") else t for k, t in ts.items()}
    losses, grads = train(lambda: model(mine).pow(2).mean(), list(model.parameters()),
                          lambda: ep.finish_gradients(model, ctx.group), ctx.ledger,
                          grads0=lambda: {k: p.grad.clone() for k, p in model.named_parameters()})
    refused = []
    for wrap in (BucketedDDP, FSDP, Zero2, lambda m: Zero1Optimizer(m.parameters(), torch.optim.AdamW),
                 lambda m: tp.apply_plan(m, {"router": "colwise"}, ctx.group),
                 lambda m: pp.pipeline(m, [["norm"], ["router", "experts"]], ce, adamw, ctx.group),
                 lambda m: cp.context_parallel(m, ce, adamw, ctx.group)):
        try:
            wrap(model)
        except ep.ExpertError as e:
            refused.append(str(e))
    return {"loss_err": max_err(_mean(losses, ctx), ref_losses), "grad_err": max_err(full_of(grads), ref_grads),
            "param_err": max_err(full_of(full(model)), full(ref)), "local": tuple(model.experts.w1.shape),
            "ledger": ctx.ledger.summary(), "theory": d.comm_theory(), "counts": d.c, "refused": refused}


def user_moe_clip(ctx):
    """ep.clip_grad_norm_ (binding) equals one process's clip_grad_norm_; torch's own over this rank's experts
    (a local norm) is refused at the step with LocalClipError."""
    x, max_norm, steps = made(torch.randn, 4, 3, 6, dtype=DT, seed=5), 1e-3, 2
    ref, model = made(UserMoE), made(UserMoE)
    ep.expert_parallel(model.experts, ctx.group)
    mine, n = x.chunk(ctx.world_size)[ctx.rank], ctx.world_size
    ref_norms, norms = [], []
    for m, data, opt, clip in ((ref, x, adamw(ref.parameters()), None), (model, mine, adamw(model.parameters()), 1)):
        for _ in range(steps):
            opt.zero_grad()
            m(data).pow(2).mean().backward()
            if clip:
                ep.finish_gradients(model, ctx.group)
                norms.append(float(ep.clip_grad_norm_(model, max_norm, ctx.group)))
            else:
                ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
            opt.step()
    def whole(t):  # this rank's (E/N, …) experts -> (E, …)
        out = t.new_empty((n * t.shape[0], *t.shape[1:]))
        torch.distributed.all_gather_single(out, t.detach().contiguous(), group=ctx.group)
        return out
    params = {k: whole(p) if k.startswith("experts.") else p.detach() for k, p in model.named_parameters()}
    opt = adamw(model.parameters())
    model(mine).pow(2).mean().backward()
    ep.finish_gradients(model, ctx.group)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    try:
        opt.step()
        refused = ""
    except LocalClipError as e:
        refused = str(e)
    return {"norm_err": max(abs(a - b) for a, b in zip(norms, ref_norms)), "binds": min(ref_norms) > max_norm,
            "param_err": max_err(params, full(ref)), "refused": refused}


def rank_checks(ctx):
    out = {"vocab": vocab_smallest(ctx), "tp_mlp": tp_mlp(ctx), "tp_mlp_sp": tp_mlp(ctx, sequence_parallel=True),
           "llama": llama(ctx), "llama_unshared": llama(ctx, shared_f=False, steps_only=True),
           "dtensor_tied": dtensor_tied_llama(ctx), "refuse": apply_plan_refuses_first(ctx), "dp": data_parallel(ctx),
           "tied_reader": fsdp_tied_reader(ctx), "project": fsdp_on_project_models(ctx),
           "moe": user_moe(ctx), "moe_clip": user_moe_clip(ctx)}
    return out if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def result():
    return launch(rank_checks, 2)[0]


def ledger_of(comm):
    return {op: (v["count"], v["bytes"]) for op, v in comm.items()}


def plugged_in(phi_bytes: int) -> dict[str, int]:
    """shared.theory's formulas with the module's Φ plugged in (all parameters, as Config.n_params
    counts a model): DP Φb, ZeRO-1 and ZeRO-2 2Φb, ZeRO-3 3Φb."""
    return {"bucketed": phi_bytes, "zero1": 2 * phi_bytes, "zero2": 2 * phi_bytes, "fsdp": 3 * phi_bytes}


# --- tensor parallelism ------------------------------------------------------------------------------


# --- expert parallelism on a user's MoE layer --------------------------------------------------------------


def test_expert_parallel_clips_by_the_global_norm(result):
    """ep.clip_grad_norm_ binds (1e-3 under every step's norm) and equals one process's clip to 1e-12 (float64
    sums reordered); torch's own clip over a rank's experts is refused at the step, naming the fix."""
    r = result["moe_clip"]
    assert r["binds"] and r["norm_err"] <= 1e-12 and r["param_err"] <= 1e-12, r
    assert "ep.clip_grad_norm_" in r["refused"], r["refused"]


def test_expert_parallel_trains_a_user_moe_like_one_process(result, measured):
    """Gradients of the first step, losses and params after 3 AdamW steps equal one process's (1e-12: see
    the module docstring); the ledger: per step ONE all-gather of the (N, E) int64 counts, 2 all-to-alls
    forward + their reverse in backward of k·n rows out and the received rows in, ONE flat all-reduce of
    the other gradients. The Dispatcher's comm_theory() says the same from its routing."""
    r = result["moe"]
    measured(f"ep user MoE, N=2, E=4, k=2: loss {r['loss_err']:.1e}, step-0 grads {r['grad_err']:.1e}, "
             f"params {r['param_err']:.1e}; counts {r['counts']}")
    assert r["loss_err"] <= TOL and r["grad_err"] <= TOL and r["param_err"] <= TOL, r
    assert r["local"] == (2, 6, 5), r  # E/N = 2 of 4 experts on each rank
    c, rank, k, dim, b = r["counts"], 0, 2, 6, 8  # rank 0's view; float64
    sent = sum(c[rank])  # k·n rows: 2 sequences × 3 tokens × k
    got = sum(c[src][e] for src in range(2) for e in range(2))  # rows for my experts 0, 1
    assert sent == 2 * 3 * k, c
    ledger = ledger_of(r["ledger"])
    assert ledger.pop("all_gather") == (1, 2 * 4 * 8), ledger  # (N·E,) int64
    assert ledger.pop("all_reduce") == (1, (6 + 6 + 6 * 4) * b), ledger  # LayerNorm + router
    assert ledger == {"all_to_all": (4, 2 * (sent + got) * dim * b)}, ledger
    assert ledger_of(r["ledger"]) == r["theory"] | {"all_reduce": (1, (6 + 6 + 6 * 4) * b)}, r


def test_wrappers_refuse_split_experts(result):
    """Every wrapper and seam that would treat a split expert parameter as whole refuses it, in one line."""
    msgs = result["moe"]["refused"]
    assert all("holds this rank's experts only" in m for m in msgs), msgs
    assert [m.split(":")[0] for m in msgs] == ["BucketedDDP", "FSDP", "Zero2", "Zero1Optimizer", "apply_plan",
                                               "pipeline", "context_parallel"], msgs


@pytest.mark.parametrize("case", ["not divisible", "mixed leading dims", "no parameter"])
def test_expert_parallel_refuses_what_it_cannot_split(case):
    module = {"not divisible": lambda: made(UserMoE, experts=3).experts,
              "mixed leading dims": lambda: made(UserMoE),  # the whole layer: the router is (E, D), the norm (D,)
              "no parameter": lambda: nn.ReLU()}[case]()
    match = {"not divisible": "3 experts are not divisible by the group's 2 ranks",
             "mixed leading dims": "must all be stacked \\(E, …\\) on dim 0",
             "no parameter": "holds no parameter"}[case]
    with pytest.raises(ep.ExpertError, match=match):
        ep.check_experts(module, 2)


def test_vocab_parallel_any_vocabulary(result):
    """nn.Embedding(5, 1) over 2 ranks: rows 0..4 (was [0, 1, 5, 4, 0]); a 5-token head's
    vocab-parallel loss equals cross-entropy (padded rows: zero weights, −inf logits)."""
    r = result["vocab"]
    assert r["rows"] == [0.0, 1.0, 2.0, 3.0, 4.0], r
    got, want = r["loss"]
    assert abs(got - want) <= TOL, r
    assert r["local_head"] == (3, 3) and r["full_head"] == (5, 3), r  # ⌈5/2⌉ rows per rank; unshard drops the pad


def test_llama_block_equals_single_process(result):
    """V = 25 over 2 ranks (13 rows each, one padding row), separate q/k/v, SwiGLU, RMSNorm, untied
    head, padding_idx on rank 1: losses, step-0 gradients, parameters after 3 AdamW steps."""
    r = result["llama"]
    assert r["loss_err"] <= TOL and r["grad0_err"] <= TOL and r["param_err"] <= TOL, r
    assert r["local_vocab"] == ((13, D), (13, D)), r
    assert r["padding_idx"] == [None, 20 - 13], r  # the global padding row, local on its owner only


def test_sibling_projections_share_one_f(result):
    """Ledger of one step of the 2-block Llama-like model: per block 2 forward g (after o, down)
    and 2 backward f (one for q, k, v; one for gate, up): Megatron's 4, where one f per module
    pays 7; plus the embedding's g, the head's f and the loss's 2 (max, then the 2 sums)."""
    layers, shared, unshared = 2, result["llama"], result["llama_unshared"]
    assert shared["ops"] == unshared["ops"] == ["all_reduce"], (shared, unshared)
    assert shared["all_reduce"] == 4 * layers + 4 == 12, shared
    assert unshared["all_reduce"] == 7 * layers + 4 == 18, unshared
    assert max_err(shared["losses"], unshared["losses"]) <= TOL  # the same numbers either way


def test_dtensor_plan_keeps_a_tied_embedding_and_head_one_parameter(result):
    """apply_dtensor_plan on a tied TinyLlama: one Parameter after parallelize_module, trained like
    the single process (was: two copies trained apart; transformers' tied Llama: loss off by 9.9e-2)."""
    r = result["dtensor_tied"]
    assert r["one_parameter"] and r["loss_err"] <= TOL and r["param_err"] <= TOL, r


def test_biased_colwise_rowwise_equal_single_process_and_dtensor(result):
    """colwise splits its bias with its rows; rowwise adds its bias once, after g (was: on every
    rank before it, output off by (N−1)·bias; colwise crashed on the unsplit bias)."""
    r = result["tp_mlp"]
    assert r["loss_err"] <= TOL and r["param_err"] <= TOL, r
    assert r["dtensor_loss_err"] <= TOL and r["dtensor_vs_explicit"] <= TOL, r
    assert r["styles"] == {"up.weight": "colwise", "up.bias": "colwise", "down.weight": "rowwise"}, r


def test_biased_rowwise_under_sequence_parallelism(result):
    """Under SP the rowwise bias is added after the reduce-scatter, on this rank's T/tp tokens: its
    gradient is partial, so apply_plan reports it 'sequence' (reduced with the norm's)."""
    r = result["tp_mlp_sp"]
    assert r["loss_err"] <= TOL and r["param_err"] <= TOL, r
    assert {k for k, s in r["styles"].items() if s == "sequence"} == {"norm.weight", "norm.bias", "down.bias"}, r


def test_apply_plan_refuses_before_changing_anything(result):
    r = result["refuse"]
    assert r["message"] and "'dwon'" in r["message"] and "['down']" in r["message"], r
    assert r["unchanged"] and r["hooks"] == 0, r


# --- data parallel, ZeRO, FSDP -----------------------------------------------------------------------


@pytest.mark.parametrize("wrapper", ["bucketed", "zero1", "zero2", "fsdp"])
def test_wrappers_train_a_foreign_module_like_one_process(result, wrapper):
    """Biases, LayerNorm, a frozen Linear and gain, a buffer, 7- and 5-row weights (padded at N = 2).
    Zero2 used to crash in its constructor on the frozen parameters."""
    r = result["dp"][wrapper]
    assert r["loss_err"] <= TOL and r["param_err"] <= TOL, (wrapper, r)


@pytest.mark.parametrize("wrapper", ["bucketed", "zero1", "zero2", "fsdp"])
def test_theory_from_the_wrapped_model_equals_the_ledger(result, wrapper):
    """The wrapper's comm_theory() (and model_theory's function of the unwrapped module) == the
    ledger of a step, op by op; shared.theory's formulas with this module's Φ are off (frozen
    parameters, padding, FSDP's vectors and un-re-gathered first layer)."""
    r, phi_b = result["dp"][wrapper], result["dp"]["phi_all"] * 8
    assert ledger_of(r["ledger"]) == r["theory"], (wrapper, r)
    if wrapper == "bucketed":
        assert r["model"]["all_reduce"][1] == mt.comm_bytes(r["theory"])  # naive: one call per tensor
    else:
        assert r["model"] == r["theory"], (wrapper, r)
    assert mt.comm_bytes(r["theory"]) != plugged_in(phi_b)[wrapper], (wrapper, r)


def test_fsdp_theory_reads_what_the_forward_kept(result):
    """Before any forward FSDP assumes every non-embedding unit is re-gathered in backward; after
    one it knows the first Linear (fed by the data) kept no weight: one all-gather fewer."""
    r = result["dp"]["fsdp"]
    before, after = r["before_forward"], r["theory"]
    assert before["all_gather"][0] == after["all_gather"][0] + 1, r
    assert before["all_gather"][1] - after["all_gather"][1] == 8 * 6 * 8, r  # up.weight (7, 6): 8 rows padded, float64


def test_state_from_the_wrapped_model(result):
    dp = result["dp"]
    assert dp["zero2"]["state"] == dp["zero2"]["measured"], dp["zero2"]
    assert dp["fsdp"]["state"]["params"] == dp["fsdp"]["measured_params"], dp["fsdp"]
    assert dp["zero1"]["state"]["optimizer"] == dp["zero1"]["measured_optimizer"], dp["zero1"]
    assert dp["bucketed"]["state"] == {"params": 133 * 8, "grads": 103 * 8, "optimizer": 2 * 103 * 8}, dp["bucketed"]


def test_fsdp_theory_on_the_project_models(result):
    """On our own MLP and transformer FSDP.comm_theory() == the ledger == shared.theory's formula."""
    for model, r in result["project"].items():
        assert ledger_of(r["ledger"]) == r["theory"] == r["config"], (model, r)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_model_theory_equals_shared_theory_on_the_project_models(model, n):
    """The model-derived formulas reduce to shared.theory's Config formulas on our models (in-process:
    the model on the meta device)."""
    cfg = Config(world_size=n, model=model, layers=2, dim=16, heads=4, vocab=32, seq=8)
    m = empty_model(cfg, "meta")
    assert mt.comm_bytes(mt.dp_comm(m)) == dp_comm_bytes(cfg)
    assert mt.comm_bytes(mt.zero1_comm(m, n)) == zero1_comm_bytes(cfg)
    assert mt.zero2_comm(m, n) == fsdp_comm(cfg, "zero2")
    assert mt.zero3_comm(m, n, fsdp_regathered(cfg)) == fsdp_comm(cfg, "zero3")
    assert mt.dp_state(m) == adam_state_bytes(cfg, "dp")
    assert mt.zero1_state(m, n) == adam_state_bytes(cfg, "zero1")
    for variant, state in (("zero2", mt.zero2_state(m, n)), ("zero3", mt.zero3_state(m, n))):
        assert state == fsdp_state_bytes(cfg, variant), (variant, state)


@pytest.mark.parametrize("case", ["frozen", "dtypes"])
def test_zero1_refuses_what_one_flat_buffer_cannot_hold(case):
    """Checked before any collective (in-process): nothing to train, or parameters of two dtypes
    (the flat buffer would cast them to the first one's silently)."""
    model = made(BiasedMLP)
    if case == "frozen":
        model.requires_grad_(False)
    else:
        model.down.to(torch.float32)
    what = "no trainable parameter" if case == "frozen" else r"\['torch.float32 on cpu', 'torch.float64 on cpu'\]"
    with pytest.raises(ValueError, match=f"Zero1Optimizer: .*{what}.*Fix: "):
        Zero1Optimizer(model.parameters(), torch.optim.AdamW)


def test_fsdp_refuses_a_parent_reading_a_childs_weight(result):
    """F.linear(h, self.emb.weight) in the parent's forward read the 1/N shard (crashing later with
    "shape '[-1, 11]' is invalid", or silently if the shapes fit); now the read raises, naming the
    parameter and the remedy, and after forward the shard is a Parameter again."""
    r = result["tied_reader"]
    assert r["message"] is not None, r
    assert "'emb.weight' (11, 8)" in r["message"] and "head.weight = self.emb.weight" in r["message"], r
    assert r["after"] == (6, 8) and r["is_param"], r
