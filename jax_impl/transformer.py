"""The shared GPT-style decoder (shared/problem.py has the recipe) in JAX, twice:

- ``Transformer`` (``nnx.Module``) from Flax NNX's own pieces: ``nnx.Embed`` for tokens and
  positions, ``nnx.RMSNorm``, bias-free ``nnx.Linear`` (``kernel == W``, applied as ``x @ W``),
  causal attention written out (see ``attention``). Every parameter is created through
  ``rules(name, shape)`` → logical mesh axes (``nnx.with_partitioning``, MaxText style), so the
  jit styles get their shardings from one rules function (jax_impl/model.py).
- ``apply(params, tokens)``: the same math over a plain ``{name: array}`` dict keyed like
  ``shared.problem.transformer_param_names`` — the form the shard_map bodies use. Head counts are
  read from the arrays (``W_qkv.shape[1] // 3 // head_dim``), so a tensor-parallel device holding
  (D, 3D/tp) of whole heads runs the same code.
``named_params(model)`` maps the module back to that dict. Loss: ``jax_impl.model.output_loss``.

The mixture-of-experts transformer (``cfg.experts``; shared/problem.py's MoE recipe): a block whose
fixture has ``mlp.router.weight`` gets a ``MoE`` module (router ``nnx.Linear(D, E)``, stacked experts
``w_up`` (E, D, 4D) / ``w_down`` (E, 4D, D) as ``nnx.Param`` through the same rules, so a jit style
can shard them on dim 0). The module and ``apply_moe`` return ``(logits, aux, load)``: the summed
balancing losses and the routing counts (L, B, E); the dense path is untouched. ``moe`` has
seams for expert parallelism: ``dispatch`` (default ``dispatch_local``: every expert on this
device), ``total`` (the per-expert counts summed over the devices that share the batch) and
``select`` (top-k: ``lax.top_k``, or the same answer as a sort; jax_impl/ep.py says why).

Activation recomputation (cfg.recompute; Korthikanti et al. 2022, arXiv:2205.05198): every block
function here (``Block``, ``block``, ``moe_block``; jax_impl/tp.py's ``block_forward``) goes through
``remat_block`` (full: ``jax.checkpoint`` of the whole block, only its input x is a residual) and its
attention core through ``remat_core`` (selective: ``jax.checkpoint`` of the core alone, QKᵀ, softmax
and ·V recomputed from qkv). The policy is the one ``recomputing(policy)`` sets while a step is
traced — jax_impl/harness.run_pattern traces every pattern's step under cfg.recompute — so the
patterns' own jax.checkpoint policies (fsdp, mesh: re-gather the weights) wrap it unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_impl.parallel import cp as cp_seam
from jax_impl.parallel import ep as ep_seam
from jax_impl.parallel.compose_axes import Split
from jax_impl.parallel.typed import rows_like
from shared.problem import MOE_BALANCE_COEF, RMS_EPS

Rules = Callable[[str, tuple[int, ...]], tuple | None]  # param name, shape -> mesh axes per dim (None: replicated)


def gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)  # exact erf GELU, as torch's F.gelu


# --- activation recomputation: the policy the blocks are traced under ------------------------------

_RECOMPUTE = contextvars.ContextVar("recompute", default="none")


@contextlib.contextmanager
def recomputing(policy: str):
    """Blocks traced inside this context recompute per ``policy`` ("none" | "full" | "selective")."""
    token = _RECOMPUTE.set(policy)
    try:
        yield
    finally:
        _RECOMPUTE.reset(token)


def remat_block(fn: Callable) -> Callable:
    """full: ``jax.checkpoint(fn)`` (default policy: only fn's arguments are saved; the weights it
    closes over are alive anyway), so backward runs the block's forward again."""
    return jax.checkpoint(fn) if _RECOMPUTE.get() == "full" else fn


def remat_core(attn: Callable) -> Callable:
    """selective: the attention core ``attn(qkv, head_dim)`` under ``jax.checkpoint``: its residual
    is qkv, the (B, h, T, T) logits and probabilities are recomputed in backward."""
    return jax.checkpoint(attn, static_argnums=(1,)) if _RECOMPUTE.get() == "selective" else attn


def fixture_init(params: dict[str, np.ndarray], name: str, rules: Rules | None):
    w = params[name]

    def init(key, shape, dtype):
        assert tuple(shape) == w.shape, (name, shape, w.shape)
        return jnp.asarray(w, dtype)

    axes = rules(name, w.shape) if rules is not None else None
    return nnx.with_partitioning(init, axes) if axes is not None else init


def wide(x: jax.Array) -> jax.Array:
    """Mixed precision's attention core: 16-bit q, k, v computed on in float32 — scores, softmax and the
    P·V sums, as flash attention's accumulators and torch autocast's float32 softmax — and every
    attention here (the reference's, tp's, cp's ring and ulysses, typed) rounds its output to bf16 once,
    so the sharded cores differ from the reference by float32 round-off, not by where bf16 rounds
    (the ring merges partial softmaxes: in bf16 it sat at 11x the split-batch floor). float32 / 64: x."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def attention(qkv: jax.Array, head_dim: int) -> jax.Array:
    """qkv (B, T, 3·h·dh) for h local heads -> causal attention output (B, T, h·dh), heads in order.

    Written out rather than ``jax.nn.dot_product_attention``: its XLA path computes the logits
    with ``preferred_element_type=float32``, which caps float64 runs at ~1e-7 (measured 2e-7 vs
    torch's SDPA); this is the same math in the run's dtype. 16-bit compute: the core in float32
    (``wide``), its output rounded back once."""
    b, t, _ = qkv.shape
    dt, qkv = qkv.dtype, wide(qkv)
    q, k, v = (a.reshape(b, t, -1, head_dim) for a in jnp.split(qkv, 3, axis=-1))  # (B, T, h, dh)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(head_dim, q.dtype))  # (B, h, T, T)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))  # key k visible from query q iff k <= q
    probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, -1).astype(dt)  # (B, T, h·dh)


def seam_attention(qkv: jax.Array, head_dim: int) -> jax.Array:
    """``attention``, or inside a composed cp step (parallel.cp.active) the cp seam
    (parallel.cp.attention) on the same q, k, v heads: the Block's attention core. Outside cp it IS
    ``attention`` (every other run bit for bit unchanged)."""
    if not cp_seam.active():
        return attention(qkv, head_dim)
    b, t, _ = qkv.shape
    q, k, v = (a.reshape(b, t, -1, head_dim) for a in jnp.split(qkv, 3, axis=-1))  # (B, T/c, h, dh)
    return cp_seam.attention(q, k, v).reshape(b, t, -1)


# --- mixture of experts: routing, the experts, the balancing loss ------------------------------------


def route(h: jax.Array, w_r: jax.Array, k: int, select=jax.lax.top_k):
    """h (n, D) -> probs (n, E), top (n, k) expert ids, gates (n, k). ``lax.top_k`` puts the
    lower index first among equal probs (documented), the recipe's tie rule; gates are the k
    probs renormalised to sum to 1 (the gradient flows through them and the renormalisation).
    ``select(probs, k) -> (values, indices)``: top_k or the same answer another way."""
    probs = jax.nn.softmax(h @ w_r, axis=-1)  # (n, E)
    top_p, top = select(probs, k)  # (n, k), largest first
    return probs, top, top_p / jnp.sum(top_p, axis=-1, keepdims=True)


def experts(w_up: jax.Array, w_down: jax.Array, rows: jax.Array) -> jax.Array:
    """rows (E', R, D) through expert e' of the stacked (E', D, 4D), (E', 4D, D) -> (E', R, D)."""
    return jnp.einsum("erf,efd->erd", gelu(jnp.einsum("erd,edf->erf", rows, w_up)), w_down)


def combine(gates: jax.Array, picked: jax.Array) -> jax.Array:
    """gates (n, k) · each token's k expert outputs (n, k, D), summed over k -> (n, D). 16-bit compute: in
    float32 (``wide``: the products of two bf16 exact), rounded once — as torch's autocast MoE sums them in
    float32 — so GShard's combine einsum (k nonzero terms per output, the rest zeros) rounds where this does."""
    return jnp.sum(wide(gates)[..., None] * wide(picked), axis=1).astype(picked.dtype)


def dispatch_local(h, top, gates, w_up, w_down) -> jax.Array:
    """Every expert on this device: each expert runs on every token (E·n rows; the tiny test sizes
    make that cheap and it is exact), each token keeps its k outputs. -> (n, D)."""
    y = experts(w_up, w_down, jnp.broadcast_to(h, (w_up.shape[0],) + h.shape))  # (E, n, D)
    return combine(gates, y[top, jnp.arange(h.shape[0])[:, None]])  # y[top] (n, k, D)


def moe(h: jax.Array, w_r, w_up, w_down, k: int, dispatch=dispatch_local, total=lambda c: c,
        select=jax.lax.top_k):
    """One MoE layer on h = norm2(x) (B', T, D) -> (out (B', T, D), aux (), load (B', E) int64).
    aux = 0.01·E·Σ_e f_e·P_e: f_e = ``total``(this device's counts) / (k·B·T), a constant
    (stop_gradient); P_e = mean probs over the tokens here (an ep device: its own, the mean over
    devices of the local losses then holds the global P)."""
    b, t, d = h.shape
    probs, top, gates = route(h.reshape(-1, d), w_r, k, select)  # (n, E), (n, k), (n, k)
    e = probs.shape[-1]
    load = jax.nn.one_hot(top, e, dtype=jnp.int64).sum(1).reshape(b, t, e).sum(1)  # (B', E) (x64: jax_impl)
    counts = total(load.sum(0))  # (E,) over the whole batch
    f = jax.lax.stop_gradient(counts.astype(probs.dtype) / jnp.sum(counts).astype(probs.dtype))
    aux = MOE_BALANCE_COEF * e * jnp.sum(f * jnp.mean(probs, axis=0))
    return dispatch(h.reshape(-1, d), top, gates, w_up, w_down).reshape(b, t, d), aux, load


class MoE(nnx.Module):
    """The MoE layer as a module: router ``nnx.Linear(D, E)`` (kernel W_r), stacked experts."""

    def __init__(self, prefix: str, params, dim: int, topk: int, dtype, rules: Rules | None, param_dtype=None):
        e = params[prefix + "mlp.router.weight"].shape[1]
        pd = param_dtype or dtype  # mixed precision: float32 master weights, cast to dtype (bf16) in __call__
        self.topk, self.dtype = topk, dtype
        self.router = nnx.Linear(dim, e, use_bias=False, dtype=dtype, param_dtype=pd, rngs=nnx.Rngs(0),
                                 kernel_init=fixture_init(params, prefix + "mlp.router.weight", rules))
        stacked = lambda n: nnx.Param(fixture_init(params, prefix + n, rules)(None, params[prefix + n].shape, pd))
        self.w_up, self.w_down = stacked("mlp.experts.w_up"), stacked("mlp.experts.w_down")  # (E, D, 4D), (E, 4D, D)

    def __call__(self, h: jax.Array, total: jax.Array | None = None):
        """``total``: this layer's (E,) counts over a whole micro-batch, for the balancing loss's f (the
        reference's split-batch floor: a part's P with the micro-batch's f, as ep's devices compute it)."""
        w = [a.astype(self.dtype) for a in (self.router.kernel[...], self.w_up[...], self.w_down[...])]
        seams = {"dispatch": dispatch_ep, "total": ep_seam.total_counts} if ep_seam.active() else {}  # compose's ep
        return moe(h, *w, self.topk, **(seams | ({} if total is None else {"total": lambda _: total})))


def dispatch_ep(h, top, gates, w_up, w_down) -> jax.Array:
    """``moe``'s dispatch inside compose's shard_map (jax_impl/parallel/compose_ep.py): this device's
    experts (E/ep, …) through parallel.ep.dispatch (the tokens over "ep") -> (n, D)."""
    one = lambda w, rows: experts(w["w_up"][None], w["w_down"][None], rows[None])[0]  # noqa: E731
    return combine(gates, ep_seam.dispatch(one, {"w_up": w_up, "w_down": w_down}, h, top))


class Block(nnx.Module):
    def __init__(self, prefix: str, params, dim: int, heads: int, dtype, rules: Rules | None, topk: int = 1,
                 param_dtype=None):
        pd = param_dtype or dtype  # mixed precision: float32 parameters, computed in dtype (bf16)
        lin = lambda n, i, o: nnx.Linear(i, o, use_bias=False, kernel_init=fixture_init(params, prefix + n, rules),
                                        dtype=dtype, param_dtype=pd, rngs=nnx.Rngs(0))
        norm = lambda n: nnx.RMSNorm(dim, epsilon=RMS_EPS, scale_init=fixture_init(params, prefix + n, rules),
                                     dtype=dtype, param_dtype=pd, rngs=nnx.Rngs(0))
        self.head_dim = dim // heads
        self.norm1, self.norm2 = norm("norm1.weight"), norm("norm2.weight")
        self.qkv, self.o = lin("attn.qkv.weight", dim, 3 * dim), lin("attn.o.weight", dim, dim)
        if prefix + "mlp.router.weight" in params:
            self.mlp = MoE(prefix, params, dim, topk, dtype, rules, pd)
        else:
            self.up, self.down = lin("mlp.up.weight", dim, 4 * dim), lin("mlp.down.weight", 4 * dim, dim)

    def __call__(self, x: jax.Array, total: jax.Array | None = None):
        """-> x (B, T, D); an MoE block: (x, aux, load (B, E)) (``total``: MoE.__call__'s)."""
        return remat_block(self._forward)(x) if total is None else remat_block(self._forward)(x, total)

    def _forward(self, x: jax.Array, total: jax.Array | None = None):
        x = x + self.o(remat_core(seam_attention)(self.qkv(self.norm1(x)), self.head_dim))
        if hasattr(self, "mlp"):
            out, aux, load = self.mlp(self.norm2(x), total)
            return x + out, aux, load
        return x + self.down(gelu(self.up(self.norm2(x))))  # (B, T, D)


class Transformer(nnx.Module):
    def __init__(self, params: dict[str, np.ndarray], heads: int, dtype, rules: Rules | None = None, topk: int = 1,
                 param_dtype=None):
        """``dtype``: what it computes in; ``param_dtype`` (default: dtype) what its parameters are stored in
        (mixed precision: float32 master weights, bf16 compute, the logits handed to the loss in float32)."""
        vocab, dim = params["wte.weight"].shape
        seq = params["wpe.weight"].shape[0]
        layers = sum(1 for k in params if k.endswith("attn.qkv.weight"))
        pd = param_dtype or dtype
        self.logits_dtype = pd if pd != dtype else None  # mixed: the loss in float32, as under torch's autocast
        emb = lambda n, rows: nnx.Embed(rows, dim, embedding_init=fixture_init(params, n, rules), dtype=dtype,
                                        param_dtype=pd, rngs=nnx.Rngs(0))
        self.wte, self.wpe = emb("wte.weight", vocab), emb("wpe.weight", seq)
        self.blocks = nnx.List(Block(f"blocks.{l}.", params, dim, heads, dtype, rules, topk, pd) for l in range(layers))
        self.normf = nnx.RMSNorm(dim, epsilon=RMS_EPS, scale_init=fixture_init(params, "normf.weight", rules),
                                 dtype=dtype, param_dtype=pd, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(dim, vocab, use_bias=False, kernel_init=fixture_init(params, "head.weight", rules),
                               dtype=dtype, param_dtype=pd, rngs=nnx.Rngs(0))

    def __call__(self, tokens: jax.Array, totals: jax.Array | None = None):
        """-> logits (B, T, V); the MoE transformer: (logits, Σ_l aux_l, load (L, B, E)). ``totals``: (L, E)
        counts each MoE layer's balancing loss takes its f from (default: its own tokens')."""
        # sharding in types (jax_impl/parallel/typed.py): a lookup with split ids states its output's layout
        x = self.wte(tokens, out_sharding=rows_like(tokens)) + self.wpe(jnp.arange(tokens.shape[1]))  # (B, T, D)
        aux, loads = [], []
        for l, block in enumerate(self.blocks):
            x = block(x) if totals is None else block(x, totals[l])
            if isinstance(x, tuple):
                x, a, load = x
                aux, loads = aux + [a], loads + [load]
        logits = self.head(self.normf(x))  # (B, T, V)
        if self.logits_dtype is not None:
            logits = logits.astype(self.logits_dtype)
        return (logits, sum(aux), jnp.stack(loads)) if loads else logits


# --- the Transformer's plan and stage split for parallel.compose (torchtitan style: beside the model) ----
# Megatron over the blocks: the fused [q|k|v] kernel by whole heads (colwise_heads: device r holds
# [q_r|k_r|v_r]), o and down rowwise, up colwise; wte, wpe, the norms and the head stay replicated.
PLAN = {"blocks.*.qkv": "colwise_heads", "blocks.*.o": "rowwise", "blocks.*.up": "colwise",
        "blocks.*.down": "rowwise"}


def _logits(root: Transformer, logits: jax.Array) -> jax.Array:
    return logits if root.logits_dtype is None else logits.astype(root.logits_dtype)


# Transformer(x) == head(block(…block(embed(x))…)): wpe at the GLOBAL positions (a cp shard's own), the
# blocks' attention through the cp seam (seam_attention). The dense transformer only (an MoE block
# returns (x, aux, load): compose refuses the split's chain).
SPLIT = Split(first=("wte", "wpe"), blocks="blocks", last=("normf", "head"),
              embed=lambda root, mods, tokens, positions: mods["wte"](tokens) + mods["wpe"](positions),
              block=lambda root, layer, h, positions: layer(h),
              head=lambda root, mods, h: _logits(root, mods["head"](mods["normf"](h))))


# The MoE transformer under compose (jax_impl/mesh.py with an ep axis): Megatron over attention only (the MoE
# layer runs whole on every tp device), the stacked experts split over ep (compose's experts=), the blocks'
# balancing losses kept on each block for aux= (MOE_AUX), the Transformer's own (logits, aux, load) forward
# checked against the chain by its logits.
MOE_PLAN = {"blocks.*.qkv": "colwise_heads", "blocks.*.o": "rowwise"}
MOE_EXPERTS = ("blocks.*.mlp.w_up", "blocks.*.mlp.w_down")


def _moe_block(root, layer, h, positions):
    h, aux, _ = layer(h)
    layer.aux = nnx.Intermediate(aux)  # this forward's balancing loss (the layer is compose's merged copy)
    return h


MOE_SPLIT = Split(first=SPLIT.first, blocks=SPLIT.blocks, last=SPLIT.last, embed=SPLIT.embed, block=_moe_block,
                  head=SPLIT.head)


def MOE_AUX(view) -> jax.Array:  # noqa: N802  (a constant of the split's kind)
    """Σ_l of the blocks' balancing losses of compose's forward (compose_ep.Experts.aux_value's view)."""
    return sum(b.aux[...] for b in view.blocks)


_NAMES = {"mlp.router.kernel": "mlp.router.weight", "mlp.w_up": "mlp.experts.w_up",
          "mlp.w_down": "mlp.experts.w_down",
          "wte.embedding": "wte.weight", "wpe.embedding": "wpe.weight", "normf.scale": "normf.weight",
          "head.kernel": "head.weight", "qkv.kernel": "attn.qkv.weight", "o.kernel": "attn.o.weight",
          "up.kernel": "mlp.up.weight", "down.kernel": "mlp.down.weight", "norm1.scale": "norm1.weight",
          "norm2.scale": "norm2.weight"}


def param_name(path: str) -> str:
    """A dense Transformer's NNX Param path ("blocks.0.qkv.kernel") -> its fixture name
    ("blocks.0.attn.qkv.weight"), as ``named_params`` keys it."""
    if path.startswith("blocks."):
        _, l, rest = path.split(".", 2)
        return f"blocks.{l}.{_NAMES[rest]}"
    return _NAMES[path]


def named_params(model: Transformer) -> dict[str, jax.Array]:
    """{torch-style name: array} in shared.problem.transformer_param_names order."""
    out = {"wte.weight": model.wte.embedding[...], "wpe.weight": model.wpe.embedding[...]}
    for l, b in enumerate(model.blocks):
        p = f"blocks.{l}."
        out |= {p + "norm1.weight": b.norm1.scale[...], p + "attn.qkv.weight": b.qkv.kernel[...],
                p + "attn.o.weight": b.o.kernel[...], p + "norm2.weight": b.norm2.scale[...]}
        if hasattr(b, "mlp"):
            out |= {p + "mlp.router.weight": b.mlp.router.kernel[...], p + "mlp.experts.w_up": b.mlp.w_up[...],
                    p + "mlp.experts.w_down": b.mlp.w_down[...]}
        else:
            out |= {p + "mlp.up.weight": b.up.kernel[...], p + "mlp.down.weight": b.down.kernel[...]}
    return out | {"normf.weight": model.normf.scale[...], "head.weight": model.head.kernel[...]}


# --- the same math over a {name: array} dict (shard_map bodies, pipeline stages) ---------------------


def rms_norm(x: jax.Array, g: jax.Array) -> jax.Array:
    if jnp.finfo(x.dtype).bits < 32:  # 16-bit compute (mixed precision): nnx.RMSNorm's own roundings
        return rms_norm16(x, g)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + RMS_EPS) * g


def rms_norm16(x: jax.Array, g: jax.Array) -> jax.Array:
    """nnx.RMSNorm(dtype=bf16) step for step: the mean square in float32, x·(rsqrt·g) in float32, the
    result rounded once to x's dtype (the hand-written forwards then round where the Flax reference does)."""
    wide = x.astype(jnp.float32)
    mul = jax.lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + RMS_EPS) * g.astype(jnp.float32)
    return (x * mul).astype(x.dtype)


def embed(params: dict, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    positions = jnp.arange(tokens.shape[1]) if positions is None else positions
    return params["wte.weight"][tokens] + params["wpe.weight"][positions]  # (B, T, D)


def block(params: dict, l: int, x: jax.Array, head_dim: int, attn=attention) -> jax.Array:
    """``attn(qkv, head_dim) -> (B, T, h·dh)`` is ``attention`` unless a pattern splits the sequence
    (context parallelism: a ring or an all-to-all around the same math)."""
    p, core = lambda n: params[f"blocks.{l}.{n}.weight"], remat_core(attn)

    def run(x):
        x = x + core(rms_norm(x, p("norm1")) @ p("attn.qkv"), head_dim) @ p("attn.o")
        return x + gelu(rms_norm(x, p("norm2")) @ p("mlp.up")) @ p("mlp.down")  # (B, T, D)

    return remat_block(run)(x)


def head(params: dict, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["normf.weight"]) @ params["head.weight"]  # (B, T, V)


def apply(params: dict, tokens: jax.Array, head_dim: int, positions: jax.Array | None = None,
          attn=attention) -> jax.Array:
    """Logits (B, T, V) from the {name: array} dict; the blocks present are those in ``params``.
    ``positions``: the global positions of a sequence shard (default ``arange(T)``)."""
    x = embed(params, tokens, positions)
    layers = sorted({int(k.split(".")[1]) for k in params if k.startswith("blocks.")})
    for l in layers:
        x = block(params, l, x, head_dim, attn)
    return head(params, x)


def moe_block(params: dict, l: int, x: jax.Array, head_dim: int, topk: int, dispatch=dispatch_local,
              total=lambda c: c, attn=attention, select=jax.lax.top_k):
    """An MoE block over the dict: -> (x (B, T, D), aux (), load (B, E)); ``moe``'s seams."""
    p, core = lambda n: params[f"blocks.{l}.{n}"], remat_core(attn)

    def run(x):
        x = x + core(rms_norm(x, p("norm1.weight")) @ p("attn.qkv.weight"), head_dim) @ p("attn.o.weight")
        out, aux, load = moe(rms_norm(x, p("norm2.weight")), p("mlp.router.weight"), p("mlp.experts.w_up"),
                             p("mlp.experts.w_down"), topk, dispatch, total, select)
        return x + out, aux, load

    return remat_block(run)(x)


def apply_moe(params: dict, tokens: jax.Array, head_dim: int, topk: int, dispatch=dispatch_local,
              total=lambda c: c, pin=lambda x: x, select=jax.lax.top_k):
    """The MoE transformer over the dict: -> (logits (B, T, V), Σ_l aux_l, load (L, B, E)).
    ``pin``: applied to the residual stream between blocks (a jit style's sharding constraint)."""
    x, aux, loads = pin(embed(params, tokens)), 0.0, []
    layers = sorted({int(k.split(".")[1]) for k in params if k.startswith("blocks.")})
    for l in layers:
        x, a, load = moe_block(params, l, x, head_dim, topk, dispatch, total, select=select)
        x, aux, loads = pin(x), aux + a, loads + [load]
    return head(params, x), aux, jnp.stack(loads)
