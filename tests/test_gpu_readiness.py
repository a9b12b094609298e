# ruff: noqa: E501  (the HLO lines are kept verbatim, as XLA prints them)
"""GPU readiness without a GPU (issue 25): everything about a CUDA run that a CPU machine can check.

- one CUDA stack: the gpu extra's JAX plugin on torch's CUDA major (a resolver report, canned here;
  resolved for real from PyPI under ``-m slow``);
- every row says where it ran, and --device gpu refuses in one line instead of falling back;
- the cuDNN flag mix that made torch 2.13 raise on a legacy read, reproduced, and the fix;
- the JAX ledger's HLO parser on GPU-form text (async -start/-done pairs, combined tuples,
  scalar collective-permutes, reduce-scatters XLA:GPU forms out of all-reduces);
- every JAX pattern's step lowered for the cuda platform (StableHLO, no device needed), so no
  CPU-only construct hides in a program.
"""

import importlib
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the cuDNN flag mix (item 7) ------------------------------------------------------------------------

def _python(code: str) -> subprocess.CompletedProcess:
    """Torch's precision flags are process-global: each check gets a fresh interpreter."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


LEGACY_READS = "import torch\nprint(torch.backends.cudnn.allow_tf32)\nwith torch.backends.cudnn.flags(enabled=True):\n    pass\n"


def test_cudnn_new_api_then_legacy_read_raises_on_this_torch():
    """What torch_impl.launch did before: matmul then cuDNN conv through the new API; any later
    legacy read (library code enters cudnn.flags()) raised. If this stops raising, torch fixed it."""
    out = _python("import torch\ntorch.backends.cuda.matmul.fp32_precision = 'ieee'\n"
                  "torch.backends.cudnn.conv.fp32_precision = 'ieee'\n" + LEGACY_READS)
    assert out.returncode != 0 and "mix of the legacy and new APIs" in out.stderr, out.stderr[-500:]


def test_float32_ieee_leaves_legacy_reads_working():
    out = _python("import torch\nfrom torch_impl.launch import set_float32_ieee\nset_float32_ieee()\n"
                  "assert torch.backends.cuda.matmul.fp32_precision == 'ieee'\n"
                  "assert not torch.backends.cuda.matmul.allow_tf32\n" + LEGACY_READS)
    assert out.returncode == 0, out.stderr[-500:]


# --- one CUDA stack (item 1) ----------------------------------------------------------------------------

def cuda_majors(report: dict) -> dict[str, set[int]]:
    """{"torch": majors, "jax": majors} of the CUDA packages a pip ``--report`` installs, from their
    names (nvidia-*-cu13, jax-cuda13-plugin) and the toolkit / runtime versions (cuda-toolkit 13.0.3,
    nvidia-cuda-runtime 13.0.96). Other nvidia-* versions are the libraries' own (cufft 12.0 ships
    with CUDA 13), not CUDA's. Which framework a package serves: jax-cuda* are JAX's, the rest
    (cuda-toolkit, nvidia-*) are what both load (libcudnn.so.9, libnccl.so.2)."""
    out: dict[str, set[int]] = {"torch": set(), "jax": set()}
    for item in report["install"]:
        name, version = item["metadata"]["name"].lower(), item["metadata"]["version"]
        if m := re.fullmatch(r"jax-cuda(\d+)-(plugin|pjrt)", name):
            out["jax"].add(int(m.group(1)))
        elif m := re.fullmatch(r"nvidia-[a-z0-9-]+-cu(\d+)", name):
            out["torch"].add(int(m.group(1)))
        elif name in ("cuda-toolkit", "nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12"):
            out["torch"].add(int(version.split(".")[0]))
    return out


def _report(*pairs):
    return {"install": [{"metadata": {"name": n, "version": v}} for n, v in pairs]}


def test_cuda_majors_from_a_report():
    ok = _report(("torch", "2.14.1"), ("cuda-toolkit", "13.0.3.0"), ("nvidia-cudnn-cu13", "9.24.0.43"),
                 ("nvidia-nccl-cu13", "2.30.7"), ("nvidia-cufft", "12.0.0.61"), ("jax-cuda13-plugin", "0.10.2"),
                 ("jax-cuda13-pjrt", "0.10.2"))
    assert cuda_majors(ok) == {"torch": {13}, "jax": {13}}
    mixed = _report(("cuda-toolkit", "13.0.3.0"), ("nvidia-cudnn-cu13", "9.24"), ("nvidia-cudnn-cu12", "9.10"),
                    ("jax-cuda12-plugin", "0.10.2"))
    assert cuda_majors(mixed) == {"torch": {12, 13}, "jax": {12}}


def test_gpu_extra_names_torchs_cuda_major():
    """pyproject's gpu extra names jax[cuda13]: torch >= 2.13 on PyPI is built for CUDA 13."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["gpu"]
    assert extra == ["jax[cuda13]>=0.8"], extra


@pytest.mark.slow
def test_gpu_extra_resolves_to_one_cuda_major(tmp_path):
    """pip resolves .[gpu] for a Linux x86-64 GPU node without installing (about a minute, needs
    PyPI): torch's CUDA packages and JAX's plugin agree on one major."""
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                          "--report", str(report), f"{ROOT}[gpu]"], capture_output=True, text=True, timeout=600)
    if out.returncode != 0 and re.search(r"(?i)connection|network|resolve host|timed out", out.stderr):
        pytest.skip("PyPI unreachable: " + out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0, out.stderr[-2000:]
    majors = cuda_majors(json.loads(report.read_text()))
    assert len(majors["torch"]) == 1 and majors["jax"] == majors["torch"], majors


# --- every run says where it ran (item 2) -------------------------------------------------------------------

def test_where_line():
    from shared.results import RunResult

    def row(fw, platform, backend, devices, fallback=None):
        return RunResult("dp", fw, "s", "v", len(devices), "float64", True, platform=platform, backend=backend,
                         devices=devices, fallback=fallback)

    from shared.results import where_line

    assert where_line([row("torch", "cpu", "gloo", ["cpu", "cpu"]), row("jax", "cpu", None, ["cpu:0", "cpu:1"])]) \
        == "torch: gloo on cpu · jax: cpu"
    assert where_line([row("torch", "cuda", "nccl", ["cuda:0", "cuda:1"]), row("jax", "cuda", None, ["cuda:0", "cuda:1"])]) \
        == "torch: nccl on cuda ×2 · jax: cuda ×2"
    line = where_line([row("jax", "cpu", None, ["cpu:0"], "jax: 1 GPU(s) for 2 devices, so the CPU")])
    assert line == "jax: cpu (auto fell back: jax: 1 GPU(s) for 2 devices, so the CPU)"


def test_device_gpu_refuses_in_one_line_without_a_gpu():
    from jax_impl.devices import platform
    from torch_impl.launch import fallback_reason, resolve_device

    for refuse in (lambda: resolve_device("gpu", 2), lambda: platform("gpu", 2)):
        with pytest.raises(ValueError) as err:
            refuse()
        assert str(err.value).startswith("--device gpu") and "\n" not in str(err.value), err.value
    assert resolve_device("auto", 2) == "cpu" and fallback_reason("auto", 2) is None  # no GPU: not a fallback
    assert platform("auto", 2) == "cpu"


def test_jax_rows_record_the_mesh_devices():
    import jax

    from jax_impl.devices import where

    w = where(jax.devices("cpu")[:2])
    fast = "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")  # the suite's (conftest.py)
    assert w == {"platform": "cpu", "backend": "XLA -O0" if fast else None, "devices": ["cpu:0", "cpu:1"],
                 "fallback": None}


# --- the ledger on GPU-form HLO (item 5) -------------------------------------------------------------------
# Lines as XLA:GPU prints them (async pairs, combined tuples); counts per call, bytes = nccl-tests' size S.

GPU_HLO = """
HloModule step, num_partitions=4
%wrapped_reduce_scatter (p: f32[8]) -> f32[2] {
  %rs = f32[2]{0} reduce-scatter(f32[8]{0} %p), channel_id=5, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
}
ENTRY %main {
  %ag-start = (f32[4]{0}, f32[16]{0}) all-gather-start(f32[4]{0} %a), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}
  %ag-done = f32[16]{0} all-gather-done((f32[4]{0}, f32[16]{0}) %ag-start)
  %ag2-start = ((f32[4]{0}, bf16[2]{0}), (f32[16]{0}, bf16[8]{0})) all-gather-start(f32[4]{0} %b, bf16[2]{0} %c), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  %ag2-done = (f32[16]{0}, bf16[8]{0}) all-gather-done(((f32[4]{0}, bf16[2]{0}), (f32[16]{0}, bf16[8]{0})) %ag2-start)
  %ar-start = (f32[32]{0}, f32[8]{0}, f32[]) all-reduce-start(f32[32]{0} %g1, f32[8]{0} %g2, f32[] %l), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add
  %ar-done = (f32[32]{0}, f32[8]{0}, f32[]) all-reduce-done((f32[32]{0}, f32[8]{0}, f32[]) %ar-start)
  %cp-start = (f32[], f32[], u32[], u32[]) collective-permute-start(f32[] %s), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cp-done = f32[] collective-permute-done((f32[], f32[], u32[], u32[]) %cp-start)
  %cp2-start = (f32[2,4]{1,0}, f32[2,4]{1,0}, u32[], u32[]) collective-permute-start(f32[2,4]{1,0} %k), channel_id=6, source_target_pairs={{0,1},{1,0}}
  %cp2-done = f32[2,4]{1,0} collective-permute-done((f32[2,4]{1,0}, f32[2,4]{1,0}, u32[], u32[]) %cp2-start)
  %rs-start = ((f32[8]{0}), f32[2]{0}) async-start(f32[8]{0} %g3), calls=%wrapped_reduce_scatter
  %rs-done = f32[2]{0} async-done(((f32[8]{0}), f32[2]{0}) %rs-start)
  %rs2 = (f32[2]{0}, f32[4]{0}) reduce-scatter(f32[8]{0} %x, f32[16]{0} %y), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
  %a2a-start = ((f32[4,2]{1,0}), f32[4,2]{1,0}) all-to-all-start(f32[4,2]{1,0} %t), channel_id=8, replica_groups={{0,1,2,3}}, dimensions={0}
  %a2a-done = f32[4,2]{1,0} all-to-all-done(((f32[4,2]{1,0}), f32[4,2]{1,0}) %a2a-start)
}
"""


def test_ledger_reads_gpu_form_hlo():
    from jax_impl.ledger import comm_from_hlo

    assert comm_from_hlo(GPU_HLO) == {
        # one plain start/done pair (16·4 B gathered) + one combined pair (16·4 + 8·2 B): 2 calls
        "all_gather": {"count": 2, "bytes": 64 + 64 + 16},
        # the combiner's one call: two gradients and the scalar loss (32·4 + 8·4 + 4 B)
        "all_reduce": {"count": 1, "bytes": 128 + 32 + 4},
        # the scalar message keeps its 4 bytes (the u32[] contexts are not the message) + 2·4·4 B
        "collective_permute": {"count": 2, "bytes": 4 + 32},
        # the async wrapper's inner reduce-scatter (input 8·4 B) and a combined one (inputs (2 + 4)·4·4 B)
        "reduce_scatter": {"count": 2, "bytes": 32 + 96},
        "all_to_all": {"count": 1, "bytes": 32},
    }


# --- every JAX step lowered for CUDA (item 4) ---------------------------------------------------------------

class _Captured(Exception):
    """Raised by the stand-in train_loop with the pattern's Setup: the step, never run."""


def _steps(every: bool = True):
    """(pattern, cfg, style, variant, module) for every JAX pattern and layout compare.py runs at
    world size 4 on the transformer (every pattern's default layout, and three 2-D mesh layouts);
    ``every=False``: the MLP where a pattern has it (the transformer-only cp, ep, and one mesh layout otherwise)."""
    from parallel_twins import cli as compare
    from parallel_twins.args import cfgs_for
    from shared.config import PATTERNS

    small = ["--world-size", "4", "--steps", "1", "--layers", "4", "--dim", "16", "--batch", "8", "--seq", "16",
             "--vocab", "32", "--microbatches", "4"]
    runs = []
    layouts = "dp=2,tp=2;fsdp=2,tp=2;tp=2,pp=2" if every else "fsdp=2,tp=2"
    for argv, patterns in ((small, [p for p in PATTERNS if p not in ("collectives", "mesh")]),
                           (small[2:] + ["--mesh", layouts, "--model", "transformer"], ["mesh"])):
        cfgs = compare.make_configs(compare.build_parser().parse_args(argv))
        for p in patterns:
            module = importlib.import_module(f"jax_impl.{p}")
            chosen = cfgs_for(cfgs, p)
            # every: the transformer's steps (the MLP's ops are a subset of its: the same step code per style,
            # lowered twice proved nothing new and cost the slow tier ~40 s)
            for cfg in [c for c in chosen if c.model == ("transformer" if every else "mlp")] or chosen[:1]:
                for style, variant in getattr(module, "variants", lambda c, m=module: m.VARIANTS)(cfg):
                    if every or style != "typed" or p not in ("dp", "fsdp"):  # typed dp/fsdp: jit's ops (slow)
                        runs.append((p, cfg, style, variant, module))
    return runs


# The MLP-only subset that ran here is a subset of test_every_jax_step_lowers_for_cuda (slow tier): issue 37's budget.


@pytest.mark.slow
def test_every_jax_step_lowers_for_cuda(monkeypatch):
    """Every pattern × style/variant on the transformer at world size 4 and three mesh layouts."""
    _lower_for_cuda(monkeypatch, every=True, at_least=40)


def _lower_for_cuda(monkeypatch, every: bool, at_least: int):
    """Trace each pattern's step as its train() builds it (the stand-in train_loop stops before any
    compilation) and lower it for the cuda platform: StableHLO for a CUDA device, with no GPU.
    A CPU-only construct (a host callback without a GPU lowering, a CPU custom call) fails here."""
    from shared.problem import make_problem

    def capture(cfg, setup):
        raise _Captured(setup)

    failed, lowered = [], 0
    for pattern, cfg, style, variant, module in _steps(every):
        monkeypatch.setattr(module, "train_loop", capture)
        try:
            module.train(cfg, make_problem(cfg), style, variant, module.mesh_for(cfg, "cpu"))
        except _Captured as got:
            setup = got.args[0]
            try:
                text = setup.step.trace(*setup.state, *setup.batch).lower(lowering_platforms=("cuda",)).as_text()
                assert "stablehlo" in text or "mhlo" in text
                lowered += 1
            except Exception as exc:  # noqa: BLE001 - collected, reported together
                failed.append(f"{pattern} {cfg.model} {cfg.mesh or ''} {style}/{variant}: {str(exc).splitlines()[0]}")
    assert not failed, "\n".join(failed)
    assert lowered >= at_least, lowered  # every step chosen (40 transformer steps at world size 4, today)


# --- the doctor (item 8) ----------------------------------------------------------------------------------

def test_doctor_probes_on_cpu(capsys):
    """On a CPU node it reports what it finds and skips the GPU runs (both probes: separate processes)."""
    from parallel_twins.doctor import doctor_main

    assert doctor_main(["--probe-only"]) == 0
    out = capsys.readouterr().out
    assert '"jax": "0.' in out and '"matmul_fp32_precision": "ieee"' in out and "send back" in out


# --- the device audit (item 3) ----------------------------------------------------------------------------

def test_audit_names_the_tensor_nccl_would_refuse():
    import torch

    from torch_impl.ledger import AuditError, audit_tensors

    cpu = torch.device("cpu")
    audit_tensors("allreduce_", [[torch.zeros(4)], torch.zeros(2, dtype=torch.bfloat16)], cpu)  # fine
    for bad, why in ((torch.zeros(4, 4).t(), "not contiguous"), (torch.zeros(4, device="meta"), "on meta"),
                     (torch.zeros(4, dtype=torch.complex64), "dtype torch.complex64")):
        with pytest.raises(AuditError, match=why):
            audit_tensors("allreduce_", [[bad]], cpu)


def _audited_rank(ctx):
    """Inside a rank under PARALLEL_TWINS_AUDIT=meta: a factory without device= is meta, and a
    collective handed a non-contiguous tensor is refused by the audit."""
    import torch
    import torch.distributed as dist

    from torch_impl.ledger import AuditError

    made = torch.zeros(2).device.type
    x = torch.ones(4, 4, device=ctx.device)
    with ctx.ledger.recording():
        dist.all_reduce(x)
        try:
            dist.all_reduce(x.t())
            refused = False
        except AuditError:
            refused = True
    return made, refused, ctx.ledger.audited


def test_audit_in_a_launch(monkeypatch):
    from torch_impl.launch import launch

    monkeypatch.setenv("PARALLEL_TWINS_AUDIT", "meta")
    assert launch(_audited_rank, 2) == [("meta", True, 1)] * 2  # the refused call is not counted


@pytest.mark.slow
def test_every_torch_pattern_under_the_meta_audit(tmp_path, monkeypatch):
    """Every torch pattern and model, and two mesh layouts, with the default device meta: a tensor
    made without device= fails the run or its parity (tp's heads_perm takes the weight's device)."""
    from parallel_twins import cli as compare

    monkeypatch.setenv("PARALLEL_TWINS_AUDIT", "meta")
    small = ["--frameworks", "torch", "--steps", "2", "--quiet", "--device", "cpu"]
    for argv in (["--world-size", "2", "--patterns", "collectives,dp,fsdp,tp,pp,cp,ep"],
                 ["--model", "transformer", "--mesh", "dp=2,pp=2;fsdp=2,cp=2;dp=2,tp=2"]):
        path = tmp_path / "out.json"
        code = compare.main([*small, *argv, "--json", str(path)])
        data = json.loads(path.read_text())
        assert code == 0, data["errors"] or [r for r in data["runs"] if not r["ok"]]
        assert all(r["extra"].get("audited_collectives", 0) > 0 for r in data["runs"] if r["pattern"] != "collectives")


def test_jit_styles_xla_choices_are_per_platform():
    """XLA:CPU's recorded choices keep their counts and kinds; on cuda only the bytes (the combiner and
    ReduceScatterCreator are free there), the same total, which the table's theory check compares."""
    from jax_impl.cp import seq_sharded_comm
    from jax_impl.ep import gshard_comm
    from shared.config import Config

    cfg = Config(world_size=4, model="transformer", layers=2, dim=16, heads=4, seq=16, vocab=32, batch=8)
    moe = cfg.replace(experts=4, topk=2)
    for choices in (lambda p: seq_sharded_comm(cfg, p), lambda p: gshard_comm(moe, p)):
        cpu, cuda = choices("cpu"), choices("cuda")
        assert "any" not in cpu and list(cuda) == ["any"] and cuda["any"][0] is None
        assert cuda["any"][1] == sum(nbytes for _, nbytes in cpu.values())


# --- measurements that mean the same on a GPU (item 6) ----------------------------------------------------

def test_pipeline_clock_on_cuda_waits_once_per_step(monkeypatch):
    """The explicit pipelines' F/B/W stamps on CUDA are events resolved after one synchronize per
    step (the GPU path, with a stand-in Event: elapsed_time in ms as CUDA's)."""
    import torch

    from torch_impl.pp_schedules import StepClock

    ticks, syncs = iter(range(100)), []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.t = next(ticks)  # "ms" on the stream

        def elapsed_time(self, other):
            return float(other.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(a))
    clock = StepClock(torch.device("cuda", 0), t0=0.0)
    timeline = [{"kind": "F", "start": clock(), "end": clock()}, {"kind": "B", "start": clock(), "end": clock()}]
    assert not syncs
    out = clock.resolve(timeline)
    assert len(syncs) == 1
    stamps = [x - clock.offset for e in out for x in (e["start"], e["end"])]
    assert stamps == pytest.approx([0.001, 0.002, 0.003, 0.004])  # 1 ms per tick after the origin event (tick 0)
    cpu = StepClock(torch.device("cpu"), t0=0.0)
    assert isinstance(cpu(), float) and cpu.resolve(timeline) is timeline


def test_the_driver_counts_the_gpus_torch_sees():
    """compare.py's default world size asks the CUDA driver (no framework loaded before JAX starts its
    GPU backend): the same count torch sees, 0 on a machine without a driver."""
    import torch

    from shared.env import local_gpu_count

    assert local_gpu_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
