"""Single-device reference: the shared model (Flax NNX MLP or transformer) trained with optax AdamW on one device.

Every parallel implementation is checked against this run (same fixture, same steps). The MoE
transformer's loss adds the balancing losses, and its routing counts come back per step as
``extra["expert_load"]`` (steps, L, B, E) int64. Mixed precision: the model's float32 parameters are
cast to bfloat16 inside every call (Flax's ``dtype=``), AdamW's state stays float32; float16 adds
dynamic loss scaling (parallel/scaling.py: extra["skipped_steps"], extra["loss_scale"]). ``split=2`` trains
the same run with each step's batch cut in two halves whose gradients are added (the mixed runs'
measured floor: shared/tolerances.py). The MoE transformer's recipe loss (--accumulate: each micro-batch its
own balancing loss; the split's f from the whole micro-batch): jax_impl/recipe.moe_loss.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_impl import recipe
from jax_impl.model import (
    build_model,
    compiler_options,
    fetch,
    inputs,
    params_of,
    targets,
    to_numpy,
    tree_bytes,
)
from jax_impl.parallel.recipe import clip_by_global_norm
from jax_impl.parallel.scaling import keep, nonfinite
from jax_impl.recipe import scale_extra
from shared.config import Config
from shared.problem import Problem
from shared.results import Trained


def train(cfg: Config, problem: Problem, device=None, split: int = 1) -> Trained:
    device = device or jax.devices()[0]
    with jax.default_device(device):
        model = build_model(cfg, problem)
        paths = recipe.fixture_paths(model)  # the recipe (jax_impl/recipe.py): schedule, masks, frozen, K, clip
        tx = recipe.optimizer(cfg, paths)
        if cfg.clip is not None:  # torch's clip_grad_norm_ formula (optax's own differs at ~1e-6)
            tx = optax.chain(clip_by_global_norm(cfg.clip), tx)
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        x, y = inputs(cfg, problem), targets(cfg, problem)  # (B, D) | (B, T), None | (B, T)
        batch_loss = recipe.loss_fn(cfg, paths)

        moe_loss = recipe.moe_loss(cfg, paths, split)  # (mean CE + Σ_l aux_l per micro-batch, load (L, B, E))

        def step(model, opt, x, y, s):  # s: float16's loss scale (1.0 otherwise); the gradients unscaled
            (_, loss), grads = nnx.value_and_grad(
                lambda m: ((l := batch_loss(m, *(x,) if y is None else (x, y))) * s, l), has_aux=True)(model)
            grads = jax.tree.map(lambda g: g / s, grads)
            opt.update(model, grads)
            return loss, grads

        part_loss = recipe.loss_fn(cfg.replace(accumulate=1), paths)  # the recipe's frozen Params stopped

        def split_step(model, opt, x, y, s):  # the batch in `split` equal parts, gradients added (dense only);
            n = split * cfg.accumulate  # --accumulate K: each of its K parts in `split` (else the same sums)
            parts = zip(jnp.split(x, n), [None] * n if y is None else jnp.split(y, n))
            loss, grads = 0.0, None
            for xs, ys in parts:
                (_, part), g = nnx.value_and_grad(lambda m, xs=xs, ys=ys: (
                    (l := part_loss(m, *(xs,) if ys is None else (xs, ys)) / n) * s, l), has_aux=True)(model)
                loss, grads = loss + part, g if grads is None else jax.tree.map(jnp.add, grads, g)
            grads = jax.tree.map(lambda g: g / s, grads)
            opt.update(model, grads)
            return loss, grads

        def moe_step(model, opt, x, y, s):
            (loss, load), grads = nnx.value_and_grad(moe_loss, has_aux=True)(model, x, y)
            opt.update(model, grads)
            return loss, grads, load

        graphdef, state = nnx.split((model, opt))

        scaler = recipe.loss_scale(cfg)  # float16: dynamic loss scaling (jax_impl/parallel/scaling.py)

        @functools.partial(jax.jit, compiler_options=compiler_options(cfg))  # mixed: no excess precision
        def pure(state, sc, x, y):  # the chosen step on the split (model, optimizer) state
            old = jax.tree.map(lambda a: a, state)  # a skipped step's: merge shares state's Variables, updated in place
            model, opt = nnx.merge(graphdef, state)
            out = (moe_step if cfg.moe else split_step if split > 1 else step)(model, opt, x, y,
                                                                             1.0 if sc is None else sc["scale"])
            if sc is None:
                return nnx.state((model, opt)), sc, out
            bad = nonfinite(out[1])  # a skipped step: the model and AdamW (its count too) as they were
            return keep(bad, nnx.state((model, opt)), old), scaler.update(sc, bad), (*out, bad > 0)

        losses, step_times, grads0, loads = [], [], None, []
        sc, skipped, scales = None if scaler is None else scaler.init(), [], []
        for k in range(cfg.steps):
            t0 = time.perf_counter()
            state, sc, out = pure(state, sc, x, y)
            if sc is not None:
                *out, bad = out
                skipped.append(bad)
                scales.append(sc["scale"])
            if cfg.moe:
                loss, grads, load = out
            else:
                loss, grads = out
            losses.append(float(loss))  # float() waits for the device
            step_times.append(time.perf_counter() - t0)
            if cfg.moe:
                loads.append(np.asarray(fetch(load), np.int64))  # (L, B, E): read back outside the timing
            if k == 0:  # grads: an nnx.State shaped like the model: read it through the same names
                grads0 = [to_numpy(g) for g in params_of(nnx.merge(nnx.graphdef(model), grads))]
        nnx.update((model, opt), state)
    params = params_of(model)
    return Trained(
        losses=losses,
        grads0=grads0,
        params=[to_numpy(w) for w in params],
        step_times=step_times,
        timed=[k > 0 for k in range(len(step_times))],  # step 0: the compilation
        state_bytes={
            "params": tree_bytes(params),
            "grads": tree_bytes(params),
            "optimizer": tree_bytes(nnx.state(opt, nnx.OptState)),
        },
        extra=({"expert_load": np.stack(loads)} if cfg.moe else {})  # (steps, L, B, E)
        | (scale_extra(skipped, scales) if scaler else {}),  # float16: skipped steps, final scale
    )
