"""For a machine whose torch is older than the project's 2.13 (a lent GPU image held 2.11): torch 2.13's
``all_gather_single`` / ``reduce_scatter_single`` under their 2.11 names (``all_gather_into_tensor`` /
``reduce_scatter_tensor``, same arguments). scripts/gpu_check.sh puts this folder on PYTHONPATH only when torch
lacks them; Python imports it at start-up. Nothing else differs for the GPU checks."""

try:
    import torch.distributed as dist

    if not hasattr(dist, "all_gather_single"):
        dist.all_gather_single = dist.all_gather_into_tensor
    if not hasattr(dist, "reduce_scatter_single"):
        dist.reduce_scatter_single = dist.reduce_scatter_tensor
except ImportError:
    pass
