"""Expert parallelism (mixture of experts): routing-dependent all-to-alls, padding and state.

Papers: GShard, Lepikhin et al. 2020 (arXiv:2006.16668: dispatch/combine, capacity); Switch
Transformer, Fedus et al. 2021 (arXiv:2101.03961: top-k routing, balancing loss); Megatron-Core's
token dispatcher (dropless, uneven all-to-all). Quantities: experts per rank, the routed rows each
rank sends and receives, per op (count, bytes) of one step for the torch and JAX styles, the
capacity and padding of static-shape buffers, state per rank.
"""

from __future__ import annotations

import math

from shared.config import Config
from shared.theory.layout import Layout, Model
from shared.theory.mesh import state

# --- ep (expert parallelism, the MoE transformer) ----------------------------------------------
# E experts per MoE layer sharded over N = ep ranks: rank r owns experts [r·E/N, (r+1)·E/N) whole
# and routes B/N of the sequences (EP inside DP, as GShard and DeepSpeed-MoE lay it out): n = B·T/N
# tokens, k·n assignments per rank per layer. The traffic depends on the data: it is a function of
# the routing, which every run reports as ``extra["expert_load"]`` — (steps, L, B, E) counts:
# load[s][l][b][e] = tokens of sequence b that layer l sends to expert e at step s (each token
# counts once for each of its k experts, so every row sums to k·T). The formulas below take one
# step's (L, B, E) slice; pure Python, so nested lists and NumPy arrays both work.


def ep_experts_of(cfg: Config, rank: int) -> range:
    """The experts rank ``rank`` owns."""
    per = cfg.experts // cfg.world_size
    return range(rank * per, (rank + 1) * per)


def ep_owner(cfg: Config, expert: int) -> int:
    return expert // (cfg.experts // cfg.world_size)


def ep_matrix(cfg: Config, load_layer) -> list[list[int]]:
    """C[src][e]: assignments from rank src's tokens (sequences [src·B/N, (src+1)·B/N)) to expert e,
    for one layer: the matrix the counts exchange hands every rank."""
    rows = cfg.batch // cfg.world_size
    return [[sum(int(load_layer[b][e]) for b in range(src * rows, (src + 1) * rows)) for e in range(cfg.experts)]
            for src in range(cfg.world_size)]


def ep_rows(cfg: Config, load_layer, rank: int) -> tuple[int, int]:
    """(sent, received) token rows of rank ``rank``'s dispatch all-to-all in one layer (its own
    share included): sent = k·n always (dropless); received = Σ_src Σ_{e owned} C[src][e]."""
    c = ep_matrix(cfg, load_layer)
    mine = ep_experts_of(cfg, rank)
    return sum(c[rank]), sum(c[src][e] for src in range(cfg.world_size) for e in mine)


def ep_split_sizes(cfg: Config, load_layer, rank: int) -> tuple[list[int], list[int]]:
    """(input_split_sizes, output_split_sizes) of rank ``rank``'s dispatch ``all_to_all_single``:
    rows to each destination (its experts' assignments from my tokens), rows from each source."""
    c = ep_matrix(cfg, load_layer)
    n = cfg.world_size
    send = [sum(c[rank][e] for e in ep_experts_of(cfg, dst)) for dst in range(n)]
    recv = [sum(c[src][e] for e in ep_experts_of(cfg, rank)) for src in range(n)]
    return send, recv


def ep_load(cfg: Config, load_layer) -> dict[str, list[int]]:
    """One layer's load: assignments per expert (global), tokens each rank computes (received rows)."""
    c = ep_matrix(cfg, load_layer)
    per_expert = [sum(c[src][e] for src in range(cfg.world_size)) for e in range(cfg.experts)]
    per_rank = [sum(per_expert[e] for e in ep_experts_of(cfg, r)) for r in range(cfg.world_size)]
    return {"per_expert": per_expert, "per_rank": per_rank}


def ep_capacity(cfg: Config) -> int:
    """Rows of a static-shape (padded) buffer per (source rank, expert) that can never drop a token:
    every one of the n local tokens may pick the same expert (at most once: its k experts differ)."""
    return cfg.batch // cfg.world_size * cfg.seq


def ep_padding(cfg: Config, load) -> dict[str, float]:
    """Waste of the static-shape styles (capacity-padded all-to-alls, GShard's einsums) over one
    step's (L, B, E) load. Their buffer is E·C rows per rank per all-to-all (C = ep_capacity);
    k·n of them carry a token on the way out, whatever the routing: the padded all-to-alls move
    E/k times the rows a dropless one does (``sent_waste`` = 1 − k/E). ``max_received_rows``: the
    busiest rank's real rows in any layer (what a tighter, routing-aware capacity would need)."""
    n = cfg.batch // cfg.world_size * cfg.seq
    rows = cfg.experts * ep_capacity(cfg)
    busiest = max((ep_rows(cfg, layer, r)[1] for layer in load for r in range(cfg.world_size)), default=0)
    return {"buffer_rows": rows, "useful_rows": cfg.topk * n, "sent_waste": 1 - cfg.topk * n / rows,
            "max_received_rows": busiest}


def ep_replicated_params(cfg: Config) -> int:
    """Parameters every ep rank holds whole (embeddings, attention, norms, routers, head): their
    gradients are averaged over ep (one all-reduce); the experts' are not communicated."""
    return cfg.n_params - cfg.expert_params


# --- ep: torch styles ----------------------------------------------------------------------------
# torch explicit / builtin (torch_impl/ep.py), per MoE layer l and step, on rank r (n = B·T/N tokens,
# k·n assignments; sent_l = k·n, received_l = Σ_src Σ_{e of r} C_l[src][e], from ep_rows):
#   forward   all_gather of the (E,) int64 counts -> C (N, E)          N·E·8 bytes (the output)
#             dispatch all_to_all_single, input (sent_l, D)            sent_l·D·b
#             combine  all_to_all_single, input (received_l, D)       received_l·D·b
#   backward  combine's reverse: input dL/d(combined rows) (sent_l, D) sent_l·D·b
#             dispatch's reverse: input dL/d(received rows)           received_l·D·b
# then ONE all-reduce of the replicated gradients (ep_replicated_params·b); the experts' gradients
# stay where they are (scaled by 1/N). all-to-all bytes are the input buffer (nccl-tests' S).


def ep_micro_batches(cfg: Config, load_layer) -> list[tuple[Config, object]]:
    """--accumulate K: (the config of one micro-batch, its (B/K, E) slice of one layer's load) per micro-batch
    (micro-batch k: sequences [k·B/K, (k+1)·B/K), split over the ranks like a whole batch); K = 1: the batch."""
    k = cfg.accumulate
    if k == 1:
        return [(cfg, load_layer)]
    rows = cfg.batch // k
    part = cfg.replace(batch=rows, accumulate=1)
    return [(part, load_layer[i * rows:(i + 1) * rows]) for i in range(k)]


def ep_trained_replicated(cfg: Config) -> int:
    """Replicated parameters that train (not --freeze'd): what the gradient all-reduce carries."""
    from shared.problem import is_expert_param, param_shapes
    from shared.recipe import is_frozen

    return sum(math.prod(shape) for name, shape in param_shapes(cfg).items()
               if not is_expert_param(name) and not is_frozen(name, cfg.freeze))


def ep_comm_torch(cfg: Config, style: str, load_last_step, rank: int) -> dict[str, tuple[int, int]]:
    """{op: (count, bytes)} of one step on rank ``rank`` for torch's explicit and builtin styles
    (the same collectives: builtin swaps the hand-written Function for the functional one), from
    that step's (L, B, E) load. The recipe: --accumulate K repeats the counts' all-gather and the
    all-to-alls per micro-batch (on its own routing), the gradients still all-reduced once; --freeze
    drops the frozen replicated parameters from it; --clip adds one scalar all-reduce (the experts'
    squares). Mixed precision: the rows in the compute dtype, the gradients and the norm in float32."""
    if style not in ("explicit", "builtin"):
        raise ValueError(f"ep: no torch theory for style {style!r}")
    b, d, L, k = cfg.compute_bytes, cfg.dim, cfg.layers, cfg.accumulate
    rows = sum(sum(ep_rows(part, load, rank)) for l in range(L)  # Σ_l Σ_micro sent + received
               for part, load in ep_micro_batches(cfg, load_last_step[l]))
    grads = ep_trained_replicated(cfg) * cfg.bytes_per_element
    reduce = (int(grads > 0) + (cfg.clip is not None), grads + (cfg.clip is not None) * cfg.bytes_per_element)
    return {"all_gather": (k * L, k * L * cfg.world_size * cfg.experts * 8),
            "all_to_all": (4 * k * L, 2 * rows * d * b)} | ({"all_reduce": reduce} if reduce[0] else {})


def ep_comm_bytes_torch(cfg: Config, style: str, load_last_step, rank: int) -> int:
    return sum(nbytes for _, nbytes in ep_comm_torch(cfg, style, load_last_step, rank).values())


def ep_state_bytes_torch(cfg: Config) -> dict[str, int]:
    """Per rank: the replicated parameters whole + E/N experts of every layer; gradients the same;
    AdamW two moments of each (mesh.state on the ep layout: ep = dp = N, ZeRO-0, one dtype)."""
    return state(Model.from_config(cfg), Layout.from_config(cfg, "ep"), 0, cfg.bytes_per_element, "explicit", "pure")


# --- ep: JAX styles -----------------------------------------------------------------------------
# shard_map/capacity (jax_impl/ep.py): per MoE layer a psum of the (E,) int64 counts (the global f
# of the balancing loss; the split sizes are static), then all-to-alls of the capacity-padded
# (N, E/N, C, D) buffer, E·C·D·b with C = ep_capacity(cfg) = n, whatever the routing: dispatch and
# combine forward, their transposes backward: 4·L of them. Then the replicated gradients' all-
# reduce, ep_replicated_params·b (XLA's all-reduce combiner decides how many ops carry it, and may
# fold the counts' psums into them: compare the all-reduce BYTES, the all-to-all counts).


def ep_comm_jax(cfg: Config, style: str, load_last_step=None) -> dict[str, tuple[int | None, int]] | None:
    """{op: (count, bytes)} of one step per device; count None where XLA's combiner sets it.
    capacity: routing-independent (static buffers). gshard: None (XLA's choice, see
    jax_impl.ep.gshard_comm)."""
    if style == "jit":
        return None
    if style != "shard_map":
        raise ValueError(f"ep: no JAX theory for style {style!r}")
    b, L = cfg.bytes_per_element, cfg.layers
    buffer = cfg.experts * ep_capacity(cfg) * cfg.dim * b  # (N, E/N, C, D)
    return {"all_to_all": (4 * L, 4 * L * buffer),
            "all_reduce": (None, L * cfg.experts * 8 + ep_replicated_params(cfg) * b)}


def ep_state_bytes_jax(cfg: Config, style: str) -> dict[str, int]:
    """Per device (both styles): the replicated parameters whole + E/N experts per layer; gradients
    the same; AdamW's two moments of each (sharded like the parameters)."""
    held = (ep_replicated_params(cfg) + cfg.expert_params // cfg.world_size) * cfg.bytes_per_element
    return {"params": held, "grads": held, "optimizer": 2 * held}
