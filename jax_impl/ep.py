"""Expert parallelism (EP) in JAX, the runner: the MoE transformer's experts sharded over the mesh axis
"ep", tokens sent to their experts' owners by all-to-all.

Sharded: the E experts of every MoE layer, w_up / w_down P("ep", None, None) (device r: experts
[r·E/N, (r+1)·E/N), whole); the batch, P("ep"): n = B·T/N tokens per device (EP inside DP).
Embeddings, attention, norms, routers and the head are replicated, P().

    shard_map/capacity  static shapes: psum of the (E,) counts (the balancing loss's global f);
                        each assignment scattered into an (N, E/N, C, D) buffer, C = n (nothing
                        dropped); ONE all_to_all dispatches, the local experts run, ONE all_to_all
                        combines; autodiff transposes each: 4 all-to-alls per layer of E·C·D·b,
                        whatever the routing (the padding: shared.theory.ep_padding)
    shard_map/ragged    lax.ragged_all_to_all would send only the routed rows; XLA:CPU cannot run it
                        (RAGGED_REFUSAL), so ``variants`` leaves it out
    jit/gshard          GShard's dispatch / combine einsums with the experts P("ep"); XLA picks
                        the collectives (``gshard_comm``); top-k as a stable sort
    typed/gshard        the same einsums in types (jax_impl/ep_typed.py): two stated token moves
                        per layer (``typed_comm``)

The replicated gradients: summed over "ep" by the transpose of their invariant -> varying cast (an
all-reduce); an expert's gradient stays on its owner. Routing counts: extra["expert_load"].
The recipe (docs/recipe.md, ### Under ep): the batch placed as (K, B/K, T), micro-batch k (the reference's)
split on "ep", each with its own counts and balancing loss (jax_impl/recipe.micro_losses); --clip on the
global gradient tree; decay mask and frozen entries by fixture name. Mixed precision: the float32 tree cast
inside the loss (shard_map: the replicated weights made device-varying first), the buffers in bf16.
Bytes per step: shared.theory.ep_comm_jax; state per device: ep_state_bytes_jax.
Papers: Shazeer et al. 2017 (arXiv:1701.06538); GShard, Lepikhin et al. 2020 (arXiv:2006.16668);
Switch Transformer, Fedus et al. 2021 (arXiv:2101.03961); DeepSpeed-MoE, Rajbhandari et al. 2022.
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
from jax_impl.model import inputs, jax_dtype, targets
from jax_impl.parallel import ep as seam
from jax_impl.parallel.ep import AXIS, slots
from jax_impl.parallel.recipe import scale_by_norm, sumsq
from jax_impl.parallel.typed import InMesh, Stated, explicit_mesh
from jax_impl.transformer import Rules, apply_moe, combine, experts, wide
from shared.config import Config
from shared.problem import Problem, is_expert_param, param_names
from shared.recipe import is_frozen, refusal
from shared.results import Trained
from shared.theory import ep_capacity, ep_comm_jax, ep_padding, ep_replicated_params, ep_state_bytes_jax

VARIANTS = (("shard_map", "capacity"), ("jit", "gshard"), ("typed", "gshard"))
RAGGED_REFUSAL = ("shard_map/ragged: XLA:CPU cannot run lax.ragged_all_to_all (jax 0.10.2: "
                  "UNIMPLEMENTED: HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter)")


def variants(cfg: Config) -> tuple[tuple[str, str], ...]:
    """Every (style, variant) that runs here (ragged_all_to_all has no CPU lowering: RAGGED_REFUSAL), less those
    that cannot apply cfg's recipe exactly (shared.recipe.refusal: none today)."""
    return tuple(v for v in VARIANTS if refusal("jax", "ep", *v, cfg) is None)


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(cfg.world_size, AXIS, device)


def rules(cfg: Config) -> Rules:
    """(name, shape) -> mesh axes: the stacked experts on "ep" (dim 0), everything else replicated."""
    return lambda name, shape: ((AXIS,) if is_expert_param(name) else (None,)) + (None,) * (len(shape) - 1)


# --- shard_map/capacity: the dispatch written out ----------------------------------------------------


def capacity_dispatch(cfg: Config):
    """The ``dispatch`` seam of jax_impl.transformer.moe for one shard_map device: the library's
    ``parallel.ep.dispatch`` (the (E, C, D) buffer, C = n, ONE all_to_all each way), one expert at a time."""
    c = ep_capacity(cfg)
    one = lambda w, rows: experts(w["w_up"][None], w["w_down"][None], rows[None])[0]  # (R, D) through one expert

    def dispatch(h, top, gates, w_up, w_down):  # h (n, D); top, gates (n, k); w_* (E/N, …) mine
        assert h.shape[0] == c and w_up.shape[1:] == (h.shape[1], 4 * h.shape[1]), (h.shape, w_up.shape)
        return combine(gates, seam.dispatch(one, {"w_up": w_up, "w_down": w_down}, h, top))  # (n, D)
    return dispatch


def shard_map_loss(cfg: Config, mesh, specs: dict):
    """loss(params, tokens, targets) -> ((N,) local losses, load (L, K, B/K, E)); tokens (K, B/K, T)."""
    part = recipe.micro(cfg)
    dispatch, total = capacity_dispatch(part), lambda counts: lax.psum(counts, AXIS)  # (E,) int64
    forward = lambda p, tokens: apply_moe(p, tokens, cfg.head_dim, cfg.topk, dispatch, total)  # noqa: E731

    def local(params, tokens, y):
        assert tokens.shape == y.shape == (cfg.accumulate, part.batch // cfg.world_size, cfg.seq), tokens.shape
        if cfg.precision == "mixed":  # the replicated float32 weights made device-varying, THEN cast (cp's way):
            params = {n: a if is_expert_param(n) else lax.pcast(a, AXIS, to="varying")  # their psum in float32
                      for n, a in params.items()}
        loss, load = recipe.micro_losses(cfg, forward, params, tokens, y)
        return loss[None], load  # (1,), (L, K, B/(K·N), E)

    return jax.shard_map(local, mesh=mesh, in_specs=(specs, P(None, AXIS), P(None, AXIS)),
                         out_specs=(P(AXIS), P(None, None, AXIS)), check_vma=True)


# --- jit/gshard: dispatch and combine as einsums, XLA picks the collectives ---------------------------


def gshard_dispatch(cfg: Config, mesh):
    """The ``dispatch`` seam over the GLOBAL tokens (B·T, D), GShard's einsums."""
    g, c = cfg.world_size, ep_capacity(cfg)  # groups = devices; S = C = n tokens per group
    pin = lambda x, *spec: lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    def dispatch(h, top, gates, w_up, w_down):  # h (B·T, D); top, gates (B·T, k); w_* (E, …) P("ep")
        (bt, d), k, e = h.shape, top.shape[1], w_up.shape[0]
        h, top, gates = h.reshape(g, c, d), top.reshape(g, c, k), gates.reshape(g, c, k)  # S = C
        expert, pos = slots(top, e)  # (G, S·k) each
        mask = (jax.nn.one_hot(expert, e, dtype=h.dtype)[..., None]
                * jax.nn.one_hot(pos, c, dtype=h.dtype)[..., None, :]).reshape(g, c, k, e, c)  # (G, S, k, E, C)
        dispatch_mask = jnp.sum(mask, axis=2)  # (G, S, E, C): 0/1, k ones per token
        combine_w = jnp.einsum("gskec,gsk->gsec", mask, gates)  # (G, S, E, C)
        x = pin(jnp.einsum("gsec,gsd->egcd", dispatch_mask, pin(h, AXIS)), AXIS)  # (E, G, C, D) on E
        y = experts(w_up, w_down, x.reshape(e, g * c, d)).reshape(e, g, c, d)  # (E, G, C, D)
        # 16-bit: in float32, rounded once (transformer.combine's k products and sum: the zeros add nothing)
        out = jnp.einsum("gsec,egcd->gsd", wide(combine_w), wide(pin(y, AXIS))).astype(y.dtype)
        return pin(out, AXIS).reshape(bt, d)  # (B·T, D)
    return dispatch


def sorted_top_k(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k`` as a stable descending sort: the same answer (equal probs: the lower index
    first). XLA's SPMD partitioner all-gathers top_k's operand even when only its batch dim is
    sharded (measured: one (B·T, E) all-gather per layer), while it keeps a sort's batch dim split."""
    ids = jnp.broadcast_to(jnp.arange(probs.shape[-1]), probs.shape)  # (n, E)
    neg, idx = lax.sort((-probs, ids), dimension=probs.ndim - 1, num_keys=1, is_stable=True)
    return -neg[..., :k], idx[..., :k]  # (n, k) each


def gshard_loss(cfg: Config, mesh):
    """loss(params, tokens, targets) -> (loss, load (L, K, B/K, E)); tokens (K, B/K, T)."""
    dispatch = gshard_dispatch(recipe.micro(cfg), mesh)
    pin = lambda x: lax.with_sharding_constraint(x, NamedSharding(mesh, P(AXIS)))  # the batch on "ep"
    forward = lambda p, tokens: apply_moe(p, tokens, cfg.head_dim, cfg.topk, dispatch, pin=pin,  # noqa: E731
                                          select=sorted_top_k)
    return lambda params, tokens, y: recipe.micro_losses(cfg, forward, params, tokens, y)


def gshard_comm(cfg: Config, platform: str = "cpu") -> dict[str, tuple[int | None, int]]:
    """What XLA (GSPMD, CPU) issued for jit/gshard, measured (not a design) at E = 4 and 8, D = 16
    and 32, ep = 2 and 4, k = 1 and 2. a = E·C·D·b: one device's shard of the (E, G, C, D) expert
    buffer (= the capacity style's all-to-all). Forward per layer: 2 all-to-alls of a (the dispatch
    and combine einsums' resharding G -> E -> G). Backward per layer: their 2 transposes (a each),
    and the combine weights' gradient (G, S, E, C) = Σ_d dout·y computed next to the experts'
    outputs: an all-gather of the output gradient (G, S, D), B·T·D·b, then an all-to-all of its
    E·S·C·b shard back to the groups. One all-reduce payload: the replicated gradients, the (E,)
    int64 counts and (E,) mean probs of every layer (XLA defers them to the end of the forward)
    and the CE's scalar sum (count: XLA's combiner).
    ``platform``: these are XLA:CPU's choices. XLA:GPU combines independent collectives (up to 30 MiB)
    and runs ReduceScatterCreator / AllReduceReassociate, so on "cuda" neither the counts nor the
    kinds are kept: one entry, ``"any": (None, the same total bytes)``, and the verdict compares bytes
    (not yet measured on a GPU: docs/gpu.md)."""
    b, L, e, c = cfg.bytes_per_element, cfg.layers, cfg.experts, ep_capacity(cfg)
    a = e * c * cfg.dim * b
    cpu = {"all_to_all": (5 * L, L * (4 * a + e * c * c * b)),
           "all_gather": (L, L * cfg.batch * cfg.seq * cfg.dim * b),
           "all_reduce": (None, ep_replicated_params(cfg) * b + L * e * (8 + b) + b)}
    return cpu if platform == "cpu" else {"any": (None, sum(nbytes for _, nbytes in cpu.values()))}


def typed_comm(cfg, platform: str = "cpu") -> dict[str, tuple[int | None, int]]:
    """What XLA:CPU issued for typed/gshard, measured at ep = 2 and 4, k = 1 and 2 (not a design),
    a = E·C·D·b as in gshard_comm: per layer the two stated all-to-alls and their two transposes
    (4a), the top_k operand's all-gather ((B·T, E) probs); one all-reduce payload as jit's. Against
    jit/gshard: no fifth all-to-all and no all-gather of the (B·T, D) output gradient — the combine
    einsum runs on the group side (y resharded back first), so its weights' gradient is local.
    Other platforms: one entry, "any": (None, the same total bytes), as gshard_comm."""
    b, L, e, c = cfg.bytes_per_element, cfg.layers, cfg.experts, ep_capacity(cfg)
    cpu = {"all_to_all": (4 * L, 4 * L * e * c * cfg.dim * b),
           "all_gather": (L, L * cfg.batch * cfg.seq * e * b),
           "all_reduce": gshard_comm(cfg)["all_reduce"]}
    return cpu if platform == "cpu" else {"any": (None, sum(nbytes for _, nbytes in cpu.values()))}


# --- the step -----------------------------------------------------------------------------------------


def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    if (style, variant) not in VARIANTS:
        raise ValueError(f"ep: unknown style/variant {style}/{variant}; choose from {VARIANTS}"
                         + (f" ({RAGGED_REFUSAL})" if variant == "ragged" else ""))
    cfg.check("ep", "jax")
    if mesh.shape[AXIS] != cfg.world_size:
        raise ValueError(f"mesh has ep={mesh.shape[AXIS]} devices, cfg.world_size={cfg.world_size}")
    from jax_impl import ep_typed

    typed = style == "typed"  # sharding in types: an Explicit-axes copy of the mesh (jax_impl/ep_typed.py)
    if typed:
        mesh = explicit_mesh(mesh)
        stated = Stated(mesh)
    names, rule = param_names(cfg), rules(cfg)
    specs = {k: P(*rule(k, w.shape)) for k, w in problem.params.items()}
    params = {k: jax.device_put(jnp.asarray(w, jax_dtype(cfg)), NamedSharding(mesh, specs[k]))
              for k, w in problem.params.items()}
    rows, k = NamedSharding(mesh, P(None, AXIS)), cfg.accumulate  # (K, B/K, T): micro-batch k's rows split on ep
    batch = tuple(jax.device_put(a.reshape(k, cfg.batch // k, cfg.seq), rows)
                  for a in (inputs(cfg, problem), targets(cfg, problem)))
    tx = recipe.optimizer(cfg, {n: n for n in names})  # the recipe (jax_impl/recipe.py): schedule, decay mask
    frozen = lambda p: {n: lax.stop_gradient(a) if is_frozen(n, cfg.freeze) else a for n, a in p.items()}  # noqa: E731
    if style == "shard_map":  # differentiate the mean of the (N,) local losses, report the vector
        to_loss = shard_map_loss(cfg, mesh, specs)
        loss_of = lambda p, *b: (lambda v, load: (jnp.mean(v), (v, load)))(*to_loss(frozen(p), *b))
    else:
        to_loss = ep_typed.loss_for(cfg, stated) if typed else gshard_loss(cfg, mesh)
        loss_of = lambda p, *b: (lambda v, load: (v, (v, load)))(*to_loss(frozen(p), *b))

    def step(params, opt_state, *batch):
        (_, (loss, load)), grads = jax.value_and_grad(loss_of, has_aux=True)(params, *batch)
        # --clip: the global norm of the whole gradient (the experts' leaves sharded: XLA sums their squares)
        clipped = grads if cfg.clip is None else scale_by_norm(grads, sumsq(grads), cfg.clip)
        updates, opt_state = tx.update(clipped, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads, load  # load (L, K, B/K, E)

    fixture = partial(leaves_fixture, names=names)
    wire = wire_config(cfg, mesh)  # mixed precision: XLA:CPU moves the bf16 rows in float32
    theory = ep_comm_jax(wire, style) if style == "shard_map" else typed_comm(wire, xla_platform(mesh)) \
        if typed else gshard_comm(wire, xla_platform(mesh))
    jitted = jax.jit(stated.traced(step) if typed else step, donate_argnums=(0, 1))
    trained = train_loop(cfg, Setup(
        step=InMesh(jitted, mesh) if typed else jitted, state=(params, tx.init(params)), batch=batch,
        grads_fixture=fixture, params_fixture=lambda state: fixture(state[0]),
        comm_theory=None if theory is None or cfg.recipe_active else  # the recipe's: not modelled (docs/recipe.md)
        sum(nbytes for _, nbytes in theory.values()),
        per_step=("expert_load",),
        extra={"capacity": ep_capacity(recipe.micro(cfg))} | ({"stated": stated.entries} if typed else {})))
    load = trained.extra["expert_load"].astype(np.int64)  # (steps, L, K, B/K, E): micro-batches in batch order
    load = trained.extra["expert_load"] = load.reshape(*load.shape[:2], cfg.batch, cfg.experts)  # (steps, L, B, E)
    # both styles move E·C rows per device, layer and micro-batch (C: a micro-batch's n); the last one's routing
    trained.extra["padding"] = ep_padding(recipe.micro(cfg), load[-1][:, cfg.batch - recipe.micro(cfg).batch:])
    if not cfg.recipe_active:  # --schedule, --decay-mask: optax's own counters and masks beside the moments
        assert trained.state_bytes == ep_state_bytes_jax(cfg, style), trained.state_bytes
    return trained
