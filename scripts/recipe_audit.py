"""The held-out recipe audit (issue 34's first Done-when): a training recipe (global-norm clipping, the
library's and the framework's own; weight-decay masks; frozen parts; per-group learning rates;
schedules; micro-batch accumulation; a Llama-style combination) on models the project does not own,
through every public API of torch_impl/parallel and jax_impl/parallel, float64, 2 ranks / devices, 3
steps, against single-device training with the same recipe. Each case is classified:

    exact 3e-16   parameters within 1e-12 of the reference (the max error shown)
    refused       the project raised ONE error of its own before training (its first line in --json)
    WRONG         trained, and the parameters are off by more than 1e-12: silently wrong
    CRASH         an error that is not the project's refusal (a framework-internal one)
    n/a           the API does not offer the ingredient (e.g. pp's trainer steps inside: no own clip call)

    python scripts/recipe_audit.py --framework torch      # the torch half (one gloo launch of 2 ranks)
    python scripts/recipe_audit.py --framework jax --json # the JAX half, 4 simulated CPU devices
    python scripts/recipe_audit.py --reduced               # one model per framework, fewer cases (slow test)

Models: scripts/recipe_audit_torch.py (transformers' GPT2LMHeadModel, tied embeddings; a residual conv
net), scripts/recipe_audit_jax.py (a GPT-2-like NNX model tied via Embed.attend; a model of nnx.Dict
submodules). The tolerance 1e-12: a correct layout differs from one device only in the order of
float64 sums (measured ~1e-16 relative per op; 3 AdamW steps carry that to ~1e-15); a clipping, mask
or accumulation defect is 1e-6 or more. One parameter is left out: an attention KEY bias (GPT-2's, both
frameworks) has an identically zero gradient (softmax is shift-invariant over the keys), and AdamW's
g / √v turns that zero's round-off into steps of ±lr, so two correct layouts differ there by ~1e-11.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

from recipe_audit_common import classify  # noqa: E402  (scripts/, put on the path above; TOL is there)


def cell(r: dict) -> str:
    return f"exact {r['error']:.0e}" if r["verdict"] == "exact" else (
        f"WRONG {r['error']:.1e}" if r["verdict"] == "WRONG" else r["verdict"])


def table(rows: list[dict]) -> str:
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    width = max(len(f"{r['model']}: {r['api']}") for r in rows) + 1
    lines = [f"{'model: api':<{width}}" + "".join(f"{n:>14}" for n in recipes)]
    for key in dict.fromkeys((r["model"], r["api"]) for r in rows):
        got = {r["recipe"]: r for r in rows if (r["model"], r["api"]) == key}
        lines.append(f"{key[0] + ': ' + key[1]:<{width}}" + "".join(
            f"{cell(got[n]) if n in got else '':>14}" for n in recipes))
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("exact", "refused", "WRONG", "CRASH", "n/a")}
    lines.append("  ".join(f"{k} {v}" for k, v in counts.items()))
    notes = [f"  {r['model']}: {r['api']} × {r['recipe']}: {r['verdict']}: {r['message'].splitlines()[0][:300]}"
             for r in rows if r["verdict"] in ("refused", "CRASH", "n/a")]
    return "\n".join(lines + (["", "messages:"] + notes if notes else []))


def run_jax(reduced: bool) -> list[dict]:
    from shared.env import simulate_host_devices

    simulate_host_devices(4)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from parallel_twins.preflight import CPU_COMPILE_FLAGS, known_xla_flags  # XLA aborts on a flag it does not know

    for flag in known_xla_flags(f for f in CPU_COMPILE_FLAGS
                                if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")):  # compile time
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ["PARALLEL_TWINS_XLA_PROBED"] = "1"  # preflight.PROBED_MARK: known to this XLA
    import recipe_audit_jax as audit

    rows = []
    for model, api, recipe, run in audit.cases(*audit.reduced() if reduced else ()):
        t = time.perf_counter()
        rows.append({"framework": "jax", "model": model, "api": api, "recipe": recipe} | classify(run))
        print(f"{model}: {api} × {recipe}: {cell(rows[-1])} ({time.perf_counter() - t:.1f} s)", file=sys.stderr)
        # every case compiles its own programs: kept, ~350 cases' executables exhaust the process's memory maps
        # (vm.max_map_count 65530: "LLVM compilation error: Cannot allocate memory", then a segfault)
        audit.jax.clear_caches()
    return rows


def run_torch(reduced: bool) -> list[dict]:
    import recipe_audit_torch as audit

    return audit.audit(reduced)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=("torch", "jax", "both"), default="both")
    ap.add_argument("--json", action="store_true", help="one JSON list of rows instead of the table")
    ap.add_argument("--reduced", action="store_true", help="one model per framework, fewer cases (the slow test)")
    args = ap.parse_args(argv)
    start, rows = time.perf_counter(), []
    if args.framework in ("torch", "both"):
        rows += run_torch(args.reduced)
    if args.framework in ("jax", "both"):
        rows += run_jax(args.reduced)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for fw in dict.fromkeys(r["framework"] for r in rows):
            print(f"## {fw}\n" + table([r for r in rows if r["framework"] == fw]) + "\n")
        print(f"{len(rows)} cases in {time.perf_counter() - start:.0f} s")
    return 1 if any(r["verdict"] in ("WRONG", "CRASH") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
