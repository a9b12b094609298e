"""Context parallelism for any Flax NNX model that offers the attention seam: the twin of
torch_impl/parallel/cp.py (jax_impl/cp.py plugs the same ring into the project's transformer).

The seam: (1) attention through ``parallel.cp.attention`` (``nnx.MultiHeadAttention(...,
attention_fn=parallel.cp.attention)``): CAUSAL over (B, T, H, dh), no mask, bias or dropout
(refused); (2) the GLOBAL positions handed to the model's position encoding (``loss(model, *batch,
positions)``); (3) a loss that is a mean over the tokens it sees.

    trainer = context_parallel(model, loss, optax.adamw(...), mesh, "ring")   # mesh axis "cp"
    loss_value = trainer.train_step(tokens, targets)   # (B, T) each; T split over "cp"

Sharded: every batch array along dim 1 (ring_zigzag: chunks r and 2N−1−r of 2N); every parameter
replicated, P(). a = one device's K, B·(T/N)·H·dh·b.
Collectives per attention call: ring 3N−2 collective-permutes of 2a; ulysses 8 all-to-alls of a;
jit/seq_sharded: XLA (GSPMD) picks. The replicated gradients come back summed over "cp" by the
transpose of the invariant -> varying cast: an all-reduce of Φ·b.
A model that never calls the seam is refused at the first trace; one that routes only some attention
layers through it cannot be detected: route every attention through it.
Recipe (parallel/recipe.py, docs/recipe.md): optax sees the whole replicated {path: array} dict
(masks, labels, optax's own clipping exact); ``clip=max_norm`` clips with torch's formula;
``compute_dtype=jnp.bfloat16`` casts the Params inside the step (made device-varying first, so the
gradient all-reduce stays in the master dtype); 16-bit attention is computed in float32 (the ring's
accumulators and its travelling dK|dV too), its output rounded back once; float16 adds dynamic loss
scaling (parallel/scaling.py; the gradients leave the ring whole: the skip is agreed without a collective).
Papers: ring attention, Liu et al. 2023 (arXiv:2310.01889); DeepSpeed-Ulysses, Jacobs et al. 2023
(arXiv:2309.14509).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.parallel import recipe, scaling
from jax_impl.parallel.theory import seam_comm
from jax_impl.parallel.tree import WrapError, fetch, key_of
from shared.theory import cp_chunks, cp_positions

VARIANTS = (("shard_map", "ring"), ("shard_map", "ring_zigzag"), ("shard_map", "ulysses"), ("jit", "seq_sharded"))
AXIS = "cp"
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("cp_seam", default=None)  # (variant, n, record)


class SeamError(ValueError):
    """A call of the attention seam, or a model, that context parallelism cannot compute exactly."""


def causal(q, k, v):
    """Causal attention (B, T, H, dh) -> (B, T, H, dh) in the inputs' dtype (not
    jax.nn.dot_product_attention: its logits are float32, which caps float64 parity at ~1e-7). 16-bit
    inputs: computed in float32, the output rounded back once (as the ring's accumulators)."""
    t, dt = q.shape[1], q.dtype
    q, k, v = (a.astype(jnp.promote_types(dt, jnp.float32)) for a in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))  # (B, H, T, T)
    p = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v).astype(dt)


# --- which chunk pairs each (device, hop) computes: ONE function for the body and the report ----------


def chunk_pairs(n: int, rank: int, hop: int, variant: str) -> tuple[tuple[int, int, bool], ...]:
    """(q's local chunk, kv's local chunk, diagonal) for every pair device ``rank`` computes at ring
    hop ``hop``, holding the K|V block of device (rank − hop) mod n. A pair is computed iff its key
    chunk is not later than its query chunk (kc <= qc), with the causal mask inside iff kc == qc."""
    qs, ks = cp_chunks(n, rank, variant), cp_chunks(n, (rank - hop) % n, variant)
    return tuple((a, b, kc == qc) for a, qc in enumerate(qs) for b, kc in enumerate(ks) if kc <= qc)


def on_schedule(n: int, hop: int, variant: str, branch, *operands):
    """``branch(pairs)(*operands)`` with this device's pairs at ``hop``: one ``lax.switch`` over the
    distinct pair lists, so a skipped pair is never computed (shapes stay static)."""
    per_device = [chunk_pairs(n, r, hop, variant) for r in range(n)]
    kinds = sorted(set(per_device))
    if len(kinds) == 1:
        return branch(kinds[0])(*operands)
    index = jnp.asarray([kinds.index(p) for p in per_device], jnp.int32)[lax.axis_index(AXIS)]
    return lax.switch(index, [branch(k) for k in kinds], *operands)


# --- ring attention: online-softmax forward, flash-attention backward, per query chunk ---------------


def _groups(pairs, c: int) -> list[tuple[int, slice, np.ndarray | None]]:
    """A pair list as (query chunk a, the held block's key range it sees, mask or None): every
    schedule gives each query chunk a contiguous run of key chunks, computed as one block."""
    runs: dict[int, list[tuple[int, bool]]] = {}
    for a, b, diag in pairs:
        runs.setdefault(a, []).append((b, diag))
    out = []
    for a, bd in runs.items():
        bs = [b for b, _ in bd]
        assert bs == list(range(bs[0], bs[-1] + 1)), pairs
        mask = np.concatenate([np.tril(np.ones((c, c), bool)) if d else np.ones((c, c), bool) for _, d in bd], 1)
        out.append((a, slice(bs[0] * c, (bs[-1] + 1) * c), None if mask.all() else mask))
    return out


def _scores(q, k, mask):
    """q (B, H, c, dh) · k (B, H, m·c, dh) / √dh -> (B, H, c, m·c), the future masked out."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _fwd_pairs(pairs, c: int):
    def run(out, lse, q, kv):  # per local chunk a: out[a] (B, H, c, dh), lse[a] (B, H, c); kv (2, B, H, T/N, dh)
        out, lse = list(out), list(lse)
        for a, keys, mask in _groups(pairs, c):
            s = _scores(q[a], kv[0][..., keys, :], mask)  # (B, H, c, m·c)
            lse_b = jax.nn.logsumexp(s, axis=-1)  # (B, H, c)
            o_b = jnp.einsum("bhqk,bhkd->bhqd", jnp.exp(s - lse_b[..., None]), kv[1][..., keys, :])
            new = jnp.logaddexp(lse[a], lse_b)  # online softmax: rescale both to the merged lse
            out[a] = out[a] * jnp.exp(lse[a] - new)[..., None] + o_b * jnp.exp(lse_b - new)[..., None]
            lse[a] = new
        return out, lse
    return run


def _bwd_pairs(pairs, c: int):
    def run(dq, dkv, q, kv, dout, lse, delta):  # dkv (2, B, H, T/N, dh): dK|dV of the block held
        dq = list(dq)
        for a, keys, mask in _groups(pairs, c):
            k, v = kv[0][..., keys, :], kv[1][..., keys, :]
            p = jnp.exp(_scores(q[a], k, mask) - lse[a][..., None])  # (B, H, c, m·c): final probabilities
            ds = p * (jnp.einsum("bhqd,bhkd->bhqk", dout[a], v) - delta[a][..., None])  # P ∘ (dP − rowsum(dO∘O))
            scale = 1 / jnp.sqrt(jnp.asarray(q[a].shape[-1], k.dtype))
            dq[a] = dq[a] + jnp.einsum("bhqk,bhkd->bhqd", ds, k) * scale
            dkv = dkv.at[:, ..., keys, :].add(jnp.stack([jnp.einsum("bhqk,bhqd->bhkd", ds, q[a]) * scale,
                                                         jnp.einsum("bhqk,bhqd->bhkd", p, dout[a])]))
        return dq, dkv
    return run


def ring_core(variant: str, n: int):
    """core(q, k, v) -> causal attention output, each (B, H, T/N, dh) on this device's positions:
    the ring over AXIS (any model's seam: ``attention``; the project's transformer: jax_impl/cp.py)."""
    ring = [(j, (j + 1) % n) for j in range(n)]
    send = lambda x: lax.ppermute(x, AXIS, ring)  # to r+1: I receive the block of r−1
    m = len(cp_chunks(n, 0, variant))  # chunks per device
    chunks = lambda x: jnp.split(x, m, axis=2)  # (B, H, T/N, …) -> m × (B, H, c, …)

    @jax.custom_vjp
    def core(q, k, v):
        return core_fwd(q, k, v)[0]

    def core_fwd(q, k, v):  # (B, H, T/N, dh) each
        c, wide = q.shape[2] // m, jnp.promote_types(q.dtype, jnp.float32)  # bf16 in: float32 accumulators
        kv = jnp.stack([k, v])  # (2, B, H, T/N, dh): K|V travel as one message (in q's dtype)
        out, lse = [jnp.zeros(x.shape, wide) for x in chunks(q)], [jnp.full(q.shape[:2] + (c,), -jnp.inf, wide)] * m
        for hop in range(n):
            incoming = send(kv) if hop < n - 1 else None  # next block's transfer first, then compute
            out, lse = on_schedule(n, hop, variant, partial(_fwd_pairs, c=c), out, lse, chunks(q.astype(wide)),
                                   kv.astype(wide))
            kv = incoming
        out, lse = jnp.concatenate(out, axis=2).astype(q.dtype), jnp.concatenate(lse, axis=2)  # (B, H, T/N, dh)
        return out, (q, k, v, out, lse)

    def core_bwd(res, dout):
        q, k, v, out, lse = res
        dt, wide = q.dtype, lse.dtype  # bf16 in: the gradients summed, and dK|dV sent, in float32
        q, out, dout = q.astype(wide), out.astype(wide), dout.astype(wide)
        c, delta = q.shape[2] // m, jnp.sum(dout * out, axis=-1)  # (B, H, T/N)
        # The barrier keeps XLA from CSE-ing this rotation with the forward one (same op on the same
        # K|V): merged, the step sends N−1 fewer messages per layer but keeps every received block
        # alive from forward to backward, the memory ring attention's backward exists to avoid
        # (XLA:CPU drops barriers before CSE: cpu_options).
        kv, dq = jnp.stack(lax.optimization_barrier((k, v))), [jnp.zeros_like(x) for x in chunks(q)]
        dkv = jnp.zeros(kv.shape, wide)  # (2, B, H, T/N, dh): dK|dV of the block held, travels with it
        for hop in range(n):
            incoming = send(kv) if hop < n - 1 else None
            dq, dkv = on_schedule(n, hop, variant, partial(_bwd_pairs, c=c), dq, dkv, chunks(q), kv.astype(wide),
                                  chunks(dout), chunks(lse), chunks(delta))
            dkv, kv = send(dkv) if n > 1 else dkv, incoming  # hop n−1: dK|dV arrive at their owner
        return jnp.concatenate(dq, axis=2).astype(dt), dkv[0].astype(dt), dkv[1].astype(dt)

    core.defvjp(core_fwd, core_bwd)
    return core



def attention(query, key, value, bias=None, mask=None, dropout_rate=0.0, deterministic=True, **_):
    """``attention_fn`` for ``nnx.MultiHeadAttention``: causal attention, over "cp" inside a cp step."""
    if bias is not None or mask is not None:
        raise SeamError("parallel.cp.attention is causal attention over the global positions; it takes no mask or "
                        "bias (the ring masks by position): call the attention without mask=")
    if dropout_rate and not deterministic:
        raise SeamError("parallel.cp.attention has no attention dropout: build the attention with dropout_rate=0")
    active = _ACTIVE.get()
    if active is None:
        return causal(query, key, value)
    variant, n, record = active
    record(key)
    if variant == "ulysses":  # (B, T/N, H, dh) -> (B, T, H/N, dh): all heads' sequence, H/N heads here
        if query.shape[2] % n:
            raise SeamError(f"ulysses splits heads: {query.shape[2]} heads over cp={n}; use ring or H % N == 0")
        to_heads = lambda x: lax.all_to_all(x, AXIS, 2, 1, tiled=True)
        out = causal(to_heads(query), to_heads(key), to_heads(value))  # (B, T, H/N, dh)
        return lax.all_to_all(out, AXIS, 1, 2, tiled=True)  # (B, T/N, H, dh)
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # (B, H, T/N, dh)
    return heads_first(ring_core(variant, n)(*map(heads_first, (query, key, value))))


def active() -> bool:
    """Whether a cp step is being traced (``attention`` then runs over "cp"): a model with attention of
    its own can keep that path bit for bit outside cp and call the seam inside (jax_impl/transformer.py)."""
    return _ACTIVE.get() is not None


@contextlib.contextmanager
def _active(variant: str, n: int, record: Callable):
    token = _ACTIVE.set((variant, n, record))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class Trainer:
    """``context_parallel``'s result: ``step(params, opt_state, *batch, positions)``, ``state``,
    ``train_step(*batch)`` (B, T) arrays -> mean loss, ``module()``, ``comm_theory()``."""

    def __init__(self, model, loss, tx, mesh, style, variant, clip=None, compute_dtype=None, loss_scale=None):
        self.style, self.variant, self.mesh, self.n, self.clip = style, variant, mesh, mesh.shape[AXIS], clip
        self.compute_dtype = compute_dtype
        self.scaler = scaling.resolve(loss_scale, compute_dtype, f"cp {variant}")
        self.per_step = ("skipped", "loss_scale") if self.scaler else ()  # the step's outputs after grads
        self.graphdef, state = nnx.split(model)
        leaves, self._treedef = jax.tree_util.tree_flatten_with_path(state)
        self.keys = [key_of(p) for p, _ in leaves]
        recipe.check(tx, {}, None, "cp", "")  # optax sees the whole replicated {path: array} dict: nothing to probe
        params = {k: jax.device_put(np.asarray(a), NamedSharding(mesh, P()))  # a host copy: the step donates it
                  for k, (_, a) in zip(self.keys, leaves)}
        self.state, self._loss, self._tx = (params, tx.init(params)), loss, tx
        if self.scaler:  # the scale state: a third state entry, replicated (parallel.scaling)
            self.state += (jax.device_put(self.scaler.init(), NamedSharding(mesh, P())),)
        self.calls: list[tuple[int, int]] | None = None  # per seam call at the last trace: (K elements, itemsize)
        step = self._step if self.scaler else lambda p, o, *batch: self._step(p, o, None, *batch)[:4]
        self.step = jax.jit(step, donate_argnums=tuple(range(len(self.state))))
        self._compiled = None

    def _merge(self, flat):
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self._treedef, [flat[k] for k in self.keys]))

    def _losses(self, params, *batch):
        """(differentiated, reported): shard_map — the mean of the (N,) local means, and the vector."""
        if self.style == "jit":
            value = self._loss(self._merge(recipe.cast(params, self.compute_dtype)), *batch)
            return value, value
        calls = []

        def local(params, *batch):
            if self.compute_dtype is not None:  # varying BEFORE the cast: the gradients' psum in the master dtype
                params = recipe.cast({k: lax.pcast(a, AXIS, to="varying") for k, a in params.items()},
                                     self.compute_dtype)
            with _active(self.variant, self.n, lambda k: calls.append((k.size, k.dtype.itemsize))):
                value = self._loss(self._merge(params), *batch)
            if not calls:
                raise SeamError("the model never called parallel.cp.attention: each device would attend within its own "
                                "T/N tokens. Build its attention with attention_fn=parallel.cp.attention")
            return value[None]
        seq = [P(None, AXIS)] * (len(batch) - 1)
        local_means = jax.shard_map(local, mesh=self.mesh, in_specs=(P(), *seq, P(AXIS)), out_specs=P(AXIS),
                                    check_vma=True)(params, *batch)
        self.calls = calls
        return jnp.mean(local_means), local_means

    def _step(self, params, opt_state, sc, *batch):
        """Scaling (``sc``): the loss times the scale, the gradients divided by it. They leave the shard_map
        whole and replicated (the transpose's all-reduce): the finite check is global as it stands."""
        mult = 1.0 if sc is None else sc["scale"]
        (_, loss), grads = jax.value_and_grad(lambda p, *b: (lambda v: (v[0] * mult, v[1]))(self._losses(p, *b)),
                                              has_aux=True)(params, *batch)
        if sc is not None:
            grads = self.scaler.unscale(grads, sc)
        clipped = grads if self.clip is None else recipe.scale_by_norm(grads, recipe.sumsq(grads), self.clip)
        updates, new_opt = self._tx.update(clipped, opt_state, params)
        new = optax.apply_updates(params, updates)
        if sc is None:
            return new, new_opt, loss, grads
        (new, new_opt), sc, bad = self.scaler.settle(sc, grads, (new, new_opt), (params, opt_state))
        return new, new_opt, sc, loss, grads, bad > 0, sc["scale"]

    def order(self, t: int) -> np.ndarray:
        """The sequence order whose contiguous T/N shards are each device's positions."""
        kind = "ring_zigzag" if self.variant == "ring_zigzag" else "ring"
        chunks = 2 * self.n if kind == "ring_zigzag" else self.n
        if t % chunks:
            raise WrapError(f"cp {self.variant}: sequence length {t} is not divisible by {chunks} "
                            f"({'2·' if kind == 'ring_zigzag' else ''}cp): pad the sequence or change cp")
        return np.concatenate([cp_positions(t, self.n, r, kind) for r in range(self.n)])

    def shard_batch(self, *arrays) -> tuple:
        """(B, T, …) arrays -> their sequence split over "cp" in the variant's order, + positions."""
        order = self.order(arrays[0].shape[1])
        seq = NamedSharding(self.mesh, P(None, AXIS))
        return (*(jax.device_put(jnp.asarray(a)[:, order], seq) for a in arrays),
                jax.device_put(jnp.asarray(order, jnp.int32), NamedSharding(self.mesh, P(AXIS))))

    def train_step(self, *batch) -> float:
        batch = self.shard_batch(*batch)
        if self._compiled is None:
            options = {"xla_disable_hlo_passes": "cse"} if self.variant.startswith("ring") and \
                self.mesh.devices.flat[0].platform == "cpu" else None  # cp.cpu_options: keep the backward hops
            self._compiled = self.step.lower(*self.state, *batch).compile(compiler_options=options)
        out = self._compiled(*self.state, *batch)
        *state, loss, _ = out[:len(out) - len(self.per_step)]
        self.state = tuple(state)
        return float(np.mean(fetch(loss)))

    def module(self):
        return self._merge(self.state[0])

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """op -> (count, bytes) per step per device from the seam calls the last trace saw, and Φ·b."""
        grads = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in self.state[0].values())
        out = {"all_reduce": (1, grads)}
        if self.style == "jit" or not self.calls:
            return out
        return out | seam_comm(self.calls, self.n, self.variant)


def context_parallel(model: nnx.Module, loss: Callable, tx: optax.GradientTransformation, mesh,
                     variant: str = "ring", style: str | None = None, *, clip: float | None = None,
                     compute_dtype=None, loss_scale=None) -> Trainer:
    """Context parallelism over ``mesh``'s "cp" axis for a model with the seam (module docstring).
    ``clip``: global-norm clipping, torch's formula (parallel.recipe); optax sees the whole tree.
    ``compute_dtype``: the loss sees every floating Param cast to it inside the step (master weights,
    their gradients, the gradient all-reduce and optax's state stay in the Params' dtype); float16 scales
    the loss (``loss_scale``, parallel.scaling: the gradients are whole, the skip agreed as it stands)."""
    recipe.check_clip(clip, "cp", tx)
    style = style or ("jit" if variant == "seq_sharded" else "shard_map")
    if (style, variant) not in VARIANTS:
        raise WrapError(f"cp: unknown style/variant {style}/{variant}; choose from {VARIANTS}")
    if AXIS not in mesh.shape:
        raise WrapError(f"the mesh has axes {tuple(mesh.shape)}, no {AXIS!r}: make one with axis name 'cp'")
    _, _, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise WrapError(f"{type(model).__name__} holds state other than nnx.Param: context_parallel trains Params "
                        "only; build it without BatchNorm / Dropout RNG state")
    mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return Trainer(model, loss, tx, mesh, style, variant, clip, compute_dtype, loss_scale)
