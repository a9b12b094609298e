"""Context parallelism (CP) in JAX, the runner: the sequence is split over the mesh axis "cp" for the
whole model.

Sharded: tokens, targets and their global positions, P(None, "cp") / P("cp") (layout
``shared.theory.cp_positions``: ring / ulysses T/N consecutive tokens; ring_zigzag chunks r and
2N−1−r of 2N, permuted on the host). Every weight is replicated, P(). Only attention needs other
devices' keys and values. a = B·(T/N)·D·b: one device's share of K (or Q, V, the stream).

    shard_map/ring         a custom_vjp ring: K|V hop N−1 times (ppermute), merged by an online
                           softmax; backward: K|V rotate again and dK|dV travel home:
                           L·(3N−2) collective-permutes of 2a per step
    shard_map/ring_zigzag  the same ring over the load-balanced layout: causal work even
    shard_map/ulysses      3 all-to-alls sequence -> heads, attention for H/N heads, 1 back;
                           autodiff transposes them: 8·L all-to-alls of a per step
    typed/seq_sharded, typed/ulysses  the layouts as types (jax_impl/cp_typed.py): stated reshards
    jit/seq_sharded        the plain loss with the sequence split; XLA (GSPMD) picks attention's
                           collectives (the ledger and ``seq_sharded_comm`` say which)

The replicated weights' gradients: summed over "cp" by the transpose of their invariant -> varying
cast, an all-reduce of Φ·b. Bytes per step: shared.theory.cp_comm.
Mixed precision (--precision mixed): the float32 weights made device-varying, then cast to bf16 inside
the loss (their all-reduce stays float32); K, V, Q and the stream travel in bf16; attention, the ring's
accumulators and its travelling dK|dV in float32; the logits to the loss in float32. float16: the same,
with dynamic loss scaling (parallel/scaling.py); the gradients are whole on every device, so the skip
is agreed without a collective.
Papers: ring attention, Liu et al. 2023 (arXiv:2310.01889); striped/zigzag, Brandon et al. 2023;
DeepSpeed-Ulysses, Jacobs et al. 2023 (arXiv:2309.14509).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl import recipe
from jax_impl.devices import make_mesh, wire_config, xla_platform
from jax_impl.harness import Setup, leaves_fixture, train_loop
from jax_impl.model import inputs, jax_dtype, output_loss, targets, to_compute, to_loss
from jax_impl.parallel.cp import AXIS, chunk_pairs, ring_core
from jax_impl.parallel.recipe import scale_by_norm, sumsq
from jax_impl.parallel.scaling import keep, nonfinite
from jax_impl.parallel.typed import InMesh, Stated, explicit_mesh
from jax_impl.transformer import apply, attention, block, embed, head
from shared.config import Config
from shared.problem import Problem, param_names
from shared.results import Trained
from shared.theory import cp_attention_scores, cp_chunks, cp_comm_bytes, cp_positions

VARIANTS = (("shard_map", "ring"), ("shard_map", "ring_zigzag"), ("shard_map", "ulysses"), ("jit", "seq_sharded"),
            ("typed", "seq_sharded"), ("typed", "ulysses"))


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(cfg.world_size, AXIS, device)


def positions(cfg: Config, variant: str) -> list[list[int]]:
    """Per device, the global positions it holds (ulysses and seq_sharded: contiguous, as ring)."""
    kind = "ring_zigzag" if variant == "ring_zigzag" else "ring"
    return [cp_positions(cfg.seq, cfg.world_size, r, kind) for r in range(cfg.world_size)]


def attention_scores(cfg: Config, variant: str) -> list[int]:
    """Score entries each device computes per layer in forward (summed over batch and heads)."""
    n, bh = cfg.world_size, cfg.batch * cfg.heads
    if variant == "ulysses":
        return [bh * cfg.seq * cfg.seq // n] * n  # the whole (masked) T × T for H/N heads
    c = cfg.seq // (n * len(cp_chunks(n, 0, variant)))  # tokens per chunk
    return [bh * c * c * sum(len(chunk_pairs(n, r, hop, variant)) for hop in range(n)) for r in range(n)]


def ring_attention(variant: str, n: int):
    """attn(qkv, head_dim) for the transformer's seam: the ring written out, Python-unrolled."""
    core = ring_core(variant, n)

    def attn(qkv, head_dim: int):
        b, t, _ = qkv.shape  # (B, T/N, 3D)
        q, k, v = (a.reshape(b, t, -1, head_dim).transpose(0, 2, 1, 3) for a in jnp.split(qkv, 3, axis=-1))
        return core(q, k, v).transpose(0, 2, 1, 3).reshape(b, t, -1)  # (B, T/N, D)
    return attn


def ulysses_attention(qkv, head_dim: int):
    """(B, T/N, 3D) -> all-to-all to head-sharded (B, T, H/N, dh), causal attention, and back."""
    b, t, _ = qkv.shape
    to_heads = lambda x: lax.all_to_all(x.reshape(b, t, -1, head_dim), AXIS, 2, 1, tiled=True)  # (B, T, H/N, dh)
    q, k, v = (to_heads(a) for a in jnp.split(qkv, 3, axis=-1))
    n = lax.axis_size(AXIS)
    assert q.shape == (b, t * n, qkv.shape[-1] // 3 // head_dim // n, head_dim), q.shape
    y = attention(jnp.concatenate([a.reshape(b, t * n, -1) for a in (q, k, v)], -1), head_dim)  # (B, T, D/N)
    y = lax.all_to_all(y.reshape(b, t * n, -1, head_dim), AXIS, 1, 2, tiled=True)  # (B, T/N, H, dh)
    return y.reshape(b, t, -1)


def cpu_options(mesh, variant: str) -> dict | None:
    """XLA:CPU drops optimization barriers (cse_barrier_expander) before its last CSE pass, which
    then merges the backward K|V rotation into the forward one (measured: L·(2N−1) permutes instead
    of L·(3N−2), the received blocks kept from forward to backward); as jax_impl.fsdp.cpu_options
    does for ZeRO-3's re-gathers, the ring steps compile without CSE on CPU. GPU / TPU keep the barrier."""
    if mesh.devices.flat[0].platform != "cpu" or variant not in ("ring", "ring_zigzag"):
        return None
    return {"xla_disable_hlo_passes": "cse"}


def seq_sharded_comm(cfg: Config, platform: str = "cpu") -> dict[str, tuple[int | None, int]]:
    """What XLA (GSPMD) issued for jit/seq_sharded, measured at cp = 2 and 4 (not a design): per
    layer forward all-gathers of K and V along the sequence, each output (B, T, H, dh): 2L of
    B·T·D·b; backward, every device's partial dK and dV over the WHOLE sequence all-reduced (no
    reduce-scatter): 2L·B·T·D·b, in the same combined all-reduces as the gradients (Φ·b) and the
    scalar loss (b). Each device scores its T/N queries against all T keys, masked: B·H·T²/N.
    ``platform``: these are XLA:CPU's choices. XLA:GPU combines independent collectives (up to 30 MiB)
    and runs ReduceScatterCreator / AllReduceReassociate, so on "cuda" neither the counts nor the
    kinds are kept: one entry, ``"any": (None, the same total bytes)``, and the verdict compares bytes
    (not yet measured on a GPU: docs/gpu.md)."""
    act, b = cfg.batch * cfg.seq * cfg.dim * cfg.compute_bytes, cfg.bytes_per_element  # K, V: the compute dtype
    cpu = {"all_gather": (2 * cfg.layers, 2 * cfg.layers * act),
           "all_reduce": (None, cfg.n_params * b + 2 * cfg.layers * act + b)}  # count: XLA's combiner
    return cpu if platform == "cpu" else {"any": (None, sum(nbytes for _, nbytes in cpu.values()))}


# --- the losses -------------------------------------------------------------------------------------


def shard_map_loss(cfg: Config, variant: str, mesh):
    """loss(params, tokens, targets, positions) -> (N,) local mean cross-entropies. Mixed precision:
    the replicated float32 weights made device-varying, THEN cast to bf16 (model.to_compute), so the
    transpose's gradient psum runs in float32; the logits go to the loss in float32."""
    attn = ulysses_attention if variant == "ulysses" else ring_attention(variant, cfg.world_size)
    mixed = cfg.precision == "mixed"

    def local(params, tokens, y, pos):
        # (B/K, T/N): --accumulate K hands it one group of whole sequences
        assert tokens.shape == y.shape == (cfg.batch // cfg.accumulate, cfg.seq // cfg.world_size), tokens.shape
        if mixed:
            params = to_compute(cfg, jax.tree.map(lambda a: lax.pcast(a, AXIS, to="varying"), params))
        logits = apply(params, tokens, cfg.head_dim, pos, attn=attn)  # (B, T/N, V)
        return output_loss(to_loss(cfg, logits), y)[None]

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, AXIS), P(None, AXIS), P(AXIS)),
                         out_specs=P(AXIS), check_vma=True)


def seq_sharded_loss(cfg: Config, mesh):
    """The single-device loss, the residual stream pinned to P(None, "cp", None)."""
    pin = lambda x: lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, AXIS, None)))

    def loss(params, tokens, y, pos):
        params = to_compute(cfg, params)  # mixed precision: bf16 inside the loss
        x = pin(embed(params, tokens, pos))  # (B, T, D), T split
        for l in range(cfg.layers):
            x = pin(block(params, l, x, cfg.head_dim))
        return output_loss(to_loss(cfg, head(params, x)), y)
    return loss


def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    from jax_impl import cp_typed

    if (style, variant) not in VARIANTS:
        raise ValueError(f"cp: unknown style/variant {style}/{variant}; choose from {VARIANTS}")
    cfg.check("cp", "jax")
    if mesh.shape[AXIS] != cfg.world_size:
        raise ValueError(f"mesh has cp={mesh.shape[AXIS]} devices, cfg.world_size={cfg.world_size}")
    typed = style == "typed"  # sharding in types: an Explicit-axes copy of the mesh (jax_impl/cp_typed.py)
    if typed:
        mesh, stated = explicit_mesh(mesh), Stated(explicit_mesh(mesh))
    names, order = param_names(cfg), np.concatenate(positions(cfg, variant))  # (T,): shard r = device r's tokens
    params = {k: jax.device_put(jnp.asarray(w, jax_dtype(cfg)), NamedSharding(mesh, P()))
              for k, w in problem.params.items()}
    seq = NamedSharding(mesh, P(None, AXIS))
    batch = (jax.device_put(inputs(cfg, problem)[:, order], seq), jax.device_put(targets(cfg, problem)[:, order], seq),
             jax.device_put(jnp.asarray(order, jnp.int32), NamedSharding(mesh, P(AXIS))))
    tx = recipe.optimizer(cfg, {k: k for k in names})  # the recipe (jax_impl/recipe.py): keyed by fixture names
    # (differentiated, reported): shard_map differentiates the mean of the local losses and reports
    # the (N,) vector (the mean itself is never computed: no all-reduce); jit its global mean
    to_loss = cp_typed.loss_for(cfg, stated, variant) if typed else seq_sharded_loss(cfg, mesh) if style == "jit" else \
        shard_map_loss(cfg, variant, mesh)
    loss_of = recipe.dict_loss(cfg, lambda p, *b: (lambda v: (jnp.mean(v), v))(to_loss(p, *b)))

    scaler = recipe.loss_scale(cfg)  # float16: dynamic loss scaling (jax_impl/parallel/scaling.py)

    def step(params, opt_state, *rest):
        sc, batch = (rest[0], rest[1:]) if scaler else (None, rest)
        mult = 1.0 if sc is None else sc["scale"]
        (_, loss), grads = jax.value_and_grad(lambda p, *b: (lambda v: (v[0] * mult, v[1]))(loss_of(p, *b)),
                                              has_aux=True)(params, *batch)
        grads = grads if sc is None else scaler.unscale(grads, sc)
        clipped = grads if cfg.clip is None else scale_by_norm(grads, sumsq(grads), cfg.clip)  # replicated: whole
        updates, new_opt = tx.update(clipped, opt_state, params)
        new = optax.apply_updates(params, updates)
        if sc is None:
            return new, new_opt, loss, grads
        bad = nonfinite(grads)  # the gradients are whole and replicated (summed over "cp"): agreed as they stand
        new, new_opt = keep(bad, (new, new_opt), (params, opt_state))
        sc = scaler.update(sc, bad)
        return new, new_opt, sc, loss, grads, bad > 0, sc["scale"]

    fixture = partial(leaves_fixture, names=names)
    extra = {"positions": positions(cfg, variant)} | ({"stated": stated.entries} if typed else {})
    if style == "shard_map":
        extra["attention_scores"] = attention_scores(cfg, variant)
        assert extra["attention_scores"] == cp_attention_scores(cfg, variant), extra["attention_scores"]
    wire = wire_config(cfg, mesh)  # mixed precision: bf16 activations (XLA:CPU sends them in float32)
    state = (params, tx.init(params)) + ((jax.device_put(scaler.init(), NamedSharding(mesh, P())),) if scaler else ())
    donate = tuple(range(len(state)))
    return train_loop(cfg, Setup(
        step=InMesh(jax.jit(stated.traced(step), donate_argnums=donate), mesh) if typed else
        jax.jit(step, donate_argnums=donate), state=state, batch=batch,
        per_step=("skipped", "loss_scale") if scaler else (),
        grads_fixture=fixture, params_fixture=lambda state: fixture(state[0]),
        comm_theory=None if cfg.freeze or cfg.accumulate > 1 else  # the recipe's: not modelled (docs/recipe.md)
        cp_comm_bytes(wire, variant) + typed * wire.bytes_per_element  # typed: + the loss's all-reduce
        if style == "shard_map" or variant == "ulysses" else
        sum(nbytes for _, nbytes in seq_sharded_comm(wire, xla_platform(mesh)).values()), extra=extra,
        compiler_options=cpu_options(mesh, variant)))
