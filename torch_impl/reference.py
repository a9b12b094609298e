"""Single-device reference: the shared model (MLP or transformer) trained with AdamW on one device.

Every parallel implementation is checked against this run (same fixture, same steps).
"""

from __future__ import annotations

import time

import numpy as np

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from torch_impl.model import (
    aux_loss,
    build_model,
    expert_load,
    fixture_grads,
    fixture_weights,
    inputs,
    loss_fn,
    make_optimizer,
    optimizer_state_bytes,
    targets,
    tensor_bytes,
)


def train(cfg: Config, problem: Problem, device="cpu") -> Trained:
    model = build_model(cfg, problem, device)
    opt = make_optimizer(model.parameters(), cfg)
    x, y = inputs(cfg, problem, device), targets(cfg, problem, device)  # (B, D) | (B, T), None | (B, T)
    losses, step_times, grads0, loads = [], [], None, []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        if cfg.moe:  # + the balancing loss of every MoE layer; its routing: (L, B, E) counts
            loss = loss + aux_loss(model)
            loads.append(expert_load(model))
        loss.backward()
        if step == 0:
            grads0 = fixture_grads(model)
        opt.step()
        losses.append(loss.item())  # .item() syncs, so the step time is real on GPU too
        step_times.append(time.perf_counter() - t0)
    params = list(model.parameters())
    return Trained(
        losses=losses,
        grads0=grads0,
        params=fixture_weights(model),
        step_times=step_times,
        state_bytes={
            "params": tensor_bytes(params),
            "grads": tensor_bytes(params),
            "optimizer": optimizer_state_bytes(opt),
        },
        extra={"expert_load": np.stack(loads)} if cfg.moe else {},  # (steps, L, B, E) int64
    )
