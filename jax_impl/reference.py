"""Single-device reference: the shared model (Flax NNX MLP or transformer) trained with optax AdamW on one device.

Every parallel implementation is checked against this run (same fixture, same steps).
"""

from __future__ import annotations

import time

import jax
from flax import nnx

from jax_impl.model import build_model, inputs, make_optimizer, output_loss, params_of, targets, to_numpy, tree_bytes
from shared.config import Config
from shared.problem import Problem
from shared.results import Trained


def train(cfg: Config, problem: Problem, device=None) -> Trained:
    device = device or jax.devices()[0]
    with jax.default_device(device):
        model = build_model(cfg, problem)
        opt = nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
        x, y = inputs(cfg, problem), targets(cfg, problem)  # (B, D) | (B, T), None | (B, T)

        @nnx.jit
        def step(model, opt, x, y):
            loss, grads = nnx.value_and_grad(lambda m: output_loss(m(x), y))(model)
            opt.update(model, grads)
            return loss, grads

        losses, step_times, grads0 = [], [], None
        for k in range(cfg.steps):
            t0 = time.perf_counter()
            loss, grads = step(model, opt, x, y)
            losses.append(float(loss))  # float() waits for the device
            step_times.append(time.perf_counter() - t0)
            if k == 0:  # grads: an nnx.State shaped like the model: read it through the same names
                grads0 = [to_numpy(g) for g in params_of(nnx.merge(nnx.graphdef(model), grads))]
    params = params_of(model)
    return Trained(
        losses=losses,
        grads0=grads0,
        params=[to_numpy(w) for w in params],
        step_times=step_times,
        state_bytes={
            "params": tree_bytes(params),
            "grads": tree_bytes(params),
            "optimizer": tree_bytes(nnx.state(opt, nnx.OptState)),
        },
    )
