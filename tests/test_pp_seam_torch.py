"""Pipeline parallelism for a torch model the project does not own (issue 24, torch), through the
stage-split seam: module paths per stage, torch.distributed.pipelining's GPipe / 1F1B over them
(torch_impl/pp.py). ONE launch at world size 2; the refusals need no process group.

``Chain`` (defined here, float64, the twin of tests/test_pp_seam_jax.py's): an embedding, two
different blocks (a biased GELU MLP with LayerNorm; a gated tanh block with a bare matrix Parameter),
a final LayerNorm and an untied head — the two stages share no code. 3 AdamW steps at S = 2, M = 4
micro-batches against single-process training from the same weights. Tolerance 1e-12 (float64): the
gradient is the mean of per-micro-batch means' gradients (equal sizes: the full-batch mean
re-associated), ~1e-16 relative per op; three orders of margin.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_impl.launch import launch
from torch_impl.parallel import pp
from torch_impl.parallel.recipe import LocalClipError

TOL = 1e-12  # float64: see the module docstring
DT = torch.float64
V, D, T, B, M, STEPS, S = 11, 8, 4, 8, 4, 3, 2
STAGES = [["embed", "mlp"], ["gated", "norm", "head"]]


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D, dtype=DT), nn.Linear(D, 2 * D, dtype=DT), \
            nn.Linear(2 * D, D, dtype=DT)

    def forward(self, x):  # (B/M, T, D)
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D, dtype=DT) * 0.3)
        self.gate = nn.Linear(D, D, dtype=DT)

    def forward(self, x):
        return x + torch.tanh(x @ self.w) * torch.sigmoid(self.gate(x))


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.mlp, self.gated = nn.Embedding(V, D, dtype=DT), MLPBlock(), Gated()
        self.norm, self.head = nn.LayerNorm(D, dtype=DT), nn.Linear(D, V, dtype=DT)

    def forward(self, tokens):  # (B, T) -> (B, T, V)
        return self.head(self.norm(self.gated(self.mlp(self.embed(tokens)))))


class Skips(Chain):
    """Its forward is not the chain: a residual around the blocks, outside every module."""

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(self.norm(h + self.gated(self.mlp(h))))


class Tied(Chain):
    def __init__(self):
        super().__init__()
        self.head.weight = self.embed.weight  # (V, D): the tied embedding, across the stages


class Widening(Chain):
    """A middle module changes the width: at S = 3 its two boundaries carry different messages."""

    def __init__(self):
        super().__init__()
        self.wide, self.head = nn.Linear(D, 2 * D, dtype=DT), nn.Linear(2 * D, V, dtype=DT)

    def forward(self, tokens):
        return self.head(self.wide(self.norm(self.gated(self.mlp(self.embed(tokens))))))


def ce(logits, y):
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def made(cls=Chain):
    torch.manual_seed(0)
    return cls()


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def rank_checks(ctx):
    ref, (x, y) = made(), data()
    opt, ref_losses = adamw(ref.parameters()), []
    for _ in range(STEPS):
        opt.zero_grad()
        value = ce(ref(x), y)
        value.backward()
        opt.step()
        ref_losses.append(value.item())
    want, out = dict(ref.named_parameters()), {}
    for schedule in pp.SCHEDULES:
        trainer = pp.pipeline(made(), STAGES, ce, adamw, ctx.group, microbatches=M, schedule=schedule)
        losses = [trainer.train_step(x, y) for _ in range(STEPS - 1)]
        with ctx.ledger.recording():
            losses.append(trainer.train_step(x, y))
        got = trainer.named_parameters()
        out[schedule] = {
            "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_err": max(float((p - want[k]).detach().abs().max()) for k, p in got.items()),
            "names": sorted(got), "ledger": ctx.ledger.summary(), "theory": trainer.comm_theory()}
        out[schedule]["local_clip"] = local_clips(ctx, schedule, x, y)
    return out


class ClippingSGD(torch.optim.SGD):
    """A training loop's optimizer that clips in its own step (torch's clip over what it holds: a stage)."""

    def step(self, closure=None):
        torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], 0.05)
        return super().step(closure)


def local_clips(ctx, schedule, x, y):
    """torch's clip_grad_norm_ in the user's optimizer (a step pre-hook; a subclass's step): each stage would
    clip by its own norm. Refused at the first step, the update undone: {how: (message, params unchanged)}."""
    out = {}

    def hooked(ps):
        opt = adamw(ps)

        def clip(optimizer, args, kwargs):
            torch.nn.utils.clip_grad_norm_(ps, 0.05)

        opt.register_step_pre_hook(clip)
        return opt

    for how, make in (("pre-hook", hooked), ("subclass", lambda ps: ClippingSGD(ps, lr=0.1))):
        trainer = pp.pipeline(made(), STAGES, ce, make, ctx.group, microbatches=M, schedule=schedule)
        before = {k: p.detach().clone() for k, p in trainer.named_parameters().items()}
        try:
            trainer.train_step(x, y)
            message = ""
        except LocalClipError as e:
            message = str(e)
        out[how] = (message, all(torch.equal(p, before[k]) for k, p in trainer.named_parameters().items()))
    return out


@pytest.fixture(scope="module")
def result():
    return launch(rank_checks, S)


@pytest.mark.parametrize("schedule", list(pp.SCHEDULES))
def test_pipeline_trains_a_foreign_chain_like_one_process(result, schedule, measured):
    loss_err = max(r[schedule]["loss_err"] for r in result)
    param_err = max(r[schedule]["param_err"] for r in result)
    measured(f"{schedule} S={S} M={M}: loss {loss_err:.1e}, params {param_err:.1e}")
    assert loss_err <= TOL and param_err <= TOL, (loss_err, param_err)
    assert sorted(result[0][schedule]["names"] + result[1][schedule]["names"]) == sorted(
        k for k, _ in made().named_parameters())  # every parameter trained, on exactly one rank


@pytest.mark.parametrize("schedule", list(pp.SCHEDULES))
def test_a_clip_inside_the_optimizer_is_refused(result, schedule):
    """torch's clip_grad_norm_ in the optimizer's step (a pre-hook; a subclass) clips each stage by its own
    norm (the issue measured 6.6e-4 off): LocalClipError on every rank at the first step, nothing updated."""
    for r in result:
        for how, (message, unchanged) in r[schedule]["local_clip"].items():
            assert "pp.pipeline" in message and "max_norm=" in message and "LOCAL norm" in message, (how, message)
            assert unchanged, how


@pytest.mark.parametrize("schedule", list(pp.SCHEDULES))
def test_ledger_equals_the_theory(result, schedule):
    """Per rank M sends and M receives of one (B/M, T, D) message, and the loss's broadcast."""
    msg = (B // M) * T * D * 8
    for r in result:
        theory = r[schedule]["theory"]
        assert theory["send"] == theory["recv"] == (M, M * msg)
        assert r[schedule]["ledger"] == {op: {"count": c, "bytes": b} for op, (c, b) in theory.items()}, r


REFUSALS = {
    "not the chain": (lambda: (made(Skips), STAGES), "does not give model"),
    "unknown path": (lambda: (made(), [["embed", "mlp"], ["gated", "norm", "lm_head"]]),
                     "'lm_head' is not a submodule path"),
    "listed twice": (lambda: (made(), [["embed", "mlp"], ["mlp", "gated", "norm", "head"]]), "listed twice"),
    "param in no stage": (lambda: (made(), [["embed", "mlp"], ["gated", "head"]]),
                          "parameter 'norm.weight' is in no stage"),
    "tied across stages": (lambda: (made(Tied), STAGES), "different stages \\(tied\\)"),
    "stage count": (lambda: (made(), [STAGES[0] + STAGES[1]]), "1 stages for a group of 2 ranks"),
    "another boundary": (lambda: (made(), [["embed"], ["mlp", "gated", "norm", "head"]]), None),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_before_training(case):
    build, message = REFUSALS[case]
    model, stages = build()
    x = data()[0][: B // M]

    def check():
        return pp.check_chain(model, pp.check_stages(model, stages, S), x)
    if message is None:  # a valid split at another boundary: accepted
        assert check()[0] == (B // M, T, D)
        return
    with pytest.raises(pp.StageError, match=message):
        check()


def test_stage_boundaries_must_carry_one_message_shape():
    model, stages = made(Widening), [["embed", "mlp"], ["gated", "norm", "wide"], ["head"]]
    with pytest.raises(pp.StageError, match="boundaries carry different activations"):
        pp.check_chain(model, pp.check_stages(model, stages, 3), data()[0][: B // M])


def test_refuses_an_unknown_schedule():
    with pytest.raises(pp.StageError, match="unknown schedule"):
        pp.pipeline(made(), STAGES, ce, adamw, schedule="dualpipe")
