"""Tensor parallelism in types ("typed": JAX's Explicit axes, jax_impl/parallel/typed.py) — tp.py's layouts
(tp_rules, to_layout) with every layout change stated by the program; XLA picks the collectives.

The weights are typed by the same rules as the other styles (W_up ``float64[16,64@tp]``, W_down
``float64[64@tp,16]``, W_qkv (D, 3, D@tp), wte (V@tp, D), head (D, V@tp)); the batch is P().

    column-parallel  ``einsum(x, W, out_sharding=P(…, 'tp'))``: x P() -> y split on its last dim.
                     Megatron's f (identity fwd, all-reduce bwd) is not written: the transpose of the
                     contraction over W's split columns is typed P() like x, XLA sums it.
    row-parallel     ``einsum(h, W, out_sharding=P(…, unreduced={'tp'}))``: a contraction over the
                     split dim leaves each device a PARTIAL sum, typed ``float64[8,16]{U:tp}``; then
                     ``reshard(z, P())`` is Megatron's g — the unreduced -> reduced step (XLA: an
                     all-reduce). Without out_sharding JAX refuses the matmul at trace time
                     ("Contracting dimensions are sharded and it is ambiguous how the output should
                     be sharded"). Sequence parallel reshards to P(None, 'tp', None): g-bar, XLA's
                     reduce-scatter, and the stream (B, T@tp, D) is resharded to P() (an all-gather,
                     SP's g) before each column-parallel matmul and the head.
    embedding        vocab-parallel: the ids one-hot (B, T, V), resharded to P(…, 'tp') (a slice),
                     contracted with wte (V@tp, D) into an unreduced sum, reduced as above (exact:
                     one 1 per row). shard_map masks and psums; here the types say the same.
    loss             vocab-parallel cross-entropy on logits (B, T, V@tp): max, Σexp and the target
                     logit (one-hot product) are reductions over the split vocab — typed P(), XLA's
                     all-reduces. No gather of the logits.

Every reshard and unreduced product is recorded at trace time (``Stated``): Trained.extra["stated"].
MLP: megatron as (column, row) pairs + a lone last column gathered (odd L); allgather: every layer
column-parallel, its output resharded to P() (the all-gather stated).

No torch twin: torch has no sharding-in-types style; DTensor placements (torch_impl/tp.py, builtin) are the
nearest.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_impl import transformer
from jax_impl.model import gelu, output_loss, to_compute, to_loss
from jax_impl.parallel.typed import Stated
from jax_impl.transformer import rms_norm


class TypedOps:
    """The column, row, gather and embedding steps, each a statement the recorder keeps."""

    def __init__(self, stated: Stated, sequence_parallel: bool = False, rows=None, tp: bool = True):
        """``rows``: the mesh axis (or axes) the batch dim is split over (jax_impl/mesh_typed.py: the
        data axis); every stated layout keeps it on dim 0. ``tp=False`` (a mesh without 'tp'): plain
        matmuls, a lookup and the plain cross-entropy, only the batch dim split."""
        self.st, self.sp, self.rows, self.tp = stated, sequence_parallel, rows, tp

    def spec(self, ndim: int, *last, **kw) -> P:
        """(rows, None, …, *last) over ndim dims."""
        return P(self.rows, *[None] * (ndim - 1 - len(last)), *last, **kw)

    def column(self, eq: str, x, w, what: str):
        """x (…, D) P() @ W (D, …@tp): the output split on its last dim, stated with out_sharding (no
        layout of an existing array changes: not recorded)."""
        return jnp.einsum(eq, x, w, out_sharding=self.spec(x.ndim - 1 + w.ndim - 1, *["tp"] * self.tp))

    def row(self, eq: str, h, w, what: str):
        """h (…, F@tp) @ W (F@tp, D): an unreduced partial sum, then reduced (SP: scattered over T)."""
        if not self.tp:
            return jnp.einsum(eq, h, w, out_sharding=self.spec(h.ndim - 1 + w.ndim - 1))
        z = jnp.einsum(eq, h, w, out_sharding=self.spec(h.ndim - 1 + w.ndim - 1, unreduced={"tp"}))
        self.st.note(f"{what}: einsum out_sharding=P(unreduced={{'tp'}})", z, f"{jax.typeof(h)} · {jax.typeof(w)}",
                     "none (each device keeps its partial sum)")
        return self.reduce(z, what)

    def reduce(self, z, what: str):
        return self.st.reshard(z, P(self.rows, "tp", None) if self.sp else self.spec(z.ndim),
                               f"{what} (unreduced -> reduced)")

    def full(self, x, what: str):
        """SP: the stream (B, T@tp, D) gathered before a column-parallel matmul; otherwise it is P()."""
        return self.st.reshard(x, self.spec(x.ndim), what) if self.sp else x

    def embed(self, wte, tokens):
        """Vocab-parallel lookup: one-hot ids (a slice to this device's V/tp columns) · wte rows."""
        if not self.tp:
            return wte.at[tokens].get(out_sharding=self.spec(3))
        onehot = self.st.reshard(jax.nn.one_hot(tokens, wte.shape[0], dtype=wte.dtype), self.spec(3, "tp"),
                                 "one-hot ids")
        return self.row("btv,vd->btd", onehot, wte, "wte (vocab-parallel embedding)")

    def positions(self, wpe, t: int):
        pos = wpe[:t]  # (T, D)
        return self.st.reshard(pos, P("tp", None), "wpe rows (this device's positions)") if self.sp else pos


def layer_kinds(layers: int, variant: str) -> list[str]:
    """MLP, per layer: "col" (W_l[:, shard], (D, D/tp)) or "row" (W_l[shard, :], (D/tp, D))."""
    if variant == "allgather":
        return ["col"] * layers
    return ["col", "row"] * (layers // 2) + ["col"] * (layers % 2)  # odd L: last col + all-gather


def attend(qkv: jax.Array, head_dim: int) -> jax.Array:
    """tp.attend's math on (B, T, 3, D@tp): the heads axis inherits the split (h@tp), no statement."""
    b, t = qkv.shape[:2]
    dt, qkv = qkv.dtype, transformer.wide(qkv)  # 16-bit: the core in float32 (transformer.wide)
    q, k, v = (qkv[:, :, i].reshape(b, t, -1, head_dim) for i in range(3))  # (B, T, h@tp, dh)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(head_dim, q.dtype))
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, -1).astype(dt)  # (B, T, D@tp)


def block(w, l: int, x, head_dim: int, ops: TypedOps):
    """One Megatron block in types; ``w(name)`` its weights (tp.to_layout)."""
    core = transformer.remat_core(attend)

    def run(x):
        h = ops.full(rms_norm(x, w("norm1")), f"blocks.{l} norm1 output")  # SP: all-gather the tokens
        qkv = ops.column("btd,dcf->btcf", h, w("attn.qkv"), f"blocks.{l}.attn.qkv")  # (B, T, 3, D@tp)
        x = x + ops.row("btf,fd->btd", core(qkv, head_dim), w("attn.o"), f"blocks.{l}.attn.o")
        h = ops.full(rms_norm(x, w("norm2")), f"blocks.{l} norm2 output")
        u = gelu(ops.column("btd,df->btf", h, w("mlp.up"), f"blocks.{l}.mlp.up"))  # (B, T, 4D@tp)
        return x + ops.row("btf,fd->btd", u, w("mlp.down"), f"blocks.{l}.mlp.down")

    return transformer.remat_block(run)(x)


def vocab_parallel_ce(logits, y, ops: TypedOps):
    """Mean cross-entropy of logits (B, T, V@tp): the reductions over the split vocab are typed P()."""
    if not ops.tp:
        return output_loss(logits, y)
    m = jax.lax.stop_gradient(logits.max(axis=-1))  # (B, T): XLA's all-reduce (max)
    shifted = logits - m[..., None]
    onehot = ops.st.reshard(jax.nn.one_hot(y, logits.shape[-1], dtype=logits.dtype), ops.spec(3, "tp"),
                            "one-hot targets")
    picked = jnp.sum(shifted * onehot, axis=-1)  # the target logit, (B, T)
    return jnp.mean(jnp.log(jnp.exp(shifted).sum(axis=-1)) - picked)


def transformer_loss(head_dim: int, ops: TypedOps, gather=lambda p: p, cast=lambda p: p, out=lambda a: a):
    """``gather(p) -> p``: the weights as the tp layout wants them (mesh_typed: fsdp's reshards);
    ``cast``, ``out``: mixed precision's (model.to_compute, model.to_loss)."""
    def loss(p, tokens, y):
        p = cast(gather(p))
        x = ops.embed(p["wte.weight"], tokens) + ops.positions(p["wpe.weight"], tokens.shape[1])
        layers = sum(1 for k in p if k.endswith("attn.qkv.weight"))
        for l in range(layers):
            x = block(lambda n, l=l: p[f"blocks.{l}.{n}.weight"], l, x, head_dim, ops)
        h = ops.full(rms_norm(x, p["normf.weight"]), "normf output")
        return vocab_parallel_ce(out(ops.column("btd,dv->btv", h, p["head.weight"], "head")), y, ops)
    return loss


def mlp_loss(layers: int, variant: str, ops: TypedOps, cast=lambda p: p, out=lambda a: a):
    kinds = layer_kinds(layers, variant)

    def loss(p, x):
        p, x = cast(p), cast(x)
        ws = [p[f"layers.{l}.linear.weight"] for l in range(layers)]
        for l, (w, kind) in enumerate(zip(ws, kinds, strict=True)):
            name = f"layers.{l}"
            if kind == "row":  # the pair's second half: x (B, D@tp) from the column layer before
                x = gelu(ops.row("bf,fd->bd", x, w, name))
                continue
            x = gelu(ops.column("bd,df->bf", x, w, name))  # (B, D@tp)
            if variant == "allgather" or l == layers - 1:  # no row layer follows: gather it
                x = ops.st.reshard(x, P(), f"{name} output")
        return output_loss(out(x))
    return loss


def loss_for(cfg, variant: str, stated: Stated):
    """Mixed precision: the weights (and the MLP's input) cast to bf16 inside the loss, the output to
    the loss in float32 (model.to_compute / to_loss)."""
    ops, cast, out = TypedOps(stated, sequence_parallel=variant == "megatron_sp"), partial(to_compute, cfg), \
        partial(to_loss, cfg)
    if cfg.model == "mlp":
        return mlp_loss(cfg.layers, variant, ops, cast, out)
    return transformer_loss(cfg.head_dim, ops, cast=cast, out=out)
