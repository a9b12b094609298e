"""What the JAX own-model tests share (test_own_model_jax, test_tp_plan_jax, test_cp_seam_jax,
test_pp_seam_jax): the AdamW they all train with, a model's Params by path, and the single-device
reference — plain NNX on one device, the same optimizer and loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_impl.parallel.tree import key_of

STEPS = 3


def adamw():
    return optax.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)


def flat(model) -> dict[str, np.ndarray]:
    """{"blocks.0.up.kernel": array} for every Param of ``model``."""
    return {key_of(p): np.asarray(a) for p, a in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}


def train_single(model, loss, *batch) -> tuple[list[float], dict[str, np.ndarray]]:
    """STEPS of AdamW on ``loss(model, *batch)``, one device: (losses, final Params by path)."""
    gdef, params = nnx.split(model)
    tx = adamw()
    opt, losses = tx.init(params), []

    @jax.jit  # one program: run eagerly, each op was its own small program to lower and compile (~3x slower)
    def step(params, opt, *batch):
        value, grads = jax.value_and_grad(lambda p: loss(nnx.merge(gdef, p), *batch))(params)
        updates, opt = tx.update(grads, opt, params)
        return value, optax.apply_updates(params, updates), opt

    for _ in range(STEPS):
        value, params, opt = step(params, opt, *batch)
        losses.append(float(value))
    return losses, flat(nnx.merge(gdef, params))


class Stacked(nnx.Module):
    """Layers stacked by ``nnx.vmap`` and run by ``nnx.scan`` (Flax's scan-over-layers idiom): ``layers``
    is ONE nnx.Linear (d -> d) holding a (L, d, d) kernel and an (L, d) bias, passed into the scan."""

    def __init__(self, rngs, d: int = 8, layers: int = 2, out: int = 4):
        f64 = {"param_dtype": jnp.float64, "dtype": jnp.float64}
        self.embed = nnx.Linear(d, d, rngs=rngs, **f64)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return nnx.Linear(d, d, rngs=rngs, **f64)

        self.layers = make(rngs)
        self.head = nnx.Linear(d, out, rngs=rngs, **f64)

    def __call__(self, x):  # (B, d) -> (B, out)
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(layer, h):
            return jnp.tanh(layer(h))

        return self.head(body(self.layers, self.embed(x)))


# --- a user's MoE model for compose's expert axis (twin of tests/own_models.py's MoENet) --------------


class StackedExperts(nnx.Module):
    """E experts' weights stacked (E, …): w1 (E, D, F), b1 (E, F), w2 (E, F, D); one expert: silu(x·w1 + b1)·w2."""

    def __init__(self, rngs, experts: int = 4, dim: int = 6, hidden: int = 5):
        normal = lambda *shape: jax.random.normal(rngs.params(), shape, jnp.float64)  # noqa: E731
        self.w1 = nnx.Param(normal(experts, dim, hidden) * 0.4)
        self.b1 = nnx.Param(normal(experts, hidden) * 0.1)
        self.w2 = nnx.Param(normal(experts, hidden, dim) * 0.4)

    @staticmethod
    def one(w, rows):  # one expert (w its slices) on rows (R, D) -> (R, D)
        return jax.nn.silu(rows @ w["w1"] + w["b1"]) @ w["w2"]


class UserMoE(nnx.Module):
    """A user's top-k MoE layer with a residual, written ONCE for one device and the mesh: LayerNorm, a
    router, the top-k gates renormalised, the experts through ``parallel.ep.dispatch`` (unmapped: every
    expert here), Switch's balancing loss from ``parallel.ep.global_counts`` (the whole batch's counts
    under compose) stored as ``self.aux`` (an nnx.Intermediate) for the model's ``aux``."""

    def __init__(self, rngs, experts: int = 4, topk: int = 2, dim: int = 6):
        self.e, self.k = experts, topk
        self.norm = nnx.LayerNorm(dim, rngs=rngs, param_dtype=jnp.float64, dtype=jnp.float64)
        self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs, param_dtype=jnp.float64, dtype=jnp.float64)
        self.experts = StackedExperts(rngs, experts, dim)

    def __call__(self, x):  # (B, T, D)
        from jax_impl.parallel import ep

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
    """A LayerNorm'd biased MLP (the plan's colwise up / rowwise down), then a ``UserMoE``."""

    def __init__(self, rngs, experts: int = 4, dim: int = 6):
        f64 = {"param_dtype": jnp.float64, "dtype": jnp.float64}
        self.norm = nnx.LayerNorm(dim, rngs=rngs, **f64)
        self.up, self.down = nnx.Linear(dim, 8, rngs=rngs, **f64), nnx.Linear(8, dim, rngs=rngs, **f64)
        self.moe = UserMoE(rngs, experts, 2, dim)

    def __call__(self, x):
        return self.moe(x + self.down(jax.nn.gelu(self.up(self.norm(x)))))


class MoENet(nnx.Module):
    """compose's ep axis on a user's NNX MoE model: embedding (V = 24), ``layers`` MoEBlocks, a head; the
    experts ``layers.*.moe.experts`` stacked (E, …); ``MOE_NET_PLAN`` Megatron's split of the MLPs."""

    def __init__(self, rngs, layers: int = 2, experts: int = 4, vocab: int = 24, dim: int = 6):
        self.emb = nnx.Embed(vocab, dim, rngs=rngs, param_dtype=jnp.float64, dtype=jnp.float64)
        self.layers = nnx.List(MoEBlock(rngs, experts, dim) for _ in range(layers))
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs, param_dtype=jnp.float64, dtype=jnp.float64)

    def __call__(self, tokens):  # (B, T) -> (B, T, V)
        h = self.emb(tokens)
        for block in self.layers:
            h = block(h)
        return self.head(h)

    def aux(self):
        """Σ over the layers of the last forward's balancing losses."""
        return sum(block.moe.aux[...] for block in self.layers)


def moe_split():
    """MoENet's stage split for compose."""
    from jax_impl.parallel.compose import Split

    return Split(first=("emb",), blocks="layers", last=("head",),
                 embed=lambda root, mods, tokens, positions: mods["emb"](tokens),
                 block=lambda root, layer, h, positions: layer(h),
                 head=lambda root, mods, h: mods["head"](h))


MOE_NET_PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}
MOE_NET_EXPERTS = ["layers.*.moe.experts"]
