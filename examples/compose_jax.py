"""One Llama under dp/fsdp × tp × pp × cp on one JAX mesh: the Flax NNX Llama (jax_impl/parallel/llama.py,
transformers' names and shapes) built from shared/llama.py's NumPy weights, trained composed and on one
device; the twin of examples/compose_torch.py (transformers' LlamaForCausalLM from the same weights).

    python examples/compose_jax.py --layout fsdp=2,tp=2,pp=2 --json out.json   # 8 simulated devices
    python examples/compose_jax.py --layout dp=2,tp=2,cp=2 [--style jit]       # jit: no pp
    python examples/compose_jax.py --layout dp=2,tp=2,cp=2 --cp-variant ulysses  # or ring_zigzag
    python examples/compose_jax.py --family gpt2 --layout fsdp=2,tp=2,pp=2     # GPT-2-style: examples/gpt2_nnx.py
    python examples/compose_jax.py --family gpt2-mha --layout fsdp=2,tp=2      # its attention nnx.MultiHeadAttention
    python examples/compose_jax.py --layout fsdp=2,tp=2 --save ckpt            # weights: compose_torch.py --load
    python examples/compose_jax.py --load ckpt/step_000003                     # either framework's, its loss

The glue (a user's copy):

    model = llama.from_numpy(weights(shape))
    trainer = compose(model, {"fsdp": 2, "tp": 2, "pp": 2}, cross_entropy, tx, plan=llama.PLAN, split=llama.SPLIT)
    for _ in range(steps):
        trainer.train_step(tokens, targets)

Training, the same as the torch example's: LlamaShape() defaults (V 64, D 32, 4 layers, 4 heads, 2 KV
heads, F 64, T 16), float64, rows = 8, steps = 3, weights seed 0, batch seed 0, one fixed batch; loss =
mean cross-entropy of the logits over B × T; AdamW lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8,
weight_decay = 0.01 on every parameter (optax.adamw: eps added to sqrt(v̂), eps_root = 0, decoupled decay
lr·wd·p of the pre-step p — torch.optim.AdamW's update, to rounding). Writes {"framework": "jax", "layout",
"style", "losses", "reference_losses", "max_abs_param_diff", "max_rel_loss_diff", "comm"} (the last: the
compiled step's collectives per mesh axis (jax_impl.ledger.comm_by_axis) beside the composition's theory
(trainer.comm_theory(); None under jit, XLA's choice), op -> [count, bytes]: one SPMD program, the same on
every device, where torch writes one per rank); exit 0 only when every loss and parameter matches the
single-device run to <= 1e-12 relative (float64 reorders sums over shards: ~1e-15).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # gpt2_nnx beside it, when imported by path
from shared.env import simulate_host_devices  # noqa: E402

simulate_host_devices(8)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

jax.config.update("jax_enable_x64", True)  # float64 parity

from jax_impl import checkpoint, ledger  # noqa: E402
from jax_impl.parallel import llama, recipe  # noqa: E402
from jax_impl.parallel.compose import ComposeError, compose  # noqa: E402
from jax_impl.parallel.tree import key_of  # noqa: E402
from shared.llama import LlamaShape, batch, weights  # noqa: E402

ROWS, STEPS, SEED, TOL = 8, 3, 0, 1e-12


def cross_entropy(logits, targets):
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def adamw():
    return optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)


def single_device(model, tokens, targets, steps: int, clip: float | None = None):
    """Plain training on one device (clip: torch's clip_grad_norm_ formula first): (losses, {NNX path: array})."""
    gdef, params = nnx.split(model)
    tx = adamw() if clip is None else optax.chain(recipe.clip_by_global_norm(clip), adamw())
    opt = tx.init(params)

    @jax.jit
    def step(params, opt):
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(nnx.merge(gdef, p)(tokens), targets))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    losses = []
    for _ in range(steps):
        params, opt, loss = step(params, opt)
        losses.append(float(loss))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return losses, {key_of(p): np.asarray(a) for p, a in flat}


def family_of(name: str, gpt2_shape=None):
    """(make a fresh model, plan, split, default units, tokens, targets) of a model family: the Llama from
    shared/llama.py's weights, or examples/gpt2_nnx.py's GPT-2 (biases everywhere, tied head, V = 97)."""
    if name in ("gpt2", "gpt2-mha"):  # gpt2-mha: its attention Flax's own nnx.MultiHeadAttention
        import gpt2_nnx

        s, mha = gpt2_shape or gpt2_nnx.GPT2Shape(), name == "gpt2-mha"
        data = batch(LlamaShape(vocab=s.vocab, seq=s.seq), ROWS, SEED)
        make = lambda: gpt2_nnx.GPT2(s, rngs=nnx.Rngs(SEED), attention="flax" if mha else "fused")  # noqa: E731
        return make, gpt2_nnx.FLAX_MHA_PLAN if mha else gpt2_nnx.PLAN, gpt2_nnx.SPLIT, gpt2_nnx.UNITS, *data
    shape = LlamaShape()
    w = weights(shape, SEED)
    return (lambda: llama.from_numpy(w, shape)), llama.PLAN, llama.SPLIT, None, *batch(shape, ROWS, SEED)


def with_params(model, params: dict):
    """``model`` holding ``params`` ({NNX Param path: array}: ``trainer.params()``)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, [jnp.asarray(params[key_of(p)]) for p, _ in leaves]))
    return model


def loss_of(model, tokens, targets) -> float:
    return float(cross_entropy(model(jnp.asarray(tokens)), jnp.asarray(targets)))


def run(layout: dict[str, int], style: str = "shard_map", steps: int = STEPS, units=None,
        cp_variant: str = "ring", clip: float | None = None, family: str = "llama", gpt2_shape=None,
        save: str | None = None) -> dict:
    make, plan, split, default_units, tokens, targets = family_of(family, gpt2_shape)
    trainer = compose(make(), layout, cross_entropy, adamw(), plan=plan, split=split, style=style,
                      units=units if units is not None else default_units, cp_variant=cp_variant, clip=clip)
    losses = [trainer.train_step(tokens, targets) for _ in range(steps)]
    by_axis = ledger.comm_by_axis(trainer.compiled_text(tokens, targets), trainer.mesh)  # jit's cache: no recompile
    comm = {"ledger": {a: {op: (v["count"], v["bytes"]) for op, v in ops.items()} for a, ops in by_axis.items()},
            "theory": trainer.comm_theory()}
    ref_losses, ref = single_device(make(), jnp.asarray(tokens), jnp.asarray(targets), steps, clip)
    got = trainer.params()
    extra = {}
    if save:  # the weights checkpoint (Orbax) and the loss it must reproduce
        extra = {"saved": checkpoint.save_weights(save, steps, got, layout, list(trainer.mesh.devices.flat)),
                 "source_loss": loss_of(with_params(make(), got), tokens, targets)}
    assert set(got) == set(ref), set(got) ^ set(ref)
    diff = max(float(np.abs(got[k] - ref[k]).max()) for k in ref)
    scale = max(float(np.abs(a).max()) for a in ref.values())
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    return {"framework": "jax", "family": family, "layout": layout, "style": style, "cp_variant": cp_variant,
            "losses": losses,
            "reference_losses": ref_losses,
            "max_abs_param_diff": diff, "max_rel_loss_diff": loss_rel,
            "exact": bool(loss_rel <= TOL and diff <= TOL * scale), "comm": comm} | extra


def parse_layout(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        axis, _, n = part.partition("=")
        if not n.isdigit():
            raise SystemExit(f"--layout: {part!r} is not axis=size (e.g. fsdp=2,tp=2,pp=2)")
        out[axis.strip()] = int(n)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="fsdp=2,tp=2,pp=2", help="axis=size,… over dp fsdp pp cp tp")
    ap.add_argument("--style", default="shard_map", choices=("shard_map", "jit", "typed"))
    ap.add_argument("--cp-variant", default="ring", choices=("ring", "ring_zigzag", "ulysses"))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--family", default="llama", choices=("llama", "gpt2", "gpt2-mha"),
                    help="the NNX Llama, or examples/gpt2_nnx.py's GPT-2 (biases, tied head, V = 97; gpt2-mha: "
                    "its attention Flax's nnx.MultiHeadAttention, compose_axes.flax_mha_plan)")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--save", metavar="DIR", help="write the trained weights as a checkpoint DIR/step_000003 "
                    "(jax_impl.checkpoint.save_weights; examples/compose_torch.py --load reads it)")
    ap.add_argument("--load", metavar="PATH", help="only print the loss of a weights checkpoint either framework "
                    "wrote, read into the NNX Llama (jax_impl.checkpoint.load_weights), on the batch")
    args = ap.parse_args(argv)
    if args.load:
        shape = LlamaShape()
        print(json.dumps({"loaded": args.load, "loss": loss_of(checkpoint.load_weights(args.load, llama.Llama(shape)),
                                                               *batch(shape, ROWS, SEED))}))
        return 0
    try:
        result = run(parse_layout(args.layout), args.style, args.steps, cp_variant=args.cp_variant,
                     family=args.family, save=args.save)
    except ComposeError as e:  # refused before compiling: one line
        print(e, file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in result.items() if k != "comm"}, indent=1))
    if result["comm"]["theory"] is not None:
        print(f"theory per axis == ledger (one SPMD program): {result['comm']['theory'] == result['comm']['ledger']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
