"""Context parallelism: every variant of both frameworks against the single-device reference of its
own framework and of the other one, the ledger against shared.theory.cp_comm, the per-rank
attention work (ring unbalanced, zigzag balanced), the layout, and activation memory per rank
(torch: saved-for-backward bytes against a formula; JAX: XLA's temp bytes shrinking with cp, slow).

One module-scoped fixture: one torch launch per world size (in a thread) while this process
compiles the JAX steps. The transformer at layers=2, dim=16, heads=4, seq=16 (2·cp | T for
ring_zigzag at cp = 2 and 4), vocab=32, batch=2. torch: float64 at cp = 2 and 4, float32 at
cp = 2. JAX: float64 at cp = 4 (every JAX transformer step costs seconds to compile; cp = 2 runs
in the slow test). torch's builtin ``context_parallel`` runs on CUDA only
(torch_impl.cp.BUILTIN_REFUSAL): its test is marked gpu.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from typed_expect import stated_kinds

from jax_impl import cp as jax_cp
from jax_impl.harness import _reference as jax_reference
from jax_impl.harness import run_pattern as jax_run_pattern
from jax_impl.parallel.typed import summarize
from shared.config import Config
from shared.problem import make_problem
from shared.results import comm_bytes, cross_framework_ok, make_result, parity, within
from shared.theory import cp_attention_scores, cp_comm, cp_comm_bytes, cp_positions
from torch_impl import cp as torch_cp
from torch_impl import harness as torch_harness
from torch_impl.harness import run_pattern as torch_run_pattern
from torch_impl.launch import launch
from torch_impl.model import build_model, inputs, loss_fn, targets

WORLD_SIZES = (2, 4)
JAX_WORLD_SIZES = (4,)  # each JAX transformer step costs seconds to compile: cp = 2 is in the slow test
RING = ("ring", "ring_zigzag")


def _cfgs(ws: int, dtypes=("float64",)) -> list[Config]:
    return [Config(world_size=ws, model="transformer", layers=2, dim=16, heads=4, seq=16, vocab=32, batch=2,
                   steps=3, dtype=dt) for dt in dtypes]


MIXED_VARIANTS = [("explicit", "ring"), ("explicit", "ulysses")]  # ring_zigzag: test_cli's slow torch sweep


F16_VARIANTS = [("explicit", "ring")]  # float16 (loss scaling): test_float16


def _torch_cfgs(ws: int) -> list[Config]:
    mixed = [_cfgs(ws)[0].replace(dtype=dt, precision="mixed") for dt in ("bfloat16", "float16")] if ws == 2 else []
    return _cfgs(ws, ("float64", "float32") if ws == 2 else ("float64",)) + mixed  # mixed: test_mixed_precision


@pytest.fixture(scope="module")
def runs():
    """{ws: {"torch": [entry…], "jax": [entry…]}}, entries as the harnesses return them. The torch
    launches (one per world size) run in a thread while this process compiles the JAX steps: the
    ranks mostly start up and wait, XLA compiles on one core."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        torch_out = pool.submit(lambda: {ws: launch(torch_run_pattern, ws, "cp", _torch_cfgs(ws), {
            cfg: F16_VARIANTS if cfg.dtype == "float16" else MIXED_VARIANTS
            for cfg in _torch_cfgs(ws) if cfg.precision == "mixed"})[0] for ws in WORLD_SIZES})
        # JAX at cp = 4 only (its cp = 2 runs, and temp bytes at a size where activations dominate:
        # the slow test below); torch at both
        jax_out = {ws: jax_run_pattern("cp", _cfgs(ws)) if ws in JAX_WORLD_SIZES else [] for ws in WORLD_SIZES}
        torch_out = torch_out.result()
    return {ws: {"torch": torch_out[ws], "jax": jax_out[ws]} for ws in WORLD_SIZES}


def _all_runs(runs):
    for ws in WORLD_SIZES:
        for fw in ("torch", "jax"):
            for entry in runs[ws][fw]:
                cfg = entry["cfg"]
                if cfg.precision == "mixed":  # its own test: test_mixed_precision
                    continue
                for style, variant, trained in entry["runs"]:
                    yield fw, cfg, style, variant, trained, entry["reference"]


def test_every_variant_runs(runs):
    names = {(fw, s, v, cfg.world_size, cfg.dtype) for fw, cfg, s, v, *_ in _all_runs(runs)}
    explicit = set(torch_cp.VARIANTS[:3])  # the builtin runs on CUDA only (its gpu test below)
    for ws, dt in ((2, "float64"), (4, "float64"), (2, "float32")):
        assert {(s, v) for fw, s, v, w, d in names if fw == "torch" and (w, d) == (ws, dt)} == explicit
    for ws in JAX_WORLD_SIZES:
        assert {(s, v) for fw, s, v, w, _ in names if fw == "jax" and w == ws} == set(jax_cp.VARIANTS)


def test_parity_with_own_reference(runs):
    for fw, cfg, style, variant, trained, ref in _all_runs(runs):
        errors = parity(trained, ref)
        assert within(errors, cfg.dtype), (fw, style, variant, cfg.world_size, cfg.dtype, errors)


def test_parity_with_other_framework(runs):
    """torch vs JAX's reference and JAX vs torch's, float64 (1e-12 · 2). torch's float32 runs are
    held against JAX's float64 reference at the float32 cross-framework tolerance (their float32
    round-off, ~1e-6, is what the tolerance is for; it saves compiling a float32 JAX reference)."""
    torch_refs = {e["cfg"]: e["reference"] for ws in WORLD_SIZES for e in runs[ws]["torch"]}
    for fw, cfg, style, variant, trained, _ in _all_runs(runs):
        other = jax_reference(cfg.replace(dtype="float64"), "auto") if fw == "torch" else torch_refs[cfg]
        errors = parity(trained, other)
        assert cross_framework_ok(errors, cfg.dtype), (fw, style, variant, cfg.world_size, cfg.dtype, errors)


def test_ledger_matches_theory(runs):
    """torch explicit: exact per-op counts and bytes (a send's message counted on the sender, its
    receive mirrored). JAX shard_map: collective-permutes == theory's sends, all-to-alls exact,
    the gradient all-reduce's payload Φ·b (XLA's combiner sets the count)."""
    for _, cfg, style, variant, trained, _ in _all_runs(runs):
        theory = {op: {"count": c, "bytes": b} for op, (c, b) in cp_comm(cfg, variant).items()} \
            if style in ("explicit", "shard_map") else None
        if style == "explicit":
            expected = dict(theory, **({"recv": theory["send"]} if variant in RING else {}))
            assert trained.comm == expected, (variant, cfg.world_size, cfg.dtype, trained.comm)
            assert comm_bytes(trained.comm) == trained.comm_theory == cp_comm_bytes(cfg, variant)
        elif style == "shard_map":
            comm = dict(trained.comm)
            assert comm.pop("all_reduce")["bytes"] == theory.pop("all_reduce")["bytes"], (variant, trained.comm)
            if "send" in theory:
                theory["collective_permute"] = theory.pop("send")
            assert {op: v for op, v in comm.items() if op != "recv"} == theory, (variant, cfg.world_size, trained.comm)


def test_attention_work_per_rank(runs):
    """Score entries per rank and layer in forward: ring rank r does r+1 blocks of (T/N)², zigzag
    2N+1 chunk pairs of (T/2N)² everywhere, ulysses the causal T×T for H/N heads; the layout each
    rank trained on is theory's."""
    for fw, cfg, style, variant, trained, _ in _all_runs(runs):
        if style in ("explicit", "shard_map"):
            assert trained.extra["attention_scores"] == cp_attention_scores(cfg, variant), (fw, variant)
        if fw == "torch":
            n = cfg.world_size
            assert trained.extra["positions"] == [cp_positions(cfg.seq, n, r, variant) for r in range(n)]
    for ws in WORLD_SIZES:
        for variant in RING:
            work = cp_attention_scores(_cfgs(ws)[0], variant)
            assert (max(work) == min(work)) == (variant == "ring_zigzag"), (variant, work)


@functools.lru_cache(maxsize=4)
def _single_device_activation_bytes(cfg: Config) -> int:
    """Peak saved-for-backward bytes of the single-device step, measured as the harness does."""
    problem = make_problem(cfg)
    model = build_model(cfg, problem)
    meter = torch_harness.SavedTensorMeter(list(model.parameters()))
    with meter.recording():
        loss_fn(model(inputs(cfg, problem)), targets(cfg, problem)).backward()
    return meter.peak


def test_activation_bytes_per_rank(runs):
    """Saved-for-backward bytes per rank (the harness's SavedTensorMeter) against the single-device
    step's, S. Every activation is per token, and ring attention saves q, k, v, out, lse of the
    local tokens as SDPA does of all of them, so a ring rank holds (S − b)/N + b (b: the loss's
    0-d total weight, not per token). Ulysses also saves, per layer, the all-to-all's output that
    feeds W_o, B·(T/N)·D·b (on one device W_o's input is SDPA's output itself). Measured equal on
    torch 2.13; asserted as an upper bound (a torch whose SDPA output W_o cannot view only grows S)."""
    for fw, cfg, _, variant, trained, _ in _all_runs(runs):
        if fw != "torch":
            continue
        n, b = cfg.world_size, cfg.bytes_per_element
        full = _single_device_activation_bytes(cfg.replace(world_size=1))
        w_o_input = cfg.layers * cfg.batch * cfg.seq // n * cfg.dim * b if variant == "ulysses" else 0
        bound = (full - b) // n + b + w_o_input
        got = trained.extra["activation_bytes"]
        assert got <= bound < full, (variant, n, cfg.dtype, got, bound, full)


def test_mixed_precision(runs):
    """--precision mixed, torch, ring and ulysses at cp=2: ok against the single-device run under
    the same autocast within its measured floor × the factor (shared.tolerances; the rings': 32), float32
    state, and the ledger in the dtype each message has: K|V and ulysses' all-to-alls in bf16, the
    ring's dK|dV accumulators and the gradient all-reduce in float32 (cp_comm(autocast=True))."""
    (entry,) = [e for e in runs[2]["torch"] if e["cfg"].dtype == "bfloat16"]
    cfg = entry["cfg"]
    assert [(s, v) for s, v, _ in entry["runs"]] == MIXED_VARIANTS
    for style, variant, trained in entry["runs"]:
        row = make_result("cp", "torch", style, variant, cfg, trained, entry["reference"])
        assert row.ok and row.precision == "mixed", (variant, row.extra["mixed"], parity(trained, entry["reference"]))
        theory = {op: {"count": c, "bytes": b} for op, (c, b) in cp_comm(cfg, variant, autocast=True).items()}
        assert trained.comm == dict(theory, **({"recv": theory["send"]} if variant in RING else {})), trained.comm
        assert comm_bytes(trained.comm) == trained.comm_theory < cp_comm_bytes(  # < all float32
            cfg.replace(precision="pure", dtype="float32"), variant)
        phi = cfg.n_params
        assert trained.state_bytes == {"params": 4 * phi, "grads": 4 * phi, "optimizer": 8 * phi}, trained.state_bytes


def test_float16(runs):
    """--precision mixed --dtype float16, torch ring at cp=2: dynamic loss scaling (share=cp: each rank's
    local mean scaled by scale/cp); ok against the single-device float16 run (the same scaler) within its
    floor × the ring factor, the same skipped steps and scale, and the ledger: + one 4-byte all-reduce
    (the found-inf flag) on top of the bf16 layout's bytes."""
    (entry,) = [e for e in runs[2]["torch"] if e["cfg"].dtype == "float16"]
    cfg, ref = entry["cfg"], entry["reference"]
    assert [(s, v) for s, v, _ in entry["runs"]] == F16_VARIANTS
    for style, variant, trained in entry["runs"]:
        row = make_result("cp", "torch", style, variant, cfg, trained, ref)
        assert row.ok and row.dtype == "float16", (variant, row.extra["mixed"], parity(trained, ref))
        assert trained.extra["skipped_steps"] == ref.extra["skipped_steps"] and "loss_scale" in trained.extra
        assert comm_bytes(trained.comm) == trained.comm_theory == cp_comm_bytes(cfg, variant, autocast=True) + 4


@pytest.mark.slow
def test_jax_cp2_parity_and_temp_bytes_shrink_with_cp():
    """JAX at cp = 2 (the fast suite runs cp = 4), at a size where activations dominate XLA's
    scratch (L=2, D=32, T=64, B=8): every variant matches its reference, and its temp bytes per
    device (memory_analysis().temp_size_in_bytes) shrink from cp = 2 to cp = 4."""
    temp = {}
    for ws in WORLD_SIZES:
        cfg = Config(world_size=ws, model="transformer", layers=2, dim=32, heads=4, seq=64, vocab=32, batch=8,
                     steps=2)
        (entry,) = jax_run_pattern("cp", [cfg])
        for style, variant, trained in entry["runs"]:
            assert within(parity(trained, entry["reference"]), cfg.dtype), (ws, style, variant)
            temp[ws, style, variant] = trained.extra["temp_bytes"]
    for (ws, s, v), t in temp.items():
        if ws == 2:
            assert temp[4, s, v] < t, (s, v, t, temp[4, s, v])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_builtin_context_parallel_on_gpu():
    """torch's context_parallel (NCCL, float32, head-tail load balancing = the zigzag layout)."""
    cfg = Config(world_size=2, model="transformer", layers=2, dim=32, heads=4, seq=16, vocab=32, batch=2, steps=3,
                 dtype="float32")
    entry = launch(torch_run_pattern, 2, "cp", [cfg], [("builtin", "context_parallel")], device="gpu")[0][0]
    (_, _, trained), = entry["runs"]
    assert within(parity(trained, entry["reference"]), cfg.dtype), parity(trained, entry["reference"])
    assert trained.extra["positions"] == [cp_positions(cfg.seq, 2, r, "ring_zigzag") for r in range(2)]


def test_builtin_refused_where_it_cannot_run():
    """On gloo/CPU (and in float64 anywhere) the builtin is not offered, and asked for by name it is
    refused with the reason, before any work."""
    cfg = _cfgs(2)[0]
    assert ("builtin", "context_parallel") not in torch_cp.variants(cfg)
    with pytest.raises(ValueError, match="needs CUDA"):
        torch_cp.train(cfg, None, "builtin", "context_parallel", None)


@pytest.mark.parametrize(("changes", "message"), [
    (dict(seq=12), r"cp \(transformer\): seq=12 is not divisible by zigzag_chunks=8"),
    (dict(seq=18), r"seq=18 is not divisible by world_size=4"),
    (dict(heads=2, dim=16), r"heads=2 is not divisible by world_size=4"),
    (dict(model="mlp"), r"cp: the mlp has no sequence to split"),
])
def test_bad_sizes_are_rejected_before_any_process(changes, message):
    cfg = Config(**{**dict(world_size=4, model="transformer", dim=16, heads=4, seq=16), **changes})
    with pytest.raises(ValueError, match=message):
        cfg.check("cp")


def test_jax_layout_and_xla_choice(runs):
    """JAX: every device trained on theory's positions; jit/seq_sharded's (and typed/seq_sharded's,
    whose program states reshard(k, P()), reshard(v, P())) collectives are what XLA
    was seen to choose (jax_impl.cp.seq_sharded_comm: forward all-gathers of K and V per layer,
    backward all-reduces of the whole-sequence dK, dV with the gradients), exact op for op
    except the all-reduce count (XLA's combiner)."""
    for fw, cfg, style, variant, trained, _ in _all_runs(runs):
        if fw != "jax":
            continue
        n, kind = cfg.world_size, "ring_zigzag" if variant == "ring_zigzag" else "ring"
        assert trained.extra["positions"] == [cp_positions(cfg.seq, n, r, kind) for r in range(n)], variant
        if (style, variant) == ("typed", "ulysses"):  # four stated token <-> head reshards per layer: theory's
            theory = {op: {"count": c, "bytes": b} for op, (c, b) in cp_comm(cfg, variant).items()}  # all-to-alls
            assert stated_kinds(trained) == {"all-to-all": 4 * cfg.layers}, trained.extra["stated"]
            assert trained.comm["all_to_all"] == theory["all_to_all"], trained.comm
            assert trained.comm["all_reduce"]["bytes"] == theory["all_reduce"]["bytes"] + cfg.bytes_per_element
            assert comm_bytes(trained.comm) == trained.comm_theory, trained.comm
            continue
        if style == "typed":  # sharding in types: XLA chose as for jit (CPU); K and V gathers stated per layer
            assert stated_kinds(trained) == {"gather": 2 * cfg.layers, "slice": cfg.layers}, trained.extra["stated"]
            assert summarize(trained.extra["stated"])["gather"] == trained.comm["all_gather"]  # one each, same bytes
        if style in ("jit", "typed"):
            (n_ag, ag), (_, ar) = jax_cp.seq_sharded_comm(cfg)["all_gather"], jax_cp.seq_sharded_comm(cfg)["all_reduce"]
            assert set(trained.comm) == {"all_gather", "all_reduce"}, trained.comm
            assert trained.comm["all_gather"] == {"count": n_ag, "bytes": ag}, trained.comm
            assert trained.comm["all_reduce"]["bytes"] == ar, trained.comm
            assert comm_bytes(trained.comm) == trained.comm_theory, trained.comm
