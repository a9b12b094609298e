"""Your own torch model under the torch patterns that take one: DDP (BucketedDDP), ZeRO-1, ZeRO-2, FSDP,
a tensor-parallel plan (``tp.apply_dtensor_plan`` runs the same plan through DTensor), a pipeline
from a stage split and context parallelism through the attention seam.

    python examples/own_model_torch.py

Starts 2 CPU ranks (gloo), trains 3 AdamW steps under each pattern from the same weights and checks the
parameters against plain single-process training on the whole batch (float64: ~1e-16; the script fails
above 1e-12). The lines marked ``# glue`` are all that each pattern changes in a plain training loop:

    ddp = BucketedDDP(model)                         ... ddp(x) ... ddp.finish_gradient_synchronization()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    zero2 = Zero2(model)                             ... zero2.finish_gradient_synchronization() ... all_gather_params()
    model = FSDP(model)                              ... model.finish_gradient_synchronization()
    styles = tp.apply_plan(model, PLAN, group)  ... VocabParallelCrossEntropy.apply(logits, y, group)
    trainer = pp.pipeline(model, [["embed", "blocks.0"], ["blocks.1", "norm", "head"]], ce, opt, group)
    trainer = cp.context_parallel(model, loss, opt, group, "ring")   # attention: cp.attention

The key projection has no bias, as in most LLMs: softmax ignores a shift, so a key bias's true gradient is
0, and AdamW would turn the ~1e-17 rounding noise it gets into steps of lr·g/eps ~ 1e-11, different in
each run (a parity check of any framework fails on it; training does not care).
"""

from __future__ import annotations

import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torch_impl.launch import launch  # noqa: E402
from torch_impl.parallel import cp, pp, tp, tp_ops  # noqa: E402
from torch_impl.parallel.dp import BucketedDDP, Zero1Optimizer  # noqa: E402
from torch_impl.parallel.fsdp import FSDP, Zero2  # noqa: E402

torch.set_default_dtype(torch.float64)  # float64 parity (runs again in every rank: they import this file)
VOCAB, DIM, HEADS, SEQ, BATCH, STEPS, LR = 25, 16, 2, 8, 4, 3, 1e-2  # V = 25: not divisible by 2, padded


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.heads, self.head_dim = HEADS, DIM // HEADS  # the tp plan checks that each rank gets whole heads
        self.q, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(3))
        self.k = nn.Linear(DIM, DIM, bias=False)  # no key bias: see the module docstring
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, h):  # (B, T, D); under TP q, k, v hold H/tp heads: the -1 below
        (b, t, _), a = h.shape, self.norm1(h)
        q, k, v = (m(a).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        h = h + self.o(cp.attention(q, k, v).transpose(1, 2).reshape(b, t, -1))  # causal SDPA; cp's seam
        return h + self.down(F.gelu(self.up(self.norm2(h))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same weights in every process
        self.embed, self.blocks = nn.Embedding(VOCAB, DIM), nn.ModuleList(Block() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):  # (B, T) -> (B, T, V)
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


PLAN = {"embed": "vocab_embed", "blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise",
        "blocks.*.o": "rowwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise", "head": "colwise_vocab"}


def ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def train_single(x, y):
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        ce(model(x), y).backward()
        opt.step()
    return dict(model.named_parameters())


def train_ddp(x, y, rank):
    model = TinyLM()
    x, y = x.chunk(2)[rank], y.chunk(2)[rank]  # glue: this rank's rows
    ddp = BucketedDDP(model)  # glue
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        ce(ddp(x), y).backward()  # glue: ddp(x), not model(x)
        ddp.finish_gradient_synchronization()  # glue
        opt.step()
    return dict(model.named_parameters())


def train_zero1(x, y, rank):
    model = TinyLM()
    x, y = x.chunk(2)[rank], y.chunk(2)[rank]  # glue: this rank's rows
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR)  # glue
    for _ in range(STEPS):
        opt.zero_grad()
        ce(model(x), y).backward()
        opt.step()
    return dict(model.named_parameters())


def train_zero2(x, y, rank):
    model = TinyLM()
    x, y = x.chunk(2)[rank], y.chunk(2)[rank]  # glue: this rank's rows
    zero2 = Zero2(model)  # glue
    opt = torch.optim.AdamW(zero2.params, lr=LR)  # glue: zero2.params (its row shards)
    for _ in range(STEPS):
        opt.zero_grad()
        ce(model(x), y).backward()
        zero2.finish_gradient_synchronization()  # glue
        opt.step()
        zero2.all_gather_params()  # glue
    return dict(model.named_parameters())


def train_fsdp(x, y, rank):
    x, y = x.chunk(2)[rank], y.chunk(2)[rank]  # glue: this rank's rows
    model = FSDP(TinyLM())  # glue
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        ce(model(x), y).backward()
        model.finish_gradient_synchronization()  # glue
        opt.step()
    return model.full_state_dict()  # glue: the full weights (a checkpoint) from the shards


def train_tp(x, y, rank):
    model, group = TinyLM(), dist.group.WORLD
    styles = tp.apply_plan(model, PLAN, group)  # glue
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        tp_ops.VocabParallelCrossEntropy.apply(model(x), y, group).backward()  # glue: logits split over the vocab
        opt.step()
    return tp.full_tensors(model, styles, group)  # glue: the full weights (a checkpoint) from the shards


def train_pp(x, y, rank):
    stages = [["embed", "blocks.0"], ["blocks.1", "norm", "head"]]  # forward = this chain of modules
    trainer = pp.pipeline(TinyLM(), stages, ce, lambda ps: torch.optim.AdamW(ps, lr=LR),  # glue
                               dist.group.WORLD, microbatches=2)
    for _ in range(STEPS):
        trainer.train_step(x, y)  # glue
    return trainer.named_parameters()  # this rank's stage


def train_cp(x, y, rank):
    loss = lambda model, x, y, positions: ce(model(x), y)  # no position encoding here: positions unused
    trainer = cp.context_parallel(TinyLM(), loss, lambda ps: torch.optim.AdamW(ps, lr=LR),  # glue
                                       dist.group.WORLD, "ring")
    for _ in range(STEPS):
        trainer.train_step(x, y)  # glue: (B, T) on every rank, T split over the ranks
    return dict(trainer.model.named_parameters())


PATTERNS = {"ddp": train_ddp, "zero1": train_zero1, "zero2": train_zero2, "fsdp": train_fsdp,
            "tp plan": train_tp, "pp": train_pp, "cp": train_cp}


def worker(ctx):  # runs on each rank: every pattern, each against the single process
    x, y = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    want = train_single(x, y)
    errors = {}
    for name, run in PATTERNS.items():
        got = run(x, y, ctx.rank)  # pp: only this rank's stage
        err = torch.tensor(max(float((got[k] - want[k]).detach().abs().max()) for k in got))
        dist.all_reduce(err, dist.ReduceOp.MAX)  # the worst over the ranks
        errors[name] = float(err)
    return errors


def main() -> int:
    errors = launch(worker, 2, device="cpu")[0]  # 2 processes, gloo; rank 0's answer
    print(f"{'pattern':<14} {'max |Δparam|':>13}  glue lines")
    for name, err in errors.items():
        glue = sum("# glue" in line for line in inspect.getsource(PATTERNS[name]).splitlines())
        print(f"{name:<14} {err:>13.1e}  {glue}")
    worst = max(errors.values())
    ok = worst <= 1e-12  # float64: the same sums split over ranks, ~1e-16 per op
    print(f"{'ok' if ok else 'FAILED'}: worst parameter difference {worst:.1e} (limit 1e-12)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
