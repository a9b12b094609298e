"""A user's mixture-of-experts NNX model under compose's expert axis (jax_impl/parallel/compose_ep.py), trained
on 8 simulated devices and on one device from the same weights. The torch twin: examples/moe_torch.py.

    python examples/moe_jax.py                                        # fsdp=2,ep=2,tp=2, shard_map
    python examples/moe_jax.py --layout ep=2,tp=2 --style jit --clip 0.05 --json out.json
    python examples/moe_jax.py --layout dp=2,fsdp=2,ep=2              # HSDP × ep

The model (written here, the project owns none of it): an embedding (V 24, D 6), 2 blocks of a LayerNorm'd
biased MLP (up 6 -> 8, down 8 -> 6) then a top-2 ``UserMoE`` over 4 ``StackedExperts`` (w1 (E, D, F), b1
(E, F), w2 (E, F, D) stacked on dim 0), a head. The layer is written ONCE for one device and the mesh: its
experts run through the seam ``parallel.ep.dispatch`` and its Switch balancing loss reads
``parallel.ep.global_counts`` (the whole batch's (E,) counts under compose); the loss is the mean
cross-entropy plus ``model.aux`` (Σ of the layers' balancing losses).

What is sharded: the experts' Params get ``P("ep", …)`` (stacked blocks ``P(None, None, "ep", …)``): E/ep
experts per device, replicated over dp × fsdp × tp; the MLPs Megatron-split over tp (``PLAN``: colwise up,
rowwise down; the embedding and head replicated over tp); the dense weights ZeRO-sharded over fsdp (the
experts left out); the batch rows split over dp × fsdp × ep.

Collectives per step, per MoE layer (shard_map; under jit XLA places its own): on ep the tokens moved by
``all_to_all`` (dispatch, combine and their reverses in backward; capacity = the n local tokens: nothing
dropped); a psum of the E counts over every data device (the balancing loss); tp's psums; fsdp's
all-gathers / reduce-scatters of the dense weights; the gradients averaged over the data devices. The
compiled step's collectives per axis are printed against ``trainer.comm_theory()`` (shard_map, no clip).

Float64, 3 steps of optax.adamw(1e-2, weight_decay=0.1), one fixed batch (8 × 3 tokens). ``--json PATH``
writes {"framework", "layout", "style", "clip", "losses", "reference_losses", "max_rel_loss_diff",
"max_abs_param_diff", "theory_is_ledger"}. Exit 0 only when every loss is within 1e-12 relative and every
parameter within 1e-12 absolute of the one-device run (measured ~1e-16: the devices add in another order).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from shared.env import simulate_host_devices  # noqa: E402

simulate_host_devices(8)  # XLA_FLAGS=--xla_force_host_platform_device_count=8, before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

jax.config.update("jax_enable_x64", True)  # float64 parity

from jax_impl import ledger  # noqa: E402
from jax_impl.parallel import ep, recipe  # noqa: E402
from jax_impl.parallel.compose import ComposeError, Split, compose  # noqa: E402
from jax_impl.parallel.tree import key_of  # noqa: E402

F64, STEPS, TOL, B, T, V = {"param_dtype": jnp.float64, "dtype": jnp.float64}, 3, 1e-12, 8, 3, 24
PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}
EXPERTS = ["layers.*.moe.experts"]


class StackedExperts(nnx.Module):
    """E experts stacked (E, …); one expert: silu(x·w1 + b1)·w2."""

    def __init__(self, rngs, experts=4, dim=6, hidden=5):
        normal = lambda *shape: jax.random.normal(rngs.params(), shape, jnp.float64)  # noqa: E731
        self.w1 = nnx.Param(normal(experts, dim, hidden) * 0.4)
        self.b1 = nnx.Param(normal(experts, hidden) * 0.1)
        self.w2 = nnx.Param(normal(experts, hidden, dim) * 0.4)

    @staticmethod
    def one(w, rows):  # one expert (w: its slices) on rows (R, D) -> (R, D)
        return jax.nn.silu(rows @ w["w1"] + w["b1"]) @ w["w2"]


class UserMoE(nnx.Module):
    """Top-k MoE with a residual: LayerNorm, router, gates renormalised over the top k, the experts
    through ``ep.dispatch``, Switch's balancing loss from ``ep.global_counts`` kept as ``self.aux``."""

    def __init__(self, rngs, experts=4, topk=2, dim=6):
        self.e, self.k = experts, topk
        self.norm = nnx.LayerNorm(dim, rngs=rngs, **F64)
        self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs, **F64)
        self.experts = StackedExperts(rngs, experts, dim)

    def __call__(self, x):  # (B, T, D)
        h = self.norm(x).reshape(-1, x.shape[-1])  # (n, D)
        probs = jax.nn.softmax(self.router(h), axis=-1)  # (n, E)
        top_p, top = jax.lax.top_k(probs, self.k)  # (n, k)
        gates = top_p / top_p.sum(-1, keepdims=True)
        total = ep.global_counts(top, self.e)  # (E,) over every data device's tokens
        f = jax.lax.stop_gradient(total.astype(probs.dtype) / total.sum().astype(probs.dtype))
        self.aux = nnx.Intermediate(0.01 * self.e * jnp.sum(f * probs.mean(0)))
        w = {"w1": self.experts.w1[...], "b1": self.experts.b1[...], "w2": self.experts.w2[...]}
        out = ep.dispatch(StackedExperts.one, w, h, top)  # (n, k, D)
        return x + jnp.einsum("nk,nkd->nd", gates, out).reshape(x.shape)


class MoEBlock(nnx.Module):
    def __init__(self, rngs, experts=4, dim=6):
        self.norm = nnx.LayerNorm(dim, rngs=rngs, **F64)
        self.up, self.down = nnx.Linear(dim, 8, rngs=rngs, **F64), nnx.Linear(8, dim, rngs=rngs, **F64)
        self.moe = UserMoE(rngs, experts, 2, dim)

    def __call__(self, x):
        return self.moe(x + self.down(jax.nn.gelu(self.up(self.norm(x)))))


class MoENet(nnx.Module):
    def __init__(self, rngs, layers=2, experts=4, vocab=V, dim=6):
        self.emb = nnx.Embed(vocab, dim, rngs=rngs, **F64)
        self.layers = nnx.List(MoEBlock(rngs, experts, dim) for _ in range(layers))
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs, **F64)

    def __call__(self, tokens):  # (B, T) -> (B, T, V)
        h = self.emb(tokens)
        for block in self.layers:
            h = block(h)
        return self.head(h)

    def aux(self):
        """Σ over the layers of the last forward's balancing losses."""
        return sum(block.moe.aux[...] for block in self.layers)


SPLIT = Split(first=("emb",), blocks="layers", last=("head",),  # compose's stage split of MoENet
              embed=lambda root, mods, tokens, positions: mods["emb"](tokens),
              block=lambda root, layer, h, positions: layer(h), head=lambda root, mods, h: mods["head"](h))


def cross_entropy(logits, targets):
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def adamw():
    return optax.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)


def batch():
    rng = np.random.default_rng(7)
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


def single_device(model, x, y, clip):
    """One device, the whole batch: CE + the balancing losses, (torch's global-norm clip,) AdamW."""
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = adamw()

    def loss_of(p):
        m = nnx.merge(gdef, p, rest)
        return cross_entropy(m(x), y) + m.aux()

    @jax.jit
    def step(p, opt):
        value, g = jax.value_and_grad(loss_of)(p)
        g = g if clip is None else recipe.scale_by_norm(g, recipe.sumsq(g), clip)
        updates, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, updates), opt, value

    opt, losses = tx.init(params), []
    for _ in range(STEPS):
        params, opt, value = step(params, opt)
        losses.append(float(value))
    return losses, {key_of(p): np.asarray(a) for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}


def run(layout: dict[str, int], style: str = "shard_map", clip: float | None = None) -> dict:
    model, (x, y) = MoENet(nnx.Rngs(0)), batch()
    trainer = compose(model, layout, cross_entropy, adamw(), plan=PLAN if layout.get("tp", 1) > 1 else None,
                      split=SPLIT, units=["layers.*"], experts=EXPERTS, aux=model.aux, style=style, clip=clip)  # glue
    losses = [trainer.train_step(x, y) for _ in range(STEPS)]  # glue
    theory = trainer.comm_theory()  # None under jit or with clip= (XLA places those reductions)
    agree = None
    if theory is not None:
        by_axis = ledger.comm_by_axis(trainer.compiled_text(x, y), trainer.mesh)
        agree = theory == {a: {op: (v["count"], v["bytes"]) for op, v in ops.items()} for a, ops in by_axis.items()}
    ref_losses, ref = single_device(model, jnp.asarray(x), jnp.asarray(y), clip)
    got = trainer.params()
    assert set(got) == set(ref), set(got) ^ set(ref)
    return {"framework": "jax", "layout": layout, "style": style, "clip": clip, "losses": losses,
            "reference_losses": ref_losses,
            "max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
            "max_abs_param_diff": max(float(np.abs(got[k] - ref[k]).max()) for k in ref), "theory_is_ledger": agree}


def parse_layout(text: str) -> dict[str, int]:
    return {axis.strip(): int(n) for axis, _, n in (part.partition("=") for part in text.split(","))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="fsdp=2,ep=2,tp=2", help="axis=size,… over dp fsdp ep tp")
    ap.add_argument("--style", default="shard_map", choices=("shard_map", "jit"))
    ap.add_argument("--clip", type=float, help="clip by the global gradient norm")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    try:
        result = run(parse_layout(args.layout), args.style, args.clip)
    except ComposeError as e:  # refused before compiling: one line
        print(e, file=sys.stderr)
        return 2
    for k, (a, b) in enumerate(zip(result["losses"], result["reference_losses"], strict=True)):
        print(f"step {k + 1}: loss {a:.15f}  one device {b:.15f}")
    print(f"max rel loss diff {result['max_rel_loss_diff']:.1e}, max abs param diff {result['max_abs_param_diff']:.1e}")
    if result["theory_is_ledger"] is not None:
        print(f"theory per axis == ledger (one SPMD program): {result['theory_is_ledger']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["max_rel_loss_diff"] <= TOL and result["max_abs_param_diff"] <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())
