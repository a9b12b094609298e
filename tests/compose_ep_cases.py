"""compose's expert axis (torch_impl/parallel/compose_ep.py), the cases tests/test_compose_torch.py runs on
ITS ranks (one launch per module: the Llama's cases first, these after them): a user's MoE model
(own_models.MoENet: an embedding, blocks of a biased MLP and a top-2 ``UserMoE`` of 4 stacked experts, a
head) under ``parallelize(..., experts=["layers.*.moe.experts"], aux=model.aux)`` on meshes naming "ep",
each against the same model trained on one process from the same weights (float64, 3 AdamW steps; the
loss the mean CE plus the layers' balancing losses, whose counts come through the ``global_counts`` seam).
Every case also compares the composition's communication theory per axis (Trainer.comm_theory, from the
model wrapped and the step's routing) with the ledger of step 3.

Tolerance: losses 1e-12 relative, parameters 1e-12 absolute after 3 steps: float64, the parallel runs add
the same products in another order (the all-to-alls regroup the rows, the all-reduces sum the ranks'
means; ~1e-16 per op, measured ≤ 3e-16 after 3 AdamW steps); the routing's top-2 is the same on every
layout as long as no two router probabilities tie within that error (none do at these weights).
"""

from __future__ import annotations

import contextlib
import time

import torch
from own_models import LR, MOE_NET_EXPERTS, MOE_NET_PLAN, STEPS, WD, MoENet, made

from torch_impl.parallel import compose

TOL_LOSS, TOL_PARAM = 1e-12, 1e-12  # float64: see the module docstring
B, T, V = 8, 3, 24
CLIP = 0.05  # binds every step: the gradients' global norm is ~0.5-1 (asserted: norms > 2·CLIP)

# default tier, 4 ranks: ep × tp (explicit clipped by the global norm) and dp × ep (ep folded into dp's
# all-reduce; explicit accumulating 2 micro-batches), both styles; experts= without ep (dense weights; the
# balancing counts still summed over every data rank)
CASES_4 = [({"ep": 2, "tp": 2}, "explicit", {"max_norm": CLIP}), ({"ep": 2, "tp": 2}, "builtin"),
           ({"dp": 2, "ep": 2}, "explicit", {"microbatches": 2}), ({"dp": 2, "ep": 2}, "builtin"),
           ({"dp": 4}, "explicit")]
# slow tier, 8 ranks: HSDP × ep (clipped once), fsdp × ep × tp, both styles (builtin: FSDP2 accumulating 2)
CASES_8 = [({"dp": 2, "fsdp": 2, "ep": 2}, "explicit"), ({"dp": 2, "fsdp": 2, "ep": 2}, "builtin", {"max_norm": CLIP}),
           ({"fsdp": 2, "ep": 2, "tp": 2}, "explicit"), ({"fsdp": 2, "ep": 2, "tp": 2}, "builtin", {"microbatches": 2})]


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD)


def batch():
    return made(torch.randint, 0, V, (B, T), seed=7), made(torch.randint, 0, V, (B, T), seed=8)


def reference(max_norm=None, microbatches=None):
    """One process: the whole batch, CE + the layers' balancing losses, (torch's clip_grad_norm_,) AdamW.
    ``microbatches`` K: accumulation as one process does it, part j = rows [j·B/K, (j+1)·B/K) with its own
    balancing losses (its routing), loss / K each."""
    model, (x, y), k = made(MoENet), batch(), microbatches or 1
    opt, losses, norms = adamw(model.parameters()), [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = 0
        for xs, ys in zip(x.chunk(k), y.chunk(k), strict=True):
            part = (compose.cross_entropy(model(xs), ys) + model.aux()) / k
            part.backward()
            loss = loss + part.detach()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: p.detach() for k, p in model.named_parameters()}, norms


def train(ctx, layout, style, labels, max_norm=None, microbatches=None):
    """This rank's part: losses, every parameter whole, the global norms (clipped), step 3's ledger and theory."""
    from torch.distributed.device_mesh import init_device_mesh

    model, (x, y) = made(MoENet), batch()
    mesh = init_device_mesh("cpu", tuple(layout.values()), mesh_dim_names=tuple(layout))
    trainer = compose.parallelize(model, mesh, plan=MOE_NET_PLAN if layout.get("tp", 1) > 1 else None,
                                  units=["layers.*"], experts=MOE_NET_EXPERTS, aux=model.aux, style=style,
                                  optimizer=adamw, microbatches=microbatches)
    losses, norms = [], []
    for k in range(STEPS):
        if k == STEPS - 1:
            current = {g.group_name: label for g, label in trainer.labels().items()}
            ctx.ledger.label_groups(labels | current)
            labels.update({n: v for n, v in current.items() if n != torch.distributed.group.WORLD.group_name})
        with ctx.ledger.recording() if k == STEPS - 1 else contextlib.nullcontext():
            losses.append(trainer.train_step(x, y, max_norm))
        norms += [float(trainer.norm)] if max_norm is not None else []
    ctx.ledger.label_groups({})
    comm = {"ledger": {a: {op: (v["count"], v["bytes"]) for op, v in ops.items()}
                       for a, ops in ctx.ledger.by_axis().items()}, "theory": trainer.comm_theory()}
    return losses, trainer.full_state_dict(), norms, comm


def ranks(ctx, cases, labels: dict[str, str]):
    """Every case on these ranks, one after another. ``labels``: {group name: ledger label} of every
    layout this process ran before (DTensor may reuse an earlier, equal mesh's tp group)."""
    out = []
    for layout, style, *more in cases:
        start = time.perf_counter()
        losses, state, norms, comm = train(ctx, layout, style, labels, **(more[0] if more else {}))
        state = {k: v.numpy() for k, v in state.items()} if ctx.rank == 0 else None  # NumPy: rank -> parent
        out.append((losses, state, norms, comm, time.perf_counter() - start))
    return out


def compare(cases, every) -> dict[str, dict]:
    """{case name: result} from every rank's answers, each against the one-process reference."""
    key = lambda case: tuple((case[2] if len(case) > 2 else {}).get(o) for o in ("max_norm", "microbatches"))  # noqa: E731
    refs = {k: reference(*k) for k in {key(c) for c in cases}}
    out = {}
    for k, case in enumerate(cases):
        (losses, state, norms, _, seconds), (ref_losses, ref_params, ref_norms) = every[0][k], refs[key(case)]
        assert list(state) == list(ref_params), (list(state), list(ref_params))
        out[name(case)] = {
            "layout": case[0], "style": case[1], "losses": losses, "ref_losses": ref_losses, "norms": norms,
            "ref_norms": ref_norms,
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
            "param_abs": max(float((torch.from_numpy(state[n]) - p).abs().max()) for n, p in ref_params.items()),
            "seconds": seconds, "comm_per_rank": [answers[k][3] for answers in every]}
    return out


def name(case) -> str:
    return ",".join(f"{a}={n}" for a, n in case[0].items()) + f" {case[1]}" + \
        "".join(f" {k}={v}" for o in case[2:] for k, v in o.items())


def assert_exact(r, measured):
    measured(f"compose ep {name((r['layout'], r['style']))}{' clipped' if r['norms'] else ''}: loss rel "
             f"{r['loss_rel']:.1e}, params {r['param_abs']:.1e} ({r['seconds']:.1f} s on the ranks)")
    assert r["losses"][-1] < r["losses"][0], r  # it trains
    assert r["loss_rel"] <= TOL_LOSS and r["param_abs"] <= TOL_PARAM, r
    if r["norms"]:  # the clip binds (norm > 2·max_norm) and its global norm is one process's (1e-12 relative)
        assert min(r["ref_norms"]) > 2 * CLIP, r["ref_norms"]
        assert max(abs(a - b) / b for a, b in zip(r["norms"], r["ref_norms"], strict=True)) <= TOL_LOSS, r


def assert_theory_is_the_ledger(r):
    """Per rank, per axis: Trainer.comm_theory() == the ledger of step 3 (op -> count, bytes)."""
    for k, comm in enumerate(r["comm_per_rank"]):
        ledger, theory = comm["ledger"], comm["theory"]
        assert set(ledger) == set(theory), (r["layout"], r["style"], k, ledger, theory)
        for axis, ops in theory.items():
            assert ledger[axis] == ops, (r["layout"], r["style"], k, axis, ledger[axis], ops)


class FakeMesh:
    """Just enough of a DeviceMesh for the refusals that need no process group."""

    def __init__(self, layout):
        self.mesh_dim_names, self.mesh, self.device_type = tuple(layout), torch.zeros(tuple(layout.values())), "cpu"


REFUSALS = [  # (layout, parallelize's keywords, the one line's pattern)
    ({"ep": 2, "pp": 2}, {}, r"ep=2 beside pp=2 is not composed"),
    ({"ep": 2, "cp": 2}, {}, r"ep=2 beside cp=2 is not composed"),
    ({"dp": 2, "ep": 2}, {"experts": []}, r"ep=2 needs experts=\[module path globs\]"),
    ({"ep": 2}, {"experts": ["layers.*.mlp.experts"]}, r"experts glob 'layers\.\*\.mlp\.experts' names no module"),
    ({"ep": 2}, {"experts": ["layers.*.moe"]}, r"experts 'layers\.0\.moe': ep: the experts' parameters must all be "
                                               r"stacked"),
    ({"ep": 8}, {}, r"experts 'layers\.0\.moe\.experts': ep: 4 experts are not divisible by the group's 8 ranks"),
    ({"ep": 2, "tp": 2}, {"plan": MOE_NET_PLAN | {"layers.*.moe.experts": "colwise"}},
     r"tp plan entry 'layers\.\*\.moe\.experts' names 'layers\.0\.moe\.experts', inside the experts"),
    ({"fsdp": 2, "ep": 2}, {"units": ["layers.*.moe.experts"]},
     r"FSDP unit glob 'layers\.\*\.moe\.experts' names 'layers\.0\.moe\.experts'"),
    ({"ep": 2}, {"compile": True, "units": ["layers.*"]}, r"compile=True with ep > 1"),
]
