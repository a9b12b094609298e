"""An independent float64 NumPy implementation with hand-written backprop.

It shares no code with either framework, so the torch and JAX references are checked against
the math itself, not only against each other.
"""

from __future__ import annotations

import math

import numpy as np

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained

_erf = np.vectorize(math.erf)


def gelu(z: np.ndarray) -> np.ndarray:
    return 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))


def gelu_grad(z: np.ndarray) -> np.ndarray:
    # d/dz [z·Φ(z)] = Φ(z) + z·φ(z)
    cdf = 0.5 * (1.0 + _erf(z / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return cdf + z * pdf


def loss_and_grads(weights: list[np.ndarray], x: np.ndarray) -> tuple[float, list[np.ndarray]]:
    acts, pre = [x], []  # acts[l] is layer l's input (B, D); pre[l] = acts[l] @ W_l
    for w in weights:
        pre.append(acts[-1] @ w)
        acts.append(gelu(pre[-1]))
    out = acts[-1]
    loss = float(np.mean(out**2))
    d_act = 2.0 * out / out.size  # dL/d out, (B, D)
    grads = [None] * len(weights)
    for layer in reversed(range(len(weights))):
        d_pre = d_act * gelu_grad(pre[layer])  # (B, D)
        grads[layer] = acts[layer].T @ d_pre  # (D, D)
        d_act = d_pre @ weights[layer].T  # (B, D)
    return loss, grads


def train(cfg: Config, problem: Problem) -> Trained:
    """AdamW exactly as torch.optim.AdamW (decoupled weight decay, bias-corrected moments)."""
    weights = [w.copy() for w in problem.weights]
    m = [np.zeros_like(w) for w in weights]
    v = [np.zeros_like(w) for w in weights]
    losses, grads0 = [], None
    for step in range(1, cfg.steps + 1):
        loss, grads = loss_and_grads(weights, problem.inputs)
        losses.append(loss)
        if step == 1:
            grads0 = grads
        for i, g in enumerate(grads):
            weights[i] *= 1.0 - cfg.lr * cfg.weight_decay
            m[i] = cfg.beta1 * m[i] + (1 - cfg.beta1) * g
            v[i] = cfg.beta2 * v[i] + (1 - cfg.beta2) * g * g
            m_hat = m[i] / (1 - cfg.beta1**step)
            v_hat = v[i] / (1 - cfg.beta2**step)
            weights[i] -= cfg.lr * m_hat / (np.sqrt(v_hat) + cfg.eps)
    return Trained(losses=losses, grads0=grads0, params=weights)


# --- the transformer: an independent float64 forward (loss only; gradients by central differences) ---


def transformer_loss(params: dict[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray, heads: int) -> float:
    """shared/problem.py's recipe, written from its text with NumPy loops over heads."""
    b, t = tokens.shape
    d = params["wte.weight"].shape[1]
    dh = d // heads

    def norm(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * g

    x = params["wte.weight"][tokens] + params["wpe.weight"][:t]  # (B, T, D)
    layers = sum(1 for k in params if k.endswith("attn.qkv.weight"))
    causal = np.tril(np.ones((t, t), dtype=bool))
    for l in range(layers):
        p = lambda n, l=l: params[f"blocks.{l}.{n}.weight"]
        qkv = norm(x, p("norm1")) @ p("attn.qkv")  # (B, T, 3D)
        q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
        heads_out = []
        for i in range(heads):
            cols = slice(i * dh, (i + 1) * dh)
            s = q[..., cols] @ np.swapaxes(k[..., cols], 1, 2) / math.sqrt(dh)  # (B, T, T)
            s = np.where(causal, s, -np.inf)
            w = np.exp(s - s.max(axis=-1, keepdims=True))
            heads_out.append((w / w.sum(axis=-1, keepdims=True)) @ v[..., cols])  # (B, T, dh)
        x = x + np.concatenate(heads_out, axis=-1) @ p("attn.o")
        x = x + gelu(norm(x, p("norm2")) @ p("mlp.up")) @ p("mlp.down")
    logits = norm(x, params["normf.weight"]) @ params["head.weight"]  # (B, T, V)
    m = logits.max(axis=-1, keepdims=True)
    logz = (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))[..., 0]  # (B, T)
    picked = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # (B, T)
    return float(np.mean(logz - picked))
