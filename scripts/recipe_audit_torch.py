"""The torch half of the held-out recipe audit (scripts/recipe_audit.py): transformers' GPT2LMHeadModel
(tiny config, tied input/output embeddings, Conv1D projections, LayerNorm with bias) and ``ResConv``
(a residual conv net with GroupNorm written here), through every public API of torch_impl/parallel ×
every recipe ingredient, float64, ONE launch of 2 gloo ranks, 3 steps, against one process training
with the same recipe (the whole batch as K micro-batches).

Recipes: ``clip`` (the API's own global-norm call, docs/recipe.md's table), ``torch_clip`` (torch's
``clip_grad_norm_`` over the parameters the rank holds), ``decay_mask`` (param groups: matrices decay),
``frozen`` (``requires_grad_(False)`` before wrapping), ``group_lr`` (vectors at lr / 10), ``schedule``
(LambdaLR warmup + cosine), ``accumulate`` (2 micro-batches, ``no_sync`` where offered) and ``llama``
(clip 1.0 + warmup-cosine + decay mask + accumulation 2; clip 0.05 binds on these models).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from recipe_audit_common import NotOffered, classify

from torch_impl.launch import launch
from torch_impl.parallel import compose, cp, dp, fsdp, pp, tp

STEPS, LR, B, K, V, T = 3, 1e-2, 8, 2, 11, 8
RECIPES = {  # clip, groups, frozen, schedule, K
    "clip": ("api", None, False, False, 1), "torch_clip": ("torch", None, False, False, 1),
    "decay_mask": (None, "decay", False, False, 1), "frozen": (None, None, True, False, 1),
    "group_lr": (None, "lr", False, False, 1), "schedule": (None, None, False, True, 1),
    "accumulate": (None, None, False, False, K), "llama": ("api", "decay", False, True, K),
}
MAX_NORM = 0.05  # binds every step on both models (the gradients' norms are 0.1–3)


def lr_lambda(step: int) -> float:
    return (step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / (STEPS - 2)))


# --- the models ----------------------------------------------------------------------------------------------


class GPT2(nn.Module):
    """GPT2LMHeadModel -> logits; lm_head.weight IS transformer.wte.weight."""

    def __init__(self, attn="eager"):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=V, n_positions=T, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0, use_cache=False)
        cfg._attn_implementation = attn
        self.m = GPT2LMHeadModel(cfg)

    def forward(self, tokens, positions=None):
        return self.m(input_ids=tokens, position_ids=None if positions is None else positions[None]).logits


class Res(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm, self.conv = nn.GroupNorm(2, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv(F.gelu(self.norm(x)))


class ResConv(nn.Module):
    """stem -> 2 residual blocks -> head (pool, flatten, Linear, GELU, Linear): a chain of submodules."""

    def __init__(self):
        super().__init__()
        self.stem, self.blocks = nn.Conv2d(3, 4, 3, padding=1), nn.Sequential(Res(4), Res(4))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 5))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def gpt2_loss(out, y):
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


MODELS = {  # build, loss(out, y), frozen prefix, data(g), tp plan, pp stages, fsdp2 units
    "gpt2": dict(build=GPT2, loss=gpt2_loss, frozen="m.transformer.wpe",
                 data=lambda g: (torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)),
                 plan={"m.transformer.h.*.mlp.c_fc": "colwise", "m.transformer.h.*.mlp.c_proj": "rowwise"},
                 stages=[["m.transformer.wte", "m.transformer.wpe", "m.transformer.h.0"],
                         ["m.transformer.h.1", "m.transformer.ln_f", "m.lm_head"]],
                 units=lambda m: list(m.m.transformer.h)),
    "resconv": dict(build=ResConv, loss=F.mse_loss, frozen="stem",
                    data=lambda g: (torch.randn(B, 3, 4, 4, generator=g, dtype=torch.float64),
                                    torch.randn(B, 5, generator=g, dtype=torch.float64)),
                    plan={"head.2": "colwise", "head.4": "rowwise"},
                    stages=[["stem", "blocks.0"], ["blocks.1", "head"]],
                    units=lambda m: list(m.blocks)),
}


def build(spec, frozen: bool, **kw):
    torch.manual_seed(0)
    model = spec["build"](**kw).double()
    if frozen:
        for n, p in model.named_parameters():
            if n.startswith(spec["frozen"]):
                p.requires_grad_(False)
    return model


def groups(named, how):
    named = [(n, p) for n, p in named if p.requires_grad]
    mats, vecs = [p for _, p in named if p.dim() >= 2], [p for _, p in named if p.dim() < 2]
    if how == "decay":
        return [{"params": mats, "weight_decay": 0.1}, {"params": vecs, "weight_decay": 0.0}]
    if how == "lr":
        return [{"params": mats}, {"params": vecs, "lr": LR / 10}]
    return [p for _, p in named]


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, foreach=False)


def batches(spec):
    g = torch.Generator().manual_seed(5)
    return [spec["data"](g) for _ in range(STEPS)]


def parts(x, y, k, rank=None, n=2):
    if rank is not None:
        x, y = x[rank * B // n:(rank + 1) * B // n], y[rank * B // n:(rank + 1) * B // n]
    return list(zip(x.chunk(k), y.chunk(k)))


def loop(spec, recipe, forward, named, opt_of, data, rank, sync=None, clip=None, no_sync=None, after=None):
    """STEPS of the recipe on a wrapped model; ``named()`` the parameters the optimizer and torch's clip see."""
    how_clip, how_groups, _, schedule, k = RECIPES[recipe]
    opt = opt_of(groups(named(), how_groups))
    clip = (lambda m, clip=clip: clip(opt, m)) if clip else None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if schedule else None
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        mine = parts(x, y, k, rank)
        for i, (xi, yi) in enumerate(mine):
            with no_sync() if no_sync is not None and i < len(mine) - 1 else contextlib.nullcontext():
                (spec["loss"](forward(xi), yi) / len(mine)).backward()
        if sync:
            sync()
        if how_clip == "api":
            if clip is None:
                raise NotOffered("no clipping call of its own")
            clip(MAX_NORM)
        elif how_clip == "torch":
            torch.nn.utils.clip_grad_norm_([p for _, p in named() if p.requires_grad], MAX_NORM)
        opt.step()
        if after:
            after()
        if sched:
            sched.step()


def reference(spec, recipe, data):
    """One process, the whole batch as K micro-batches; both clippings are torch's clip_grad_norm_ here."""
    model = build(spec, RECIPES[recipe][2])
    trainable = [p for p in model.parameters() if p.requires_grad]
    loop(spec, recipe, model, model.named_parameters, adamw, data, None,
         clip=lambda _, m: torch.nn.utils.clip_grad_norm_(trainable, m))
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}  # tied: every name


# --- the APIs: each returns {name: full tensor} of what this rank holds after training ---------------------------


def zero1_opt(g):
    return dp.Zero1Optimizer(g, torch.optim.AdamW, lr=LR, foreach=False)


def api_ddp(ctx, spec, recipe, data):
    net = dp.BucketedDDP(build(spec, RECIPES[recipe][2]), bucket_mb=1e-4)
    loop(spec, recipe, net, net.module.named_parameters, adamw, data, ctx.rank, net.finish_gradient_synchronization,
         lambda o, m: net.clip_grad_norm_(m), net.no_sync)
    return dict(net.module.named_parameters())


def api_zero1(ctx, spec, recipe, data):
    model = build(spec, RECIPES[recipe][2])
    loop(spec, recipe, model, model.named_parameters, zero1_opt, data, ctx.rank, clip=lambda o, m: o.clip_grad_norm_(m))
    return dict(model.named_parameters())


def api_zero2(ctx, spec, recipe, data):
    model = build(spec, RECIPES[recipe][2])
    z = fsdp.Zero2(model)
    loop(spec, recipe, model, z.named_parameters, adamw, data, ctx.rank, z.finish_gradient_synchronization,
         lambda o, m: z.clip_grad_norm_(m), z.no_sync, z.all_gather_params)
    return dict(model.named_parameters())


def api_fsdp(ctx, spec, recipe, data):
    w = fsdp.FSDP(build(spec, RECIPES[recipe][2]))
    loop(spec, recipe, w, w.module.named_parameters, adamw, data, ctx.rank, w.finish_gradient_synchronization,
         lambda o, m: w.clip_grad_norm_(m), w.no_sync)
    return w.full_state_dict()


def api_fsdp2(ctx, spec, recipe, data):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, mesh = build(spec, RECIPES[recipe][2]), init_device_mesh("cpu", (2,))
    for unit in spec["units"](model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)

    @contextlib.contextmanager
    def no_sync():
        model.set_requires_gradient_sync(False)
        yield
        model.set_requires_gradient_sync(True)

    trainable = [p for p in model.parameters() if p.requires_grad]
    loop(spec, recipe, model, model.named_parameters, adamw, data, ctx.rank,
         clip=lambda o, m: torch.nn.utils.clip_grad_norm_(trainable, m), no_sync=no_sync)  # torch's own, DTensors
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def api_tp(ctx, spec, recipe, data):
    model = build(spec, RECIPES[recipe][2])
    styles = tp.apply_plan(model, spec["plan"], ctx.group)
    loop(spec, recipe, model, model.named_parameters, adamw, data, None,
         clip=lambda o, m: tp.clip_grad_norm_(model, m, ctx.group))
    return tp.full_tensors(model, styles, ctx.group)


def api_dtensor(ctx, spec, recipe, data):
    from torch.distributed.device_mesh import init_device_mesh

    model = build(spec, RECIPES[recipe][2])
    tp.apply_dtensor_plan(model, spec["plan"], init_device_mesh("cpu", (2,)))
    loop(spec, recipe, model, model.named_parameters, adamw, data, None, clip=lambda o, m: tp.clip_grad_norm_(model, m))
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}


def _stepper(recipe):
    """pp / cp: the trainer steps inside train_step: clipping and accumulation are its arguments."""
    how_clip, how_groups, _, schedule, k = RECIPES[recipe]
    if how_clip == "torch":
        raise NotOffered("the trainer steps inside train_step: no place for torch's clip_grad_norm_")
    return (lambda ps: adamw(groups([(str(i), p) for i, p in enumerate(ps)], how_groups))), schedule, \
        dict(accumulate=k, max_norm=MAX_NORM if how_clip else None)


def api_pp(ctx, spec, recipe, data, schedule="gpipe"):
    opt, sched, kw = _stepper(recipe)
    model = build(spec, RECIPES[recipe][2])
    trainer = pp.pipeline(model, spec["stages"], spec["loss"], opt, ctx.group, microbatches=2, schedule=schedule)
    lr = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lr_lambda) if sched else None
    for x, y in data:
        trainer.train_step(x, y, **kw)
        lr and lr.step()
    return trainer.named_parameters()


def api_cp(ctx, spec, recipe, data, variant="ring"):
    if spec["build"] is not GPT2:
        raise NotOffered("no attention: nothing for context parallelism to split")
    opt, sched, kw = _stepper(recipe)
    model = build(spec, RECIPES[recipe][2], attn=cp.register())
    trainer = cp.context_parallel(model, lambda m, x, y, pos: gpt2_loss(m(x, pos), y), opt, ctx.group, variant)
    lr = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lr_lambda) if sched else None
    for x, y in data:
        trainer.train_step(x, y, **kw)
        lr and lr.step()
    return dict(model.named_parameters())


def api_compose(ctx, spec, recipe, data, axis="fsdp", style="builtin"):
    from torch.distributed.device_mesh import init_device_mesh

    if spec["build"] is not GPT2:
        raise NotOffered("compose trains (B, T) token batches with cross-entropy")
    how_clip, how_groups, frozen, schedule, k = RECIPES[recipe]
    if how_clip == "torch":
        raise NotOffered("compose steps inside train_step (clip: its max_norm=)")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
    trainer = compose.parallelize(build(spec, frozen), mesh, plan=spec["plan"] if axis == "tp" else None,
                                  units=["m.transformer.h.*"], style=style, microbatches=k,  # k > 1: accumulation
                                  optimizer=lambda ps: adamw(groups(list(enumerate(ps)), how_groups)))
    lr = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lr_lambda) if schedule else None
    for x, y in data:
        trainer.train_step(x, y, max_norm=MAX_NORM if how_clip else None)
        lr and lr.step()
    return trainer.full_state_dict()


APIS = {"BucketedDDP": api_ddp, "Zero1Optimizer": api_zero1, "Zero2": api_zero2, "FSDP": api_fsdp,
        "fully_shard": api_fsdp2, "tp.apply_plan": api_tp, "apply_dtensor_plan": api_dtensor,
        "pp gpipe": api_pp, "pp 1f1b": lambda *a: api_pp(*a, schedule="1f1b"),
        "cp ring": api_cp, "cp ulysses": lambda *a: api_cp(*a, variant="ulysses"),
        "compose dp builtin": lambda *a: api_compose(*a, axis="dp"), "compose fsdp builtin": api_compose,
        "compose fsdp explicit": lambda *a: api_compose(*a, style="explicit"),
        "compose tp builtin": lambda *a: api_compose(*a, axis="tp"),
        "compose tp explicit": lambda *a: api_compose(*a, axis="tp", style="explicit")}
REDUCED = ("resconv", ("clip", "torch_clip", "frozen", "llama"))


def _error(got: dict, want: dict) -> float:
    missing = set(got) - set(want)
    if missing:
        raise KeyError(f"the audit found no reference for {sorted(missing)}")
    return max(float(_no_key_bias(n, got[n].detach() - want[n]).abs().max()) for n in got)


def _no_key_bias(name: str, diff: torch.Tensor) -> torch.Tensor:
    """GPT-2's c_attn bias is [q | k | v]: the key third's gradient is identically 0 (softmax is
    shift-invariant over the keys), AdamW's g / √v turns its round-off into steps of ±lr: left out."""
    if name.endswith("attn.c_attn.bias"):
        d = diff.numel() // 3
        return torch.cat([diff[:d], diff[2 * d:]])
    return diff


def _everything(ctx, reduced):
    torch.set_default_dtype(torch.float64)
    rows = []
    for mname, spec in MODELS.items():
        if reduced and mname != REDUCED[0]:
            continue
        data = batches(spec)
        for recipe in RECIPES:
            if reduced and recipe not in REDUCED[1]:
                continue
            want = reference(spec, recipe, data)
            for aname, fn in APIS.items():
                row = {"framework": "torch", "model": mname, "api": aname, "recipe": recipe}
                rows.append(row | classify(lambda fn=fn, spec=spec, recipe=recipe, data=data, want=want: _error(
                    fn(ctx, spec, recipe, data), want)))
                dist.barrier()
    return rows


def audit(reduced: bool = False) -> list[dict]:
    """Every rank's rows merged: the worst verdict (and the largest error) per case."""
    every = launch(_everything, 2, reduced, device="cpu", timeout_s=1200)
    rank = {"exact": 0, "n/a": 1, "refused": 2, "WRONG": 3, "CRASH": 4}
    out = []
    for rows in zip(*every):
        worst = max(rows, key=lambda r: (rank[r["verdict"]], r.get("error", 0)))
        out.append(worst)
    return out
