"""Expert parallelism for a user's mixture-of-experts layer in JAX (issue 33): ``parallel.ep.dispatch``
inside a shard_map over "ep" against the same layer on one device, from the same weights.

The layer (defined here, float64, a plain function: the seam is the call, not a module): a router, the
top-k gates renormalised, stacked experts w1 (E, D, F), b1 (E, F), w2 (E, F, D) with a SiLU, the
gate-weighted sum and a residual. E = 4, k = 2, N = 2 devices, n = 6 tokens each. The reference runs
every expert on every token and picks each assignment's row. Tolerance 1e-12 (float64): the same sums,
the loss a mean of the devices' means (equal sizes), ~1e-16 relative per op.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_impl.devices import make_mesh
from jax_impl.ledger import comm_from_hlo
from jax_impl.parallel import ep
from jax_impl.parallel.tree import WrapError

TOL = 1e-12  # float64: see the module docstring
E, K, D, F, N, n = 4, 2, 6, 5, 2, 6


def expert(w, rows):  # one expert: w its slices, rows (R, D) -> (R, D)
    return jax.nn.silu(rows @ w["w1"] + w["b1"]) @ w["w2"]


def layer(router, experts_out, x):
    """x (n, D); ``experts_out(h, top)`` -> (n, k, D) each assignment's expert output."""
    top_p, top = lax.top_k(jax.nn.softmax(x @ router), K)  # (n, k)
    gates = top_p / top_p.sum(-1, keepdims=True)
    return x + jnp.einsum("nk,nkd->nd", gates, experts_out(x, top))


def one_device(params, x):
    def every_expert(h, top):  # (E, n, D): every expert on every token, then each assignment's row
        ys = jax.vmap(expert, in_axes=(0, None))(params["experts"], h)
        return ys[top, jnp.arange(h.shape[0])[:, None]]  # (n, k, D)
    return jnp.mean(layer(params["router"], every_expert, x) ** 2)


def expert_parallel(params, x, mesh):
    def local(router, weights, x):  # weights (E/N, …) this device's experts; x (n, D) its tokens
        out = layer(router, lambda h, top: ep.dispatch(expert, weights, h, top), x)
        return lax.pmean(jnp.mean(out ** 2), "ep")  # the devices' means: equal sizes, the full mean
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("ep"), P("ep")), out_specs=P(),
                         check_vma=True)(params["router"], params["experts"], x)


def test_dispatch_gives_a_user_moe_the_one_device_loss_and_gradients(measured):
    rng = np.random.default_rng(0)
    params = {"router": rng.normal(size=(D, E)),
              "experts": {"w1": rng.normal(size=(E, D, F)) * 0.4, "b1": rng.normal(size=(E, F)) * 0.1,
                          "w2": rng.normal(size=(E, F, D)) * 0.4}}
    x = rng.normal(size=(N * n, D))
    params, x = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (params, x))
    # d/dx too: the layer's input comes from earlier layers in a model (the dispatch's transpose runs)
    ref, ref_grads = jax.value_and_grad(one_device, argnums=(0, 1))(params, x)
    step = jax.jit(jax.value_and_grad(lambda p, x: expert_parallel(p, x, make_mesh(N, "ep")), argnums=(0, 1)))
    got, grads = step(params, x)
    loss_err = abs(float(got) - float(ref))
    grad_err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
    measured(f"ep.dispatch user MoE, N={N}, E={E}, k={K}: loss {loss_err:.1e}, grads {grad_err:.1e}")
    assert loss_err <= TOL and grad_err <= TOL, (loss_err, grad_err)

    ledger = comm_from_hlo(step.lower(params, x).compile().as_text())
    buffer = E * n * D * 8  # (E, C, D) float64, C = n
    assert ledger["all_to_all"] == {"count": 4, "bytes": 4 * buffer}, ledger  # dispatch, combine; their transposes
    assert ledger["all_reduce"] == {"count": 1, "bytes": (D * E + 1) * 8}, ledger  # the router's gradient + loss


def test_dispatch_refuses_unstacked_weights():
    bad = {"w1": jnp.zeros((2, D, F)), "scale": jnp.zeros(())}  # a scalar beside the stack
    with pytest.raises(WrapError, match="stacked \\(E/N, …\\) on dim 0"):
        jax.shard_map(lambda w, h: ep.dispatch(expert, w, h, jnp.zeros((n, K), jnp.int32)),
                      mesh=make_mesh(N, "ep"), in_specs=(P(), P("ep")), out_specs=P("ep"))(bad, jnp.zeros((N * n, D)))


def test_the_recipe_outside_the_shard_map_is_exact():
    """Gradients taken OUTSIDE the shard_map are global arrays (the experts sharded over "ep"), so optax's
    clip_by_global_norm sees the whole model's norm and a decay mask sees every leaf by name: 3 steps of
    clip (binding) + AdamW decaying matrices only equal one device's to 1e-12 (module docstring)."""
    import optax

    rng = np.random.default_rng(1)
    params = {"router": rng.normal(size=(D, E)),
              "experts": {"w1": rng.normal(size=(E, D, F)) * 0.4, "b1": rng.normal(size=(E, F)) * 0.1,
                          "w2": rng.normal(size=(E, F, D)) * 0.4}}
    x = jnp.asarray(rng.normal(size=(N * n, D)))
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
    mask = lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)
    tx = optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(1e-2, weight_decay=0.1, mask=mask))
    mesh = make_mesh(N, "ep")

    def run(loss):
        p, state, norms = params, tx.init(params), []
        for _ in range(3):
            g = jax.grad(loss)(p, x)
            norms.append(float(optax.tree.norm(g)))
            updates, state = tx.update(g, state, p)
            p = optax.apply_updates(p, updates)
        return p, norms
    ref, ref_norms = run(one_device)
    got, norms = run(jax.jit(lambda p, x: expert_parallel(p, x, mesh)))
    assert min(ref_norms) > 1e-3, ref_norms  # the clip binds every step
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    assert err <= TOL and max(abs(a - b) for a, b in zip(norms, ref_norms)) <= TOL, (err, norms, ref_norms)
