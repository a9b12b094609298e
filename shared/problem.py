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

Mixture-of-experts transformer (``Config.experts`` = E >= 2, ``Config.topk`` = k): every block's
MLP is an MoE layer. Per layer the draws are, in order: W_qkv, W_o, then the router
W_r (D, E) = N/√D, then for each expert e in order W_up_e (D, 4D) = N/√D and W_down_e (4D, D) =
N/√(4D); the experts are stored stacked, ``mlp.experts.w_up`` (E, D, 4D) and ``w_down`` (E, 4D, D)
(torchtitan's GroupedExperts layout). Per token of h = norm2(x)::

    probs = softmax(h @ W_r)                      (E,)
    top = the k largest probs (ties to the lower index); gates = probs[top] / sum(probs[top])
    moe(h) = Σ_{e in top} gates_e · gelu(h @ W_up_e) @ W_down_e      (dropless: every token
                                                                       reaches all k experts)
    loss = mean CE + Σ_layers 0.01 · E · Σ_e f_e · P_e     (Switch Transformer's balancing loss)
    f_e = share of the k·B·T assignments routed to e (a constant: no gradient through it)
    P_e = mean of probs[:, e] over the B·T tokens

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
MOE_BALANCE_COEF = 0.01  # the Switch Transformer's load-balancing loss weight α (Fedus et al. 2021, §2.2)


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


MOE_MLP = ("mlp.router.weight", "mlp.experts.w_up", "mlp.experts.w_down")  # an MoE block's MLP parameters


def transformer_param_names(layers: int, experts: int = 0) -> list[str]:
    """Parameter names in torch's named_parameters() order of torch_impl.transformer.Transformer
    (with ``experts``: the MoE transformer's)."""
    names = ["wte.weight", "wpe.weight"]
    mlp = MOE_MLP if experts else ("mlp.up.weight", "mlp.down.weight")
    for l in range(layers):
        names += [f"blocks.{l}.{m}" for m in ("norm1.weight", "attn.qkv.weight", "attn.o.weight", "norm2.weight",
                                                *mlp)]
    return names + ["normf.weight", "head.weight"]


def is_expert_param(name: str) -> bool:
    """Is ``name`` an expert weight (stacked over experts on dim 0: what ep shards)?"""
    return ".mlp.experts." in name


def param_names(cfg: Config) -> list[str]:
    return mlp_param_names(cfg.layers) if cfg.model == "mlp" else transformer_param_names(cfg.layers, cfg.experts)


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """name -> shape in the fixture orientation (MLP: D×D each)."""
    d, v, t = cfg.dim, cfg.vocab, cfg.seq
    if cfg.model == "mlp":
        return {n: (d, d) for n in mlp_param_names(cfg.layers)}
    e = cfg.experts
    per_layer = {"norm1.weight": (d,), "attn.qkv.weight": (d, 3 * d), "attn.o.weight": (d, d), "norm2.weight": (d,)}
    per_layer |= {"mlp.router.weight": (d, e), "mlp.experts.w_up": (e, d, 4 * d), "mlp.experts.w_down": (e, 4 * d, d)} \
        if e else {"mlp.up.weight": (d, 4 * d), "mlp.down.weight": (4 * d, d)}
    shapes = {"wte.weight": (v, d), "wpe.weight": (t, d)}
    for l in range(cfg.layers):
        shapes |= {f"blocks.{l}.{m}": s for m, s in per_layer.items()}
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
        if cfg.experts:
            params[p + "mlp.router.weight"] = n((d, cfg.experts)) / np.sqrt(d)
            ups, downs = zip(*[(n((d, 4 * d)) / np.sqrt(d), n((4 * d, d)) / np.sqrt(4 * d))
                               for _ in range(cfg.experts)])  # expert e: W_up_e, then W_down_e
            params[p + "mlp.experts.w_up"], params[p + "mlp.experts.w_down"] = np.stack(ups), np.stack(downs)
            continue
        params[p + "mlp.up.weight"] = n((d, 4 * d)) / np.sqrt(d)
        params[p + "mlp.down.weight"] = n((4 * d, d)) / np.sqrt(4 * d)
    params["normf.weight"] = np.ones(d)
    params["head.weight"] = n((d, cfg.vocab)) / np.sqrt(d)
    tokens = rng.integers(0, cfg.vocab, size=(cfg.batch, cfg.seq + 1))
    assert list(params) == transformer_param_names(cfg.layers, cfg.experts)
    return Problem(params=params, inputs=tokens[:, :-1], targets=tokens[:, 1:], model="transformer")
