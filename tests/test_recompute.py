"""Activation recomputation (``--recompute none|full|selective``, the transformer): the losses, step-0
gradients and final parameters of a run that recomputes equal the single-device run that does not
(float64, <= 1e-12: recomputation repeats the same ops on the same inputs, so only the reduction
splits of the layout differ, as without it); the bytes torch saves for backward equal
shared.theory.activation_bytes (exactly where the formula covers the layout) and order full <
selective < none on every rank; JAX's autodiff residuals (jax.vjp) order the same way.

Default: one torch launch at world size 2 (dp, tp, pp: one variant each) in a thread while this
process runs JAX's dp (shard_map) under full recomputation, and the single-device JAX residuals
(traced, not compiled). Every pattern of both frameworks (torch: every variant; JAX: each pattern's
main shard_map variant, selective): slow, one test (each JAX transformer step costs seconds to compile).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from shared.config import Config
from shared.results import parity
from shared.theory import activation_bytes, block_saved_elements, recompute_extra_flops
from shared.vocab import TOUR
from torch_impl.harness import run_pattern as torch_run_pattern
from torch_impl.launch import launch

TOL = 1e-12  # float64: recomputation reruns the same ops; what differs from one device is the layout's sums
BASE = Config(world_size=2, model="transformer", layers=2, dim=16, heads=4, seq=8, vocab=32, batch=4,
              microbatches=2, steps=2)
POLICIES = ("none", "selective", "full")
# (pattern, torch variant, JAX variant): the sample; JAX runs dp (full) by default, the rest in a slow test
SAMPLE = (("dp", ("explicit", "naive"), ("shard_map", "dp")),
          ("tp", ("explicit", "megatron"), ("shard_map", "megatron")),
          ("pp", ("explicit", "1f1b"), ("shard_map", "circular")))
EVERY = ("dp", "fsdp", "tp", "pp", "cp", "ep", "mesh")


def _cfgs(pattern: str) -> list[Config]:
    out = [BASE.replace(recompute=p) for p in POLICIES]
    if pattern == "ep":
        return [c.replace(experts=4, topk=2) for c in out]
    if pattern == "mesh":
        # the 1-axis layouts whose blocks run in a pattern's own way (fsdp's are dp's blocks: not here, budget)
        return [c.replace(mesh=m) for c in out for m in ((("pp", 2),), (("tp", 2),), (("cp", 2),))]
    return out


def _torch_rank(ctx, jobs):
    """Several (pattern, configs, variants) in one launch; rank 0's entries per pattern."""
    return {p: torch_run_pattern(ctx, p, cfgs, variants) for p, cfgs, variants in jobs}


def _check(entries, framework):
    """Parity of every run against its (non-recomputing) reference; {(pattern key, style, variant):
    {policy: activation bytes}} for the ordering checks."""
    sizes = {}
    for pattern, pattern_entries in entries.items():
        for e in pattern_entries:
            cfg = e["cfg"]
            for style, variant, trained in e["runs"]:
                errs = parity(trained, e["reference"])
                assert max(errs.values()) <= TOL, (framework, pattern, cfg.recompute, style, variant, errs)
                key = (pattern, cfg.mesh_name, style, variant)
                sizes.setdefault(key, {})[cfg.recompute] = trained.extra.get("activation_bytes")
    return sizes


@pytest.fixture(scope="module")
def sample():
    """{"torch": rank 0's entries per pattern, "jax": {"dp": entries}}: the launch runs in a thread
    while this process compiles JAX's steps."""
    from jax_impl.harness import run_pattern as jax_run_pattern

    with ThreadPoolExecutor(max_workers=1) as pool:
        torch_out = pool.submit(launch, _torch_rank, 2, [(p, _cfgs(p), [torch_v]) for p, torch_v, _ in SAMPLE])
        jax_out = {"dp": jax_run_pattern("dp", _cfgs("dp")[2:], [SAMPLE[0][2]])}  # full
        return {"torch": torch_out.result()[0], "jax": jax_out}


def test_torch_sample_parity_and_saved_bytes(sample):
    sizes = _check(sample["torch"], "torch")
    for key, by_policy in sizes.items():
        assert by_policy["full"] < by_policy["selective"] < by_policy["none"], (key, by_policy)
    # dp: rank 0 runs B/2 sequences; its ids are views of the global (B, T) arrays: exactly the formula
    dp = sizes["dp", "", "explicit", "naive"]
    assert dp == {p: activation_bytes(BASE, p, sequences=BASE.batch // 2, id_sequences=BASE.batch)
                  for p in POLICIES}, dp
    # pp stage 0 (1F1B: min(S, M) = 2 micro-batches in flight, L/S blocks each, its ids and positions):
    # the blocks' share is the formula's
    pp, m = sizes["pp", "", "explicit", "1f1b"], BASE.batch // BASE.microbatches
    blocks = {p: 2 * (BASE.layers // 2) * block_saved_elements(BASE, p) * m * BASE.seq * 8 for p in POLICIES}
    assert pp == {p: blocks[p] + 2 * (m * BASE.seq + BASE.seq) * 8 for p in POLICIES}, pp


def test_theory_matches_single_device_and_flops():
    """The formula on one device, from the reference model itself (no launch), with SDPA's CPU flash
    kernel (what runs) and its math backend (the T×T softmax saved), and the FLOPs' shape."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from shared.problem import make_problem
    from torch_impl.harness import SavedTensorMeter
    from torch_impl.model import build_model, inputs, loss_fn, targets

    cfg = BASE.replace(world_size=1)
    problem = make_problem(cfg)
    grads = {}
    for policy in POLICIES:
        for attention in ("flash", "math"):
            c = cfg.replace(recompute=policy)
            model = build_model(c, problem)
            meter = SavedTensorMeter(list(model.parameters()))
            with meter.recording(), sdpa_kernel(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext():
                loss_fn(model(inputs(c, problem)), targets(c, problem)).backward()
            expected = activation_bytes(c, attention=attention)
            assert meter.peak == expected, (policy, attention, meter.peak, expected)
            if attention == "flash":
                grads[policy] = [p.grad for p in model.parameters()]
    # the same ops on the same inputs, in one process (same kernels, threads and alignment): the same
    # bits on any machine; recomputation reorders no sum
    for policy in ("selective", "full"):
        assert all(torch.equal(a, b) for a, b in zip(grads[policy], grads["none"])), policy
    flops = {p: recompute_extra_flops(cfg, p) for p in POLICIES}
    assert flops["none"]["extra"] == 0 < flops["selective"]["extra"] < flops["full"]["extra"] < flops["full"]["step"]


def test_jax_sample_parity_and_residuals(sample):
    _check(sample["jax"], "jax")  # full vs the reference that does not recompute
    residuals = {p: jax_residual_bytes(BASE, p) for p in POLICIES}
    assert residuals["full"] < residuals["selective"] < residuals["none"], residuals


def jax_residual_bytes(cfg: Config, policy: str) -> int:
    """Bytes of the residuals jax.vjp keeps for the backward of the single-device loss (the leaves of
    its vjp function other than the parameters): what JAX's autodiff saves, before XLA schedules it.
    Traced by jax.eval_shape: nothing is compiled or run."""
    import jax
    import jax.numpy as jnp

    from jax_impl import transformer
    from jax_impl.model import output_loss
    from shared.problem import make_problem

    problem = make_problem(cfg)
    x, y = jnp.asarray(problem.inputs), jnp.asarray(problem.targets)

    def residuals(params):
        with transformer.recomputing(policy):
            _, vjp = jax.vjp(lambda ps: output_loss(transformer.apply(ps, x, cfg.head_dim), y), params)
        weights = {id(a) for a in jax.tree.leaves(params)}
        return [leaf for leaf in jax.tree.leaves(vjp) if id(leaf) not in weights]

    shapes = jax.eval_shape(residuals, {k: jnp.asarray(v) for k, v in problem.params.items()})
    return sum(s.size * s.dtype.itemsize for s in shapes)


def test_mlp_refuses_recompute():
    with pytest.raises(ValueError, match="the mlp has no blocks to recompute"):
        Config(recompute="full")
    with pytest.raises(ValueError, match="recompute must be one of"):
        Config(model="transformer", recompute="some")


@pytest.mark.slow
def test_every_pattern_recomputes():
    """Every pattern, both frameworks (torch: every variant and policy; JAX: each pattern's main shard_map
    variant, selective) at world size 2 (mesh: 1-axis layouts).
    The torch launch runs in a thread while this process compiles JAX's steps. JAX runs selective, the
    policy with a pattern-dependent save list (full wraps the same block function whole: dp's full runs in
    the default tier): its "none" step is each pattern's own transformer step, which the pattern's test
    module compares with one device, and JAX's ordering of the policies is checked on the residuals
    (test_jax_sample_parity_and_residuals) — compiling them again here would prove nothing new (and cost
    the slow tier's budget, issue 37)."""
    from jax_impl.harness import run_pattern as jax_run_pattern

    with ThreadPoolExecutor(max_workers=1) as pool:
        torch_out = pool.submit(launch, _torch_rank, 2, [(p, _cfgs(p), None) for p in EVERY])
        # JAX: each pattern's main shard_map variant (the policy wraps the block; the variants differ in their
        # collectives, which the pattern's own module checks): every variant cost ~100 s more (issue 46)
        jax_entries = {p: jax_run_pattern(p, [c for c in _cfgs(p) if c.recompute == "selective"],
                                          [("shard_map", TOUR[p]["shard_map"])] if p in TOUR else None)
                       for p in EVERY}
        torch_entries = torch_out.result()[0]
    _check(jax_entries, "jax")
    sizes = _check(torch_entries, "torch")
    for key, by_policy in sizes.items():
        if key[:1] == ("fsdp",) and key[3] == "zero3":
            continue  # explicit ZeRO-3's own saved-tensor hooks hide what is saved inside it from the meter
        assert by_policy["full"] < by_policy["selective"] < by_policy["none"], (key, by_policy)
