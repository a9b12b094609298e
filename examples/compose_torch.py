"""transformers' ``LlamaForCausalLM`` under N-D composition on one DeviceMesh (issue 33), against the same
model trained on one process. The JAX twin, examples/compose_jax.py, trains the same Llama from the same
NumPy weights (shared/llama.py) with the same data, loss and optimizer, so both write the same losses.

    python examples/compose_torch.py --layout fsdp=2,tp=2,pp=2 --json out.json   # 8 gloo ranks
    python examples/compose_torch.py --layout dp=2,tp=2,cp=2                       # 8 ranks
    python examples/compose_torch.py --layout fsdp=2,tp=2 --style explicit          # 4 ranks
    python examples/compose_torch.py --family qwen2 --vocab 97 --plan auto --layout fsdp=2,tp=2 --style explicit
    python examples/compose_torch.py --layout fsdp=2,tp=2 --compile                 # each layer torch.compile'd
    python examples/compose_torch.py --layout fsdp=2,tp=2 --save ckpt               # then compose_jax.py --load
    python examples/compose_torch.py --load ckpt/step_000003                        # either framework's, its loss

``--family qwen2``: transformers' Qwen2ForCausalLM (q/k/v biases, grouped-query attention), the same weights
plus random q/k/v biases; ``--plan auto``: the model's own tp plan (``config.base_model_tp_plan``, prefixed,
with the vocabulary split added); ``--vocab 97``: a vocabulary tp does not divide (explicit pads it;
builtin refuses it). Every run loads ``trainer.full_state_dict()`` back into a fresh model (strict);
``--save DIR`` also writes it as a weights checkpoint (torch_impl.checkpoint.save_weights: DCP, every rank its
chunk), which the NNX twin reads (``examples/compose_jax.py --load DIR/step_000003``: the same loss to 1e-12).

The contract both frameworks follow: model ``LlamaShape()`` (V 64, D 32, 4 layers, 4 heads / 2 key-value
heads, F 64, T 16) in float64 from ``shared.llama.weights(shape, seed=0)``; data ``batch(shape, rows=8,
seed=0)``, the same whole batch every step; loss the mean cross-entropy of the logits (B, T, V) against the
targets over all B × T tokens; optimizer AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
on every parameter; 3 steps; the losses are those before each update. SDPA attention (CPU float64 SDPA
stays in float64; transformers' eager path takes its softmax in float32); under cp the project's seam.
Everything in float64: transformers computes RMSNorm and RoPE's angles in float32 even in a float64 model,
so ``llama.full_precision(model)`` makes them compute the same formulas in float64, as the JAX twin does
(float32 arithmetic of two libraries differs at ~1e-7: the 1e-12 agreement needs float64 throughout).

The glue a user copies (the rank code below; ``Stage`` and ``TP_PLAN`` from parallel/llama.py):

    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=axes)
    trainer = parallelize(model, mesh, plan=TP_PLAN, stage=Stage, units=["model.layers.*"],
                          optimizer=lambda ps: torch.optim.AdamW(ps, **ADAMW))
    losses = [trainer.train_step(tokens, targets) for _ in range(STEPS)]

``--json PATH`` writes {"framework": "torch", "layout", "style", "losses", "reference_losses",
"max_abs_param_diff", "max_rel_loss_diff", "comm_per_rank"} (the last: per rank, the ledger of step 3 and
the composition's theory, op -> [count, bytes] per mesh axis). Exit 0 only when every loss matches the
single process's to <= 1e-12 relative and every parameter after the 3 steps to <= 1e-12 (float64: the
parallel runs add the same products in another order, ~1e-16 per op; measured <= 1e-14 after 3 steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never the hub: the model is built from a config

import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from shared import llama as shared_llama  # noqa: E402
from torch_impl.checkpoint import load_weights, save_weights  # noqa: E402
from torch_impl.launch import launch  # noqa: E402
from torch_impl.parallel import compiled_ledger  # noqa: E402
from torch_impl.parallel.compose import cross_entropy, parallelize  # noqa: E402
from torch_impl.parallel.llama import TP_PLAN, Stage, cp_attention, full_precision  # noqa: E402
from torch_impl.parallel.recipe import LocalClipError  # noqa: E402

ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ROWS, STEPS, SEED, TOL = 8, 3, 0, 1e-12  # TOL: relative, float64 (module docstring)


def build(shape: shared_llama.LlamaShape, cp: bool = False, family: str = "llama"):
    """LlamaForCausalLM in float64 holding shared/llama.py's weights; cp: attention through the cp seam.
    ``family="qwen2"``: transformers' Qwen2ForCausalLM (biased q/k/v) with the same weights and random
    q/k/v biases (transformers inits them at zero: they would not show a bias split wrongly)."""
    import transformers

    kind = {"llama": "Llama", "qwen2": "Qwen2"}[family]
    config = getattr(transformers, f"{kind}Config")(**shared_llama.hf_config(shape), use_cache=False)
    config._attn_implementation = "sdpa"
    model = getattr(transformers, f"{kind}ForCausalLM")(config).to(torch.float64)
    state = {k: torch.from_numpy(v) for k, v in shared_llama.weights(shape, SEED).items()}
    rng = torch.Generator().manual_seed(SEED)
    state |= {k: 0.02 * torch.randn(p.shape, generator=rng, dtype=torch.float64)
              for k, p in model.named_parameters() if k.endswith("_proj.bias")}
    model.load_state_dict(state, strict=True)
    full_precision(model)  # RMSNorm and RoPE in float64 too, as the JAX twin (transformers casts to float32)
    if cp:
        cp_attention(model.config)  # every attention layer reads the shared config at call time
    return model


def data(shape):
    return tuple(torch.from_numpy(a) for a in shared_llama.batch(shape, ROWS, SEED))  # tokens, targets (B, T)


def reference(shape, max_norm=None, family="llama") -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model on one process: plain forward, mean CE, (torch's clip_grad_norm_,) AdamW."""
    model, (tokens, targets) = build(shape, family=family), data(shape)
    opt, losses = torch.optim.AdamW(model.parameters(), **ADAMW), []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy(model(input_ids=tokens).logits, targets)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: p.detach() for k, p in model.named_parameters()}


def clipping_adamw(params):
    """A training loop's optimizer that clips inside its step (torch's clip over what the rank holds)."""
    opt = torch.optim.AdamW(params, **ADAMW)

    def clip(optimizer, args, kwargs):
        torch.nn.utils.clip_grad_norm_(params, 0.05)

    opt.register_step_pre_hook(clip)
    return opt


def train(layout: dict[str, int], style: str, shape, ledger=None, **pp):
    """This rank's part of training under ``layout``: the losses, every parameter whole, and (given the
    project's CommLedger) the last step's collectives per axis beside the composition's theory of them.
    ``pp``: parallelize's schedule= / microbatches= / plan=, train_step's max_norm=, the model's
    ``family`` and ``vocab`` (``case_shape``), and ``clip_in_optimizer``: torch's clip inside the
    optimizer (refused: the LocalClipError's message)."""
    max_norm, local, save = pp.pop("max_norm", None), pp.pop("clip_in_optimizer", False), pp.pop("save", None)
    shape, family = case_shape(shape, pp.pop("vocab", None)), pp.pop("family", "llama")
    model, (tokens, targets) = build(shape, layout.get("cp", 1) > 1, family), data(shape)
    mesh = init_device_mesh("cpu", tuple(layout.values()), mesh_dim_names=tuple(layout))  # glue
    trainer = parallelize(model, mesh, **({"plan": TP_PLAN} | pp), stage=Stage, units=["model.layers.*"],
                          style=style, optimizer=clipping_adamw if local else
                          lambda ps: torch.optim.AdamW(ps, **ADAMW))  # glue
    if local:
        try:
            trainer.train_step(tokens, targets)
            return "not refused", {}, {}, {}
        except LocalClipError as e:
            return str(e), {}, {}, {}
    losses = [trainer.train_step(tokens, targets, max_norm) for _ in range(STEPS - 1)]  # glue
    comm = {}
    if ledger is not None and trainer.compiled:  # compiled: the profiler's ledger (a dispatch mode runs eagerly)
        with compiled_ledger.recording(torch.float64) as rec:
            losses.append(trainer.train_step(tokens, targets, max_norm))
        theory: dict[str, list[int]] = {}
        for ops in trainer.comm_theory().values():  # the theory's axes summed: the profiler sees no groups
            for op, (n, nbytes) in ops.items():
                theory[op] = [theory.get(op, [0, 0])[0] + n, theory.get(op, [0, 0])[1] + nbytes]
        comm = {"total": {op: [v["count"], v["bytes"]] for op, v in rec.comm.items()}, "theory_total": theory,
                "compiled": rec.compiled, "eager": rec.eager, "programs": rec.programs}
    elif ledger is not None:
        current = {g.group_name: label for g, label in trainer.labels().items()}
        ledger.label_groups(_LABELS | current)
        _LABELS.update({k: v for k, v in current.items() if k != torch.distributed.group.WORLD.group_name})
        with ledger.recording():
            losses.append(trainer.train_step(tokens, targets, max_norm))
        ledger.label_groups({})
        comm = {"ledger": {a: {op: (v["count"], v["bytes"]) for op, v in ops.items()}
                           for a, ops in ledger.by_axis().items()}, "theory": trainer.comm_theory()}
    else:
        losses.append(trainer.train_step(tokens, targets, max_norm))
    state = trainer.full_state_dict()
    twin = build(shape, family=family)
    twin.load_state_dict(state, strict=True)  # the model's own names and shapes
    extra = {}
    if save:  # the weights checkpoint (every rank writes its chunk) and the loss it must reproduce
        path = save_weights(save, STEPS, state, model)  # glue
        with torch.no_grad():
            extra = {"saved": path, "source_loss": float(cross_entropy(twin(input_ids=tokens).logits, targets))}
    return losses, {k: v.numpy() for k, v in state.items()}, comm, extra  # NumPy: rank -> parent


# {group name: ledger label} of every layout this process ran: DTensor caches its sharding decisions by
# DeviceMesh equality, which ignores process groups, so a later layout's tp collectives may run on an
# earlier layout's equal tp group, which keeps its (same) label (as torch_impl/mesh.py); the world's
# group is labelled per layout (a sub-mesh spanning every rank is the world's group)
_LABELS: dict[str, str] = {}


def case_shape(shape, vocab):
    return shape if vocab is None else dataclasses.replace(shape, vocab=vocab)


def rank(ctx, cases: list[tuple[dict, str, dict]], shape, then=None):
    """Every (layout, style, pp options) of ``cases`` on the same ranks, one after another; every rank's
    answers (the ledger differs by rank; the parameters are rank 0's). ``then``: (fn, *args), run after
    them on the same ranks as ``fn(ctx, *args)`` (a test's other cases sharing the launch)."""
    out = [train(layout, style, shape, ctx.ledger, **pp) for layout, style, pp in cases]
    out = out if ctx.rank == 0 else [(None, None, comm, None) for _, _, comm, _ in out]
    return (out, then[0](ctx, *then[1:])) if then else out


def parse_layout(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        axis, _, size = part.partition("=")
        out[axis.strip()] = int(size)
    return out


def compare(layout, style, got, ref) -> dict:
    (losses, params, _, extra), (ref_losses, ref_params) = got, ref
    if isinstance(losses, str):  # clip_in_optimizer: the refusal's message
        return {"framework": "torch", "layout": layout, "style": style, "refused": losses}
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    diff = max(float((torch.from_numpy(params[k]) - v).abs().max()) for k, v in ref_params.items())
    return {"framework": "torch", "layout": layout, "style": style, "losses": losses,
            "reference_losses": ref_losses, "max_abs_param_diff": diff, "max_rel_loss_diff": rel} | extra


def run(cases: list[tuple], shape=None, then=None) -> list[dict]:
    """Train every (layout, style[, {"schedule": …, "microbatches": …, "family": "qwen2", "vocab": 97, …}])
    in ONE launch (all layouts of one world size) and on one process (``train``'s options). ``then``:
    (fn, *args) every rank runs afterwards in the same launch; given, returns (results, fn's answer per rank)."""
    shape = shape or shared_llama.LlamaShape()
    cases = [(c[0], c[1], c[2] if len(c) > 2 else {}) for c in cases]
    worlds = {math.prod(c[0].values()) for c in cases}
    if len(worlds) != 1:
        raise ValueError(f"compose_torch.run: one launch per world size; these layouts need {sorted(worlds)}")
    every = launch(rank, worlds.pop(), cases, shape, then)
    after = [answers[1] for answers in every] if then else None
    every = [answers[0] for answers in every] if then else every
    key = lambda pp: (pp.get("max_norm"), pp.get("family", "llama"), pp.get("vocab"))  # noqa: E731
    refs = {k: reference(case_shape(shape, k[2]), k[0], k[1]) for k in {key(pp) for _, _, pp in cases}}
    out = [compare(layout, style, got, refs[key(pp)]) | pp
           for (layout, style, pp), got in zip(cases, every[0], strict=True)]
    for i, r in enumerate(out):
        r["comm_per_rank"] = [answers[i][2] for answers in every]  # {"ledger", "theory"} per axis, per rank
    return (out, after) if then else out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="fsdp=2,tp=2,pp=2", help="axis=size,... outermost first")
    parser.add_argument("--style", default="builtin", choices=("builtin", "explicit"))
    parser.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b"), help="under pp")
    parser.add_argument("--family", default="llama", choices=("llama", "qwen2"), help="transformers' model")
    parser.add_argument("--vocab", type=int, default=64, help="V (explicit tp pads one it does not divide)")
    parser.add_argument("--plan", default="llama", choices=("llama", "auto"),
                        help="parallel/llama.py's TP_PLAN or the model's own (config.base_model_tp_plan)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each decoder layer (parallelize(compile=True): parallel/compiled.py)")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--save", metavar="DIR", help="write the trained weights as a checkpoint DIR/step_000003 "
                        "(torch_impl.checkpoint.save_weights; examples/compose_jax.py --load reads it)")
    parser.add_argument("--load", metavar="PATH", help="only print the loss of a weights checkpoint either "
                        "framework wrote, read into transformers' Llama (torch_impl.checkpoint.load_weights)")
    args = parser.parse_args(argv)
    if args.load:
        shape = shared_llama.LlamaShape()
        model, (tokens, targets) = load_weights(args.load, build(shape)), data(shape)
        with torch.no_grad():
            print(json.dumps({"loaded": args.load, "loss": float(cross_entropy(model(input_ids=tokens).logits,
                                                                                targets))}))
        return 0
    opts = {"schedule": args.schedule, "family": args.family, "vocab": args.vocab} | (
        {"save": args.save} if args.save else {}) | (
        {"plan": "auto"} if args.plan == "auto" else {}) | ({"compile": True} if args.compile else {})
    result = run([(parse_layout(args.layout), args.style, opts)])[0]
    if args.compile:  # the profiler's ledger: totals (no process group), each op's count and bytes
        agree = all(c["total"] == {op: c["theory_total"][op] for op in c["total"] if op in c["theory_total"]}
                    and set(c["total"]) == set(c["theory_total"]) for c in result["comm_per_rank"])
        what = "theory (summed over axes) == the compiled step's ledger on every rank"
    else:
        agree = all(c["theory"].get(a) == ops for c in result["comm_per_rank"] for a, ops in c["ledger"].items()
                    if a in c["theory"])
        what = "theory per axis == ledger on every rank (axes derived)"
    print(json.dumps({k: v for k, v in result.items() if k != "comm_per_rank"}, indent=1))
    print(f"{what}: {agree}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["max_rel_loss_diff"] <= TOL and result["max_abs_param_diff"] <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())
