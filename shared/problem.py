"""The shared problem: the CS336 lecture-8 MLP and its fixture, drawn the same way everywhere.

Recipe (reproducible in any framework)::

    rng = numpy.random.default_rng(seed)
    W_l = rng.standard_normal((dim, dim)) / sqrt(dim)     for l = 0 … layers-1, in that order
    inputs = rng.standard_normal((batch, dim))
    # drawn in float64, cast to the run's dtype by each framework

    model:  x = gelu(x @ W_l) for each layer (exact, erf GELU);  loss = mean(x**2)
    optim:  AdamW with torch semantics (decoupled weight decay), lr/betas/eps/wd from Config;
            the loss of step k is the loss at the parameters before update k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.config import Config


@dataclass(frozen=True)
class Problem:
    weights: tuple[np.ndarray, ...]  # L × (D, D), float64, applied as x @ W_l
    inputs: np.ndarray  # (B, D), float64

    @property
    def layers(self) -> int:
        return len(self.weights)


def make_problem(cfg: Config) -> Problem:
    rng = np.random.default_rng(cfg.seed)
    weights = tuple(
        rng.standard_normal((cfg.dim, cfg.dim)) / np.sqrt(cfg.dim) for _ in range(cfg.layers)
    )
    inputs = rng.standard_normal((cfg.batch, cfg.dim))
    return Problem(weights=weights, inputs=inputs)
