"""The shared MLP as an ``nn.Module`` (needed by DDP, FSDP2, DTensor and pipelining).

``Block`` is ``gelu(Linear(x))`` with exact (erf) GELU and no bias. torch's ``nn.Linear``
stores ``weight`` as (out, in) and computes ``x @ weight.T``, so ``linear.weight == W_l.T``
for the fixture weight W_l (see shared/dims.py). ``fixture_*`` convert back.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.config import Config
from shared.problem import Problem

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def torch_dtype(cfg: Config) -> torch.dtype:
    return TORCH_DTYPES[cfg.dtype]


class Block(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.linear = nn.Linear(dim, dim, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(x), approximate="none")  # (B, D)


class MLP(nn.Module):
    def __init__(self, layers: int, dim: int, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, dtype, device) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def build_model(cfg: Config, problem: Problem, device="cpu") -> MLP:
    """The MLP holding the fixture weights (cast to the run's dtype)."""
    model = MLP(cfg.layers, cfg.dim, torch_dtype(cfg), device)
    with torch.no_grad():
        for block, w in zip(model.layers, problem.weights):
            block.linear.weight.copy_(torch.from_numpy(w.T.copy()))
    return model


def inputs(cfg: Config, problem: Problem, device="cpu") -> torch.Tensor:
    # torch.tensor copies: the fixture's NumPy array is never aliased (an in-place op would change it).
    return torch.tensor(problem.inputs, device=device, dtype=torch_dtype(cfg))  # (B, D)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def make_optimizer(params, cfg: Config) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy().copy()


def fixture_weights(model: MLP) -> list[np.ndarray]:
    """Full weights in the fixture orientation W_l (float64)."""
    return [to_numpy(b.linear.weight).T.copy() for b in model.layers]


def fixture_grads(model: MLP) -> list[np.ndarray]:
    return [to_numpy(b.linear.weight.grad).T.copy() for b in model.layers]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (DTensor.numel() is the global size); plain tensors as is."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors) -> int:
    """Bytes this rank holds for ``tensors`` (local shards of DTensors)."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of tensor state the optimizer holds on this rank (AdamW: exp_avg, exp_avg_sq)."""
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += _local(v).numel() * _local(v).element_size()
    return total
