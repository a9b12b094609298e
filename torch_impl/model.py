"""The models as ``nn.Module``s, and the model-generic pieces every pattern uses.

- ``MLP``: the CS336 lecture-8 MLP; ``Block`` is ``gelu(Linear(x))`` with exact (erf) GELU, no bias.
- ``Transformer`` (torch_impl/transformer.py): the GPT-style decoder.

``build_model(cfg, problem)`` builds either holding the fixture's parameters; ``inputs`` /
``targets`` give the batch (targets None for the MLP) and ``loss_fn(out, targets)`` the loss of
either (MLP: mean(out²); transformer: mean cross-entropy). torch's ``nn.Linear`` stores
``weight`` as (out, in) and computes ``x @ weight.T``, so ``linear.weight == W.T`` for the
fixture's W (see shared/dims.py); ``to_fixture`` / ``fixture_*`` convert back, by name.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.config import Config
from shared.problem import Problem
from torch_impl.transformer import MoE, Transformer

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                "float16": torch.float16}  # float16: mixed precision only (a LossScaler: torch_impl/recipe.py)


def torch_dtype(cfg: Config) -> torch.dtype:
    """The parameters' (and gradients', optimizer state's) dtype: float32 under mixed precision."""
    return TORCH_DTYPES[cfg.param_dtype]


def autocast(cfg: Config, device) -> contextlib.AbstractContextManager:
    """Mixed precision's compute: ``torch.autocast`` to ``cfg.dtype`` (bfloat16 / float16) around the forward and
    backward of one step — matmuls in bf16, reductions (softmax, norms, the loss) in float32, the
    gradients of the float32 parameters in float32. Pure precision: nothing."""
    if cfg.precision != "mixed":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=TORCH_DTYPES[cfg.dtype])


class Block(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.linear = nn.Linear(dim, dim, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(x), approximate="none")  # (B, D)


class MLP(nn.Module):
    def __init__(self, layers: int, dim: int, dtype: torch.dtype = torch.float32, device=None,
                 out_dtype: torch.dtype | None = None):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, dtype, device) for _ in range(layers))
        self.out_dtype = out_dtype  # mixed precision: the output handed to the loss in float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x if self.out_dtype is None else x.to(self.out_dtype)


def mlp_plan(layers: int, variant: str) -> dict[str, str]:
    """The MLP's tensor-parallel plan: "allgather" (every layer colwise_gather) or Megatron's
    colwise/rowwise pairs (odd L: the last layer colwise_out); torch_impl/parallel/tp.py applies it."""
    if variant == "allgather":
        return {f"layers.{l}.linear": "colwise_gather" for l in range(layers)}
    kinds = ["colwise", "rowwise"] * (layers // 2) + ["colwise_out"] * (layers % 2)
    return {f"layers.{l}.linear": k for l, k in enumerate(kinds)}


def empty_model(cfg: Config, device="cpu", layers: int | None = None) -> nn.Module:
    """The model of ``cfg`` (with ``layers`` blocks if given), uninitialised."""
    layers = cfg.layers if layers is None else layers
    if cfg.model == "mlp":
        return MLP(layers, cfg.dim, torch_dtype(cfg), device, torch.float32 if cfg.precision == "mixed" else None)
    return Transformer(layers, cfg.dim, cfg.heads, cfg.vocab, cfg.seq, torch_dtype(cfg), device,
                       cfg.experts, cfg.topk, cfg.recompute)


def is_transposed(module: nn.Module, name: str) -> bool:
    """Is parameter ``name`` of ``module`` stored transposed w.r.t. the fixture (an nn.Linear weight)?"""
    owner = module.get_submodule(name.rpartition(".")[0])
    return isinstance(owner, nn.Linear) and name.endswith("weight")


def load_fixture(module: nn.Module, params: dict, names: dict[str, str] | None = None) -> nn.Module:
    """Copy fixture arrays into ``module``'s parameters. ``names`` maps the module's parameter
    names to fixture names (default: the same); the module may hold a subset (a pipeline stage)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            w = params[(names or {}).get(name, name)]
            p.copy_(torch.from_numpy(w.T.copy() if is_transposed(module, name) else w))
    return module


def build_model(cfg: Config, problem: Problem, device="cpu") -> nn.Module:
    """The model of ``cfg.model`` holding the fixture parameters (cast to the run's dtype)."""
    return load_fixture(empty_model(cfg, device), problem.params)


def inputs(cfg: Config, problem: Problem, device="cpu") -> torch.Tensor:
    """MLP: (B, D) in the run's dtype; transformer: (B, T) token ids (int64)."""
    # torch.tensor copies: the fixture's NumPy array is never aliased (an in-place op would change it).
    dtype = torch_dtype(cfg) if problem.targets is None else torch.long
    return torch.tensor(problem.inputs, device=device, dtype=dtype)


def targets(cfg: Config, problem: Problem, device="cpu") -> torch.Tensor | None:
    """Transformer: (B, T) next-token ids; MLP: None."""
    return None if problem.targets is None else torch.tensor(problem.targets, device=device, dtype=torch.long)


def loss_fn(out: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """MLP (targets None): mean(out²). Transformer: mean cross-entropy of logits (…, V) over all positions."""
    if targets is None:
        return out.pow(2).mean()
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def aux_loss(model: nn.Module) -> torch.Tensor | float:
    """Σ over the MoE layers of their last forward's balancing loss (0 for a dense model)."""
    return sum((m.aux for m in model.modules() if isinstance(m, MoE)), 0.0)


def expert_load(model: nn.Module) -> np.ndarray:
    """(L, B_local, E) int64: tokens of each local sequence routed to each expert by each MoE
    layer in the last forward (every (l, b) row sums to k·T)."""
    return np.stack([m.load.cpu().numpy() for m in model.modules() if isinstance(m, MoE)]).astype(np.int64)


def make_optimizer(params, cfg: Config) -> torch.optim.Optimizer:
    """AdamW with the per-parameter loop on every device (``foreach=False``: the CPU default). On CUDA torch
    picks the foreach kernels, which refused a DTensor plan's mix of DTensor and plain parameters
    ("aten._foreach_mul_.Scalar: got mixed torch.Tensor and DTensor", seen on an H200, before
    apply_dtensor_plan made the unplanned ones Replicate DTensors; the mesh's builtin composition still mixes)."""
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False
    )


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy().copy()


def to_fixture(module: nn.Module, name: str, t: torch.Tensor) -> np.ndarray:
    """A full (unsharded) parameter or gradient of ``module`` as a float64 fixture-orientation array."""
    a = to_numpy(t)
    return a.T.copy() if is_transposed(module, name) else a


def fixture_weights(model: nn.Module) -> list[np.ndarray]:
    """Full parameters in the fixture orientation (float64), named_parameters() order."""
    return [to_fixture(model, n, p) for n, p in model.named_parameters()]


def fixture_grads(model: nn.Module) -> list[np.ndarray]:
    """Every parameter's gradient in the fixture orientation; a frozen one (no gradient) as zeros."""
    return [to_fixture(model, n, torch.zeros_like(p) if p.grad is None else p.grad)
            for n, p in model.named_parameters()]


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
