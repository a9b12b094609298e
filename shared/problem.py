"""The shared problems: the fixtures every implementation trains, drawn the same way everywhere.

Two workloads (``Config.model``), each a recipe reproducible in any framework. Every array is
drawn in float64 and cast to the run's dtype by each framework; weights are stored in the
*fixture orientation*: a matrix W is applied as ``x @ W`` (torch's nn.Linear stores W.T).

MLP (CS336 lecture 8)::

    rng = numpy.random.default_rng(seed)
    W_l = rng.standard_normal((dim, dim)) / sqrt(dim)     for l = 0 … layers-1, in that order
    inputs = rng.standard_normal((batch, dim))
    model:  x = gelu(x @ W_l) for each layer (exact, erf GELU);  loss = mean(x**2)

Transformer (GPT-style decoder; L layers, D dim, H heads, dh = D/H, V vocab, T seq, B batch)::

    wte (V, D) = N·0.02;  wpe (T, D) = N·0.02
    for each layer l:  W_qkv (D, 3D) = N/√D;  W_o (D, D) = N/√D;  W_up (D, 4D) = N/√D;
                       W_down (4D, D) = N/√(4D)
    W_head (D, V) = N/√D
    tokens = rng.integers(0, V, size=(B, T+1));  inputs = tokens[:, :-1];  targets = tokens[:, 1:]
    (N is rng.standard_normal(shape), drawn in exactly this order.)
    RMSNorm gains (D,) start at ones: norm(x) = x / sqrt(mean(x², -1) + 1e-5) · g
    x = wte[inputs] + wpe;  per block: x = x + attn(norm1(x)); x = x + gelu(norm2(x) @ W_up) @ W_down
    attn(h): qkv = h @ W_qkv; q, k, v = columns [0:D], [D:2D], [2D:3D]; head i = columns i·dh:(i+1)·dh
             of each; causal softmax(q kᵀ / √dh) v per head; heads concatenated in order; @ W_o
    logits = normf(x) @ W_head;  loss = mean cross-entropy over all B·T positions

Both: AdamW with torch semantics (decoupled weight decay on every parameter, norm gains too),
lr/betas/eps/wd from Config; the loss of step k is the loss at the parameters before update k.

``Problem.params`` names every parameter as torch's ``named_parameters()`` of the twin
``nn.Module`` does, in that order; ``Trained.grads0`` / ``Trained.params`` are lists in the same
order, so any run compares with any other by ``shared.results.parity``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.config import Config

RMS_EPS = 1e-5  # RMSNorm's ε (both frameworks pass it explicitly)


@dataclass(frozen=True)
class Problem:
    params: dict[str, np.ndarray]  # name -> float64 array, fixture orientation, named_parameters() order
    inputs: np.ndarray  # MLP: (B, D) float64; transformer: (B, T) int64 token ids
    targets: np.ndarray | None = None  # transformer: (B, T) int64 next tokens; MLP: None
    model: str = "mlp"

    @property
    def weights(self) -> tuple[np.ndarray, ...]:
        """MLP: the L weights W_l in layer order."""
        return tuple(self.params.values())


def mlp_param_names(layers: int) -> list[str]:
    return [f"layers.{l}.linear.weight" for l in range(layers)]


def transformer_param_names(layers: int) -> list[str]:
    """Parameter names in torch's named_parameters() order of torch_impl.transformer.Transformer."""
    names = ["wte.weight", "wpe.weight"]
    for l in range(layers):
        names += [f"blocks.{l}.{m}.weight" for m in ("norm1", "attn.qkv", "attn.o", "norm2", "mlp.up", "mlp.down")]
    return names + ["normf.weight", "head.weight"]


def param_names(cfg: Config) -> list[str]:
    return mlp_param_names(cfg.layers) if cfg.model == "mlp" else transformer_param_names(cfg.layers)


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """name -> shape in the fixture orientation (MLP: D×D each)."""
    d, v, t = cfg.dim, cfg.vocab, cfg.seq
    if cfg.model == "mlp":
        return {n: (d, d) for n in mlp_param_names(cfg.layers)}
    per_layer = {"norm1": (d,), "attn.qkv": (d, 3 * d), "attn.o": (d, d), "norm2": (d,),
                 "mlp.up": (d, 4 * d), "mlp.down": (4 * d, d)}
    shapes = {"wte.weight": (v, d), "wpe.weight": (t, d)}
    for l in range(cfg.layers):
        shapes |= {f"blocks.{l}.{m}.weight": s for m, s in per_layer.items()}
    return shapes | {"normf.weight": (d,), "head.weight": (d, v)}


def make_problem(cfg: Config) -> Problem:
    rng = np.random.default_rng(cfg.seed)
    if cfg.model == "mlp":
        weights = [rng.standard_normal((cfg.dim, cfg.dim)) / np.sqrt(cfg.dim) for _ in range(cfg.layers)]
        inputs = rng.standard_normal((cfg.batch, cfg.dim))
        return Problem(params=dict(zip(mlp_param_names(cfg.layers), weights)), inputs=inputs)
    d, n = cfg.dim, rng.standard_normal
    params = {"wte.weight": n((cfg.vocab, d)) * 0.02, "wpe.weight": n((cfg.seq, d)) * 0.02}
    for l in range(cfg.layers):
        p = f"blocks.{l}."
        params[p + "norm1.weight"] = np.ones(d)
        params[p + "attn.qkv.weight"] = n((d, 3 * d)) / np.sqrt(d)
        params[p + "attn.o.weight"] = n((d, d)) / np.sqrt(d)
        params[p + "norm2.weight"] = np.ones(d)
        params[p + "mlp.up.weight"] = n((d, 4 * d)) / np.sqrt(d)
        params[p + "mlp.down.weight"] = n((4 * d, d)) / np.sqrt(4 * d)
    params["normf.weight"] = np.ones(d)
    params["head.weight"] = n((d, cfg.vocab)) / np.sqrt(d)
    tokens = rng.integers(0, cfg.vocab, size=(cfg.batch, cfg.seq + 1))
    assert list(params) == transformer_param_names(cfg.layers)
    return Problem(params=params, inputs=tokens[:, :-1], targets=tokens[:, 1:], model="transformer")
