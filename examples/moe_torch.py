"""A user's mixture-of-experts model under compose's expert axis (torch_impl/parallel/compose_ep.py), trained
on gloo ranks and on one process from the same weights. The JAX twin: examples/moe_jax.py.

    python examples/moe_torch.py                                       # fsdp=2,ep=2,tp=2: 8 gloo ranks
    python examples/moe_torch.py --layout ep=2,tp=2 --style explicit --clip 0.05 --json out.json
    python examples/moe_torch.py --layout dp=2,fsdp=2,ep=2             # HSDP × ep

The model (written here, the project owns none of it): an embedding (V 24, D 6), 2 blocks of a LayerNorm'd
biased MLP (up 6 -> 8, down 8 -> 6) then a top-2 ``UserMoE`` over 4 ``StackedExperts`` (w1 (E, D, F), b1
(E, F), w2 (E, F, D): stacked on dim 0, called with rows grouped by expert and (E,) counts), a head. The
loss: mean cross-entropy plus the layers' Switch balancing losses (``model.aux``), whose (E,) counts come
through the layer's ``global_counts`` seam (compose sums them over every data rank).

What is sharded: the experts ``layers.*.moe.experts`` split on dim 0 over ep (E/ep experts per rank),
replicated over dp × fsdp × tp; the dense weights Megatron-split over tp (``PLAN``: vocab embedding,
colwise up, rowwise down, vocab head) and FSDP-sharded over fsdp (the experts left out of the units);
the batch rows split over dp × fsdp × ep (ep is a data axis for everything but the experts).

Collectives per step, per MoE layer: on ep one all-gather of the (ep·E,) counts and 4 uneven all-to-alls
(dispatch, combine, their reverses in backward); one all-reduce of the E counts over every data rank (the
balancing loss); tp's all-reduces and fsdp's all-gathers / reduce-scatters of the dense weights; after
backward the dense gradients averaged over the data ranks (ep folded in) and the experts' over dp × fsdp,
then divided by ep. ``--clip``: one scalar all-reduce of the global norm (each expert shard counted once).
The last step's ledger per axis is printed against ``trainer.comm_theory()``.

Float64, 3 AdamW steps (lr 1e-2, weight decay 0.1), one fixed batch (8 × 3 tokens). ``--json PATH`` writes
{"framework", "layout", "style", "clip", "losses", "reference_losses", "max_rel_loss_diff",
"max_abs_param_diff", "theory_is_ledger"}. Exit 0 only when every loss is within 1e-12 relative and every
parameter within 1e-12 absolute of the one-process run (measured ~1e-16: the ranks add in another order).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torch_impl.launch import launch  # noqa: E402
from torch_impl.parallel.compose import cross_entropy, parallelize  # noqa: E402

DT, STEPS, TOL, B, T, V = torch.float64, 3, 1e-12, 8, 3, 24
PLAN = {"emb": "vocab_embed", "layers.*.up": "colwise", "layers.*.down": "rowwise", "head": "colwise_vocab"}
EXPERTS = ["layers.*.moe.experts"]


class StackedExperts(nn.Module):
    """E experts stacked (E, …): rows grouped by expert and (E,) rows per expert (under ep: E/ep of them)."""

    def __init__(self, experts=4, dim=6, hidden=5):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden, dtype=DT) * 0.4)
        self.b1 = nn.Parameter(torch.randn(experts, hidden, dtype=DT) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim, dtype=DT) * 0.4)

    def forward(self, x, counts):  # (Σ counts, D), (E,) -> (Σ counts, D)
        return torch.cat([F.silu(rows @ w1 + b1) @ w2
                          for rows, w1, b1, w2 in zip(x.split(counts.tolist()), self.w1, self.b1, self.w2)])


class UserMoE(nn.Module):
    """Top-k MoE with a residual: LayerNorm, router, gates renormalised over the top k, rows sorted by expert."""

    def __init__(self, experts=4, topk=2, dim=6):
        super().__init__()
        self.e, self.k = experts, topk
        self.norm = nn.LayerNorm(dim, dtype=DT)
        self.router = nn.Linear(dim, experts, bias=False, dtype=DT)
        self.experts = StackedExperts(experts, dim)
        self.global_counts, self.aux = None, None  # the seam compose sets: (E,) counts -> every data rank's

    def forward(self, x):  # (B, T, D)
        h = self.norm(x).reshape(-1, x.shape[-1])  # (n, D)
        probs = F.softmax(self.router(h), dim=-1)  # (n, E)
        top_p, top_i = probs.topk(self.k, dim=-1)
        gates = top_p / top_p.sum(-1, keepdim=True)
        flat = top_i.reshape(-1)  # assignment j = token j // k
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.e)
        total = self.global_counts(counts) if self.global_counts else counts
        self.aux = 0.01 * self.e * (total.to(probs.dtype) / total.sum() * probs.mean(0)).sum()  # Switch's
        y = self.experts(h[order // self.k], counts)  # (n·k, D), by expert
        out = torch.empty_like(y).index_copy(0, order, y).reshape(h.shape[0], self.k, -1)  # (n, k, D)
        return x + (gates.unsqueeze(-1) * out).sum(1).reshape(x.shape)


class MoEBlock(nn.Module):
    def __init__(self, experts=4, dim=6):
        super().__init__()
        self.norm = nn.LayerNorm(dim, dtype=DT)
        self.up, self.down = nn.Linear(dim, 8, dtype=DT), nn.Linear(8, dim, dtype=DT)
        self.moe = UserMoE(experts, 2, dim)

    def forward(self, x):
        return self.moe(x + self.down(F.gelu(self.up(self.norm(x)))))


class MoENet(nn.Module):
    def __init__(self, layers=2, experts=4, vocab=V, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, dtype=DT)
        self.layers = nn.ModuleList(MoEBlock(experts, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False, dtype=DT)

    def forward(self, tokens):  # (B, T) -> (B, T, V)
        h = self.emb(tokens)
        for block in self.layers:
            h = block(h)
        return self.head(h)

    def aux(self):
        """Σ over the layers of the last forward's balancing losses."""
        return sum(block.moe.aux for block in self.layers)


def made():
    """The same weights and batch in every process."""
    torch.manual_seed(0)
    model = MoENet()
    g = torch.Generator().manual_seed(7)
    return model, torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference(clip):
    """One process, the whole batch: CE + the balancing losses, (torch's clip_grad_norm_,) AdamW."""
    model, x, y = made()
    opt, losses = adamw(model.parameters()), []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy(model(x), y) + model.aux()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: p.detach() for k, p in model.named_parameters()}


def rank(ctx, layout, style, clip):
    """One rank: the losses, (rank 0) every parameter whole, step 3's ledger per axis and the theory."""
    from torch.distributed.device_mesh import init_device_mesh

    model, x, y = made()
    mesh = init_device_mesh("cpu", tuple(layout.values()), mesh_dim_names=tuple(layout))  # glue
    trainer = parallelize(model, mesh, plan=PLAN if layout.get("tp", 1) > 1 else None, units=["layers.*"],
                          experts=EXPERTS, aux=model.aux, style=style, optimizer=adamw)  # glue
    losses = [trainer.train_step(x, y, clip) for _ in range(STEPS - 1)]  # glue: the whole batch on every rank
    ctx.ledger.label_groups({g.group_name: label for g, label in trainer.labels().items()})
    with ctx.ledger.recording():
        losses.append(trainer.train_step(x, y, clip))
    ctx.ledger.label_groups({})
    ledger = {a: {op: (v["count"], v["bytes"]) for op, v in ops.items()} for a, ops in ctx.ledger.by_axis().items()}
    state = trainer.full_state_dict()
    return losses, ({k: v.numpy() for k, v in state.items()} if ctx.rank == 0 else None), \
        ledger == trainer.comm_theory()


def parse_layout(text: str) -> dict[str, int]:
    return {axis.strip(): int(n) for axis, _, n in (part.partition("=") for part in text.split(","))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="fsdp=2,ep=2,tp=2", help="axis=size,… over dp fsdp ep tp, outermost first")
    ap.add_argument("--style", default="builtin", choices=("builtin", "explicit"))
    ap.add_argument("--clip", type=float, help="max_norm: clip by the global gradient norm")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    layout = parse_layout(args.layout)
    world = 1
    for n in layout.values():
        world *= n
    every = launch(rank, world, layout, args.style, args.clip)
    losses, params, _ = every[0]
    ref_losses, ref = reference(args.clip)
    result = {"framework": "torch", "layout": layout, "style": args.style, "clip": args.clip, "losses": losses,
              "reference_losses": ref_losses,
              "max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
              "max_abs_param_diff": max(float((torch.from_numpy(params[k]) - p).abs().max()) for k, p in ref.items()),
              "theory_is_ledger": all(answer[2] for answer in every)}
    for k, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        print(f"step {k + 1}: loss {a:.15f}  one process {b:.15f}")
    print(f"max rel loss diff {result['max_rel_loss_diff']:.1e}, max abs param diff {result['max_abs_param_diff']:.1e}")
    print(f"theory per axis == ledger on every rank: {result['theory_is_ledger']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["max_rel_loss_diff"] <= TOL and result["max_abs_param_diff"] <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())
