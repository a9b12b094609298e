"""The precision-sensitive torch runs on one vector path, as a script: ``ATEN_CPU_CAPABILITY=avx2 python
tests/cpu_paths.py`` (issue 51). torch picks its CPU kernels (and with them the blocking and the order in
which a dot product is summed) by the capability it finds: AVX-512 here, AVX2 on an AMD EPYC of the Zen 2/3
kind, the scalar "default" path elsewhere. A tolerance fitted to one machine's rounding fails on another;
forcing the path here makes that failure happen on this machine first (tests/test_cpu_paths.py, slow).

One launch of 2 gloo ranks runs every pattern's precision-sensitive configurations at the default tier's
sizes — mixed precision in bfloat16 and float16 (judged by the measured floors: shared/tolerances.py) and
pure float32 (FLOAT32) — and prints one JSON object: the capability torch ran with and, per run, its verdict
and errors.
"""

from __future__ import annotations

import json
import sys

from shared.config import Config
from shared.results import make_result

TINY = Config(world_size=2, model="transformer", layers=2, dim=16, heads=4, seq=8, vocab=32, batch=8, steps=3)
MIXED = [TINY.replace(dtype=dt, precision="mixed") for dt in ("bfloat16", "float16")]
F32 = [TINY.replace(dtype="float32")]
JOBS = {  # pattern: (configurations, the variants that round differently: the others repeat them bit for bit)
    "dp": (MIXED, [("explicit", "bucketed")]),  # dp on 2 ranks IS the floor's split run
    "fsdp": (MIXED + F32, [("explicit", "zero3"), ("explicit", "zero2"), ("builtin", "fsdp2")]),
    "tp": (MIXED + F32, [("explicit", "megatron"), ("builtin", "dtensor_sp")]),  # dtensor = megatron, bit for bit
    "cp": (MIXED + F32, [("explicit", "ring"), ("explicit", "ring_zigzag"), ("explicit", "ulysses")]),
    "pp": (MIXED, [("explicit", "1f1b"), ("builtin", "gpipe")]),  # every schedule sums the same micro-batches
}


def _rank(ctx):
    import torch

    from torch_impl.harness import run_pattern

    out = {pattern: run_pattern(ctx, pattern, cfgs, {cfg: chosen for cfg in cfgs})
           for pattern, (cfgs, chosen) in JOBS.items()}
    return None if out["dp"] is None else {"capability": torch.backends.cpu.get_cpu_capability(), "runs": out}


def main() -> int:
    from torch_impl.launch import launch

    answer = launch(_rank, 2)[0]
    rows = []
    for pattern, entries in answer["runs"].items():
        for entry in entries:
            cfg = entry["cfg"]
            for style, variant, trained in entry["runs"]:
                ref = entry.get("references", {}).get(variant, entry["reference"])  # FSDP's casts: its own
                row = make_result(pattern, "torch", style, variant, cfg, trained, ref)
                rows.append({"pattern": pattern, "style": style, "variant": variant, "dtype": cfg.dtype,
                             "precision": cfg.precision, "ok": row.ok,
                             "errors": {k: getattr(row, k) for k in ("max_rel_err_loss", "max_rel_err_grad",
                                                                      "max_rel_err_param")},
                             "mixed": row.extra.get("mixed")})
    json.dump({"capability": answer["capability"], "rows": rows}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
