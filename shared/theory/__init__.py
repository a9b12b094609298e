"""The formulas every run is checked against, one module per pattern (beside torch_impl/X.py and
jax_impl/X.py), and what ``compare.py plan`` evaluates at full size:

    collectives  bus bandwidth factors, α–β fit          dp         DP, ZeRO-1; AdamW state per rank
    fsdp         ZeRO-2/3, FSDP2: units, gathers         tp         Megatron TP, sequence parallelism
    pp           messages, bubble, stages, in-flight     cp         ring, zigzag, Ulysses
    ep           routing-dependent all-to-alls           mesh       N-D layouts, per mesh axis
    recompute    activations saved, recompute FLOPs        layout     Model and Layout at any size

Units: payload bytes per training step per rank, counting each collective as nccl-tests' size S
(all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the input;
send/recv: the message). Φ = parameter count, b = bytes per element, N = ranks.

Bus bandwidth (nccl-tests, PERFORMANCE.md): busbw = algbw · factor, with
all-reduce 2(N−1)/N, all-gather / reduce-scatter / all-to-all / gather / scatter (N−1)/N,
broadcast / reduce / sendrecv 1.

Every name is importable from here (``from shared.theory import dp_comm_bytes``) and from its module.
"""

from shared.theory.collectives import (  # noqa: F401
    BUSBW_FACTOR,
    busbw,
    fit_alpha_beta,
)
from shared.theory.cp import (  # noqa: F401
    cp_attention_scores,
    cp_chunks,
    cp_comm,
    cp_comm_bytes,
    cp_positions,
)
from shared.theory.dp import (  # noqa: F401
    adam_state_bytes,
    dp_comm_bytes,
    zero1_comm_bytes,
    zero_state,
)
from shared.theory.ep import (  # noqa: F401
    ep_capacity,
    ep_comm_bytes_torch,
    ep_comm_jax,
    ep_comm_torch,
    ep_experts_of,
    ep_load,
    ep_matrix,
    ep_owner,
    ep_padding,
    ep_replicated_params,
    ep_rows,
    ep_split_sizes,
    ep_state_bytes_jax,
    ep_state_bytes_torch,
)
from shared.theory.fsdp import (  # noqa: F401
    fsdp_comm,
    fsdp_comm_bytes,
    fsdp_regathered,
    fsdp_state_bytes,
    fsdp_units,
    zero2_comm,
    zero2_comm_bytes,
    zero3_comm,
    zero3_comm_bytes,
)
from shared.theory.layout import (  # noqa: F401
    Layout,
    Model,
)
from shared.theory.mesh import (  # noqa: F401
    fsdp2_pipeline_gathers,
    mesh_comm_bytes_torch,
    mesh_comm_jax,
    mesh_comm_torch,
    mesh_coords,
    mesh_grad_axes,
    mesh_micro,
    mesh_moe_comm_torch,
    mesh_stage_param_count,
    mesh_state_bytes_jax,
    mesh_state_bytes_torch,
    mesh_units_jax,
)
from shared.theory.pp import (  # noqa: F401
    in_flight,
    pp_1f1b_permute_bytes,
    pp_1f1b_permute_count,
    pp_activation_elements,
    pp_bubble_fraction,
    pp_circular_permute_bytes,
    pp_circular_permute_count,
    pp_p2p_bytes,
    pp_p2p_bytes_per_rank,
    pp_p2p_count_per_rank,
    pp_peak_activations,
    pp_spmd_param_count,
    pp_stage_param_count,
    pp_state_bytes,
    pp_ticks_permute_bytes,
    pp_ticks_permute_count,
)
from shared.theory.recompute import (  # noqa: F401
    activation_bytes,
    activation_elements,
    activations,
    block_saved_elements,
    recompute_extra_flops,
)
from shared.theory.tp import (  # noqa: F401
    tp_allgather_comm,
    tp_comm,
    tp_comm_bytes,
    tp_megatron_comm,
    tp_sp_activation_saving,
    tp_sp_comm,
    tp_state_bytes,
    tp_transformer_comm,
    tp_transformer_state_bytes,
)
