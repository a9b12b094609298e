"""Bring your own model (issue 24, torch), a model the project does not own: transformers'
``LlamaForCausalLM`` under BucketedDDP, Zero1Optimizer, Zero2, FSDP and both tensor-parallel plans
(``tp.apply_plan``, ``tp.apply_dtensor_plan``), each against single-process training of
the same model from the same weights, in ONE launch at world size 2 (gloo).

Model: ``LlamaConfig`` small and random (torch seed 0; nothing loaded, the hub never asked:
HF_HUB_OFFLINE=1), float64: V = 97 (not divisible by 2: the vocabulary styles pad to 49 rows per
rank), hidden 32, intermediate 64, 2 layers, 4 query heads / 2 key-value heads (GQA, head_dim 8),
an untied head, and the same model tied (tie_word_embeddings=True: lm_head.weight IS
embed_tokens.weight) under every wrapper and plan. SDPA attention: the eager path takes its
softmax in float32; SDPA on CPU stays in float64. The loss is our cross-entropy on ``.logits``
(transformers' own loss upcasts the logits to float32; under TP the vocabulary-parallel one).
Batch (4, 8); data parallel: each rank trains on its 2 rows, and the mean of the ranks' losses is
compared with the full batch's loss, the parameters after 3 AdamW steps with the single process's
(the same comparison as test_own_model_torch.py: equal splits of a mean loss give the same
gradient up to rounding; no bitwise comparison between different batch splits).

Tolerance: 1e-12. Float64 throughout except where transformers computes in float32 on purpose
(RMSNorm's variance and normalisation, RoPE's angles): there both runs round the same float64
values to float32, so a ~1e-16 difference changes the float32 result only if it straddles a
rounding boundary (~1e-9 per element; measured below: none here). The parallel runs add the same
products in another order (~1e-16 relative per op); 3 AdamW steps carry that to ~1e-15.

Default tier: the launch above (~12 s on 2 cores, most of it importing transformers in 3 processes)
and two refusals and the library stage split (parallel/llama.py) without one. Slow tier: the
data-parallel wrappers at world size 4 (1 row per rank).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never the hub: the model is built from a config


import pytest
import torch
from own_models import LR, WD, ce, full, made, max_err, train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from torch_impl.launch import launch
from torch_impl.parallel import pp, tp, tp_ops
from torch_impl.parallel import theory as mt
from torch_impl.parallel.dp import BucketedDDP, Zero1Optimizer
from torch_impl.parallel.fsdp import FSDP, Zero2
from torch_impl.parallel.llama import TP_PLAN as LLAMA_PLAN  # transformers' own plan + the vocabulary
from torch_impl.parallel.llama import stage_split

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

DT = torch.float64
TOL = 1e-12  # float64 (float32 only inside RMSNorm / RoPE, identically in both runs): see the module docstring
V, B, T, LAYERS = 97, 4, 8, 2

def config(tied: bool = False) -> LlamaConfig:
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, use_cache=False,
                      max_position_embeddings=T)
    cfg._attn_implementation = "sdpa"
    return cfg


def llama(tied: bool = False) -> LlamaForCausalLM:
    return made(lambda: LlamaForCausalLM(config(tied)).to(DT))  # the same random weights in every process


# --- rank code -------------------------------------------------------------------------------------












def batch():
    return made(torch.randint, 0, V, (B, T), seed=2), made(torch.randint, 0, V, (B, T), seed=3)


def _mean(losses, ctx):
    t = torch.tensor(losses, dtype=DT)
    torch.distributed.all_reduce(t, group=ctx.group)
    return (t / ctx.world_size).tolist()


def reference(tied=False):
    tokens, y = batch()
    ref = llama(tied)
    losses, grads0 = train(lambda: ce(ref(input_ids=tokens).logits, y), ref.parameters(),
                           grads0=lambda: {n: p.grad.clone() for n, p in ref.named_parameters()})
    return {"losses": losses, "grads0": grads0, "params": full(ref)}


def data_parallel(ctx, ref, tied=False):
    """BucketedDDP, Zero1Optimizer, Zero2, FSDP on rank's half of the batch vs the single process."""
    tokens, y = batch()
    mine, my_y = tokens.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
    n, out = ctx.world_size, {}
    loss_of = lambda m: (lambda: ce(m(input_ids=mine).logits, my_y))
    errs = lambda losses, params: {"loss_err": max_err(_mean(losses, ctx), ref["losses"]),
                                   "param_err": max_err(params, ref["params"])}

    model = llama(tied)
    ddp = BucketedDDP(model)
    losses, _ = train(loss_of(ddp), model.parameters(), ddp.finish_gradient_synchronization, ctx.ledger)
    out["bucketed"] = errs(losses, full(model)) | {"ledger": ctx.ledger.summary(), "theory": ddp.comm_theory(),
                                                   "state": ddp.state_theory(), "model_state": mt.dp_state(llama(tied))}

    model = llama(tied)
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WD)
    losses, _ = train(loss_of(model), None, ledger=ctx.ledger, opt=opt)
    out["zero1"] = errs(losses, full(model)) | {
        "ledger": ctx.ledger.summary(), "theory": opt.comm_theory(), "model": mt.zero1_comm(llama(tied), n),
        "state": opt.state_theory(), "measured": {"optimizer": sum(t.numel() * 8 for s in opt.local.state.values()
                                                                   for t in s.values() if t.dim() > 0)}}

    model = llama(tied)
    zero2 = Zero2(model)
    opt2 = torch.optim.AdamW(zero2.params, lr=LR, weight_decay=WD)
    losses, _ = train(loss_of(model), None, zero2.finish_gradient_synchronization, ctx.ledger, opt=opt2,
                      after_step=zero2.all_gather_params)
    out["zero2"] = errs(losses, full(model)) | {
        "ledger": ctx.ledger.summary(), "theory": zero2.comm_theory(), "model": mt.zero2_comm(llama(tied), n),
        "state": zero2.state_theory(),
        "measured": {"params": sum(p.numel() * 8 for p in model.parameters()),
                     "grads": sum(p.grad.numel() * 8 for p in zero2.params if p.grad is not None),
                     "optimizer": sum(t.numel() * 8 for s in opt2.state.values() for t in s.values() if t.dim() > 0)}}

    model = llama(tied)
    fsdp = FSDP(model)
    losses, _ = train(loss_of(fsdp), fsdp.parameters(), fsdp.finish_gradient_synchronization, ctx.ledger)
    whole = fsdp.full_state_dict()  # a tied weight under both names (load_state_dict's); the numbers by ref's
    out["fsdp"] = errs(losses, {k: whole[k] for k in ref["params"]}) | {
        "ledger": ctx.ledger.summary(), "theory": fsdp.comm_theory(), "state": fsdp.state_theory(),
        "measured": {"params": sum(p.numel() * 8 for p in fsdp.parameters())}}
    return out


def tensor_parallel(ctx, ref, shared_f=True, tied=False):
    """apply_plan(LLAMA_PLAN): the vocabulary-parallel loss on (B, T, 49) logits; the ledger of step 3."""
    tokens, y = batch()
    model = llama(tied)
    styles = tp.apply_plan(model, LLAMA_PLAN, ctx.group, shared_f=shared_f)
    step = lambda: tp_ops.VocabParallelCrossEntropy.apply(model(input_ids=tokens).logits, y, ctx.group)
    losses, grads0 = train(step, model.parameters(), ledger=ctx.ledger,
                           grads0=lambda: tp.full_tensors(model, styles, ctx.group, grads=True))
    comm = ctx.ledger.summary()
    return {"loss_err": max_err(losses, ref["losses"]), "grad0_err": max_err(grads0, ref["grads0"]),
            "param_err": max_err(tp.full_tensors(model, styles, ctx.group), ref["params"]),
            "ledger": {op: v["count"] for op, v in comm.items()},
            "one_parameter": model.lm_head.weight is model.model.embed_tokens.weight,
            "local": (tuple(model.model.embed_tokens.weight.shape), tuple(model.lm_head.weight.shape),
                      tuple(model.model.layers[0].self_attn.k_proj.weight.shape))}


def dtensor_parallel(ctx, ref, tied=False):
    """apply_dtensor_plan(LLAMA_PLAN): parallelize_module; the loss under loss_parallel()."""
    tokens, y = batch()
    model = llama(tied)
    tp.apply_dtensor_plan(model, LLAMA_PLAN, init_device_mesh("cpu", (ctx.world_size,)))
    losses, _ = train(lambda: ce(model(input_ids=tokens).logits, y), model.parameters(), ledger=ctx.ledger,
                      around=loss_parallel)
    comm = ctx.ledger.summary()
    whole = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
    got = {k: whole(model.get_parameter(k)) for k in ref["params"]}  # untied (the bug): lm_head.weight apart
    return {"loss_err": max_err(losses, ref["losses"]), "param_err": max_err(got, ref["params"]),
            "ledger": {op: v["count"] for op, v in comm.items()},
            "one_parameter": model.lm_head.weight is model.model.embed_tokens.weight}


def rank_checks(ctx):
    ref = reference()
    out = {"dp": data_parallel(ctx, ref), "tp": tensor_parallel(ctx, ref),
           "tp_unshared": tensor_parallel(ctx, ref, shared_f=False), "dtensor": dtensor_parallel(ctx, ref)}
    tied = reference(tied=True)  # lm_head.weight is embed_tokens.weight: one Parameter, two holders
    out["tied"] = {"dp": data_parallel(ctx, tied, tied=True), "tp": tensor_parallel(ctx, tied, tied=True),
                   "dtensor": dtensor_parallel(ctx, tied, tied=True)}
    return out if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def result():
    return launch(rank_checks, 2)[0]


def ledger_of(comm):
    return {op: (v["count"], v["bytes"]) for op, v in comm.items()}


# --- data parallel, ZeRO, FSDP -----------------------------------------------------------------------

WRAPPERS = ["bucketed", "zero1", "zero2", "fsdp"]
TIES = [pytest.param(False, id="untied"), pytest.param(True, id="tied")]


def of(result, tied):
    return result["tied"] if tied else result


@pytest.mark.parametrize("tied", TIES)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrappers_train_transformers_llama_like_one_process(result, wrapper, tied, measured):
    """Tied: lm_head.weight is embed_tokens.weight (tie_word_embeddings=True), one Parameter, two holders."""
    r = of(result, tied)["dp"][wrapper]
    measured(f"{wrapper}{' tied' if tied else ''}: loss {r['loss_err']:.1e}, params {r['param_err']:.1e}")
    assert r["loss_err"] <= TOL and r["param_err"] <= TOL, (wrapper, r)


@pytest.mark.parametrize("tied", TIES)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_theory_from_the_wrapped_llama_equals_the_ledger(result, wrapper, tied):
    """comm_theory() == the ledger of step 3, op by op (and model_theory's function of the bare module)."""
    r = of(result, tied)["dp"][wrapper]
    assert ledger_of(r["ledger"]) == r["theory"], (wrapper, r)
    if "model" in r:
        assert r["model"] == r["theory"], (wrapper, r)


def test_fsdp_reduce_scatters_a_tied_unit_once_per_holder(result):
    """Untied: 16 units (7 per block, embedding, head). Tied: Zero2 has 15 (one Parameter), FSDP
    gathers the shared unit in each holder and reduce-scatters each holder's gradient (summed into
    the one shard): 16 reduce-scatters, the tied (98, 32) unit twice (measured; its theory says so)."""
    untied, tied = result["dp"], result["tied"]["dp"]
    assert untied["zero2"]["theory"]["reduce_scatter"][0] == untied["fsdp"]["theory"]["reduce_scatter"][0] == 16
    assert tied["zero2"]["theory"]["reduce_scatter"][0] == 15, tied["zero2"]
    rs = tied["fsdp"]["theory"]["reduce_scatter"]
    assert rs == (16, tied["zero2"]["theory"]["reduce_scatter"][1] + 98 * 32 * 8), rs


@pytest.mark.parametrize("tied", TIES)
def test_state_from_the_wrapped_llama(result, tied):
    dp = of(result, tied)["dp"]
    assert dp["bucketed"]["state"] == dp["bucketed"]["model_state"], dp["bucketed"]
    assert dp["zero1"]["state"]["optimizer"] == dp["zero1"]["measured"]["optimizer"], dp["zero1"]
    assert dp["zero2"]["state"] == dp["zero2"]["measured"], dp["zero2"]
    assert dp["fsdp"]["state"]["params"] == dp["fsdp"]["measured"]["params"], dp["fsdp"]


# --- tensor parallelism ------------------------------------------------------------------------------


def test_plan_is_transformers_own_plus_the_vocabulary():
    """The block entries are transformers' LlamaConfig.base_model_tp_plan, names and styles (no launch)."""
    ours = {k.removeprefix("model."): s for k, s in LLAMA_PLAN.items() if ".layers." in k}
    assert ours == LlamaConfig.base_model_tp_plan
    assert llama().config._attn_implementation == "sdpa"  # not eager's float32 softmax
    assert tp.check_plan(made(lambda: LlamaForCausalLM(config()).to("meta")), LLAMA_PLAN, 2)


def test_stage_split_puts_every_llama_parameter_in_one_stage():
    """parallel/llama.py's stage split passes the pipeline seam's static checks on transformers' Llama
    (every parameter in exactly one stage; no launch), and refuses layer counts it cannot split evenly."""
    stages = pp.check_stages(made(lambda: LlamaForCausalLM(config()).to("meta")), stage_split(LAYERS, 2), 2)
    assert [len(s) for s in stages] == [2, 3]  # embedding + layer 0 | layer 1 + norm + head
    with pytest.raises(ValueError, match="do not split into 2 equal stages"):
        stage_split(3, 2)


@pytest.mark.parametrize("plan", ["tp", "tp_unshared", "dtensor", "tp tied", "dtensor tied"])
def test_tp_plans_train_transformers_llama_like_one_process(result, plan, measured):
    """V = 97 over 2 ranks (49 rows each, one padding row), GQA k/v (2 heads: 1 per rank). Tied:
    the embedding and the head hold one (49, 32) shard (the DTensor path used to train two copies)."""
    name, tied = plan.split()[0], plan.endswith("tied")
    r = of(result, tied)[name]
    measured(f"{plan}: loss {r['loss_err']:.1e}, params {r['param_err']:.1e}"
             + (f", step-0 grads {r['grad0_err']:.1e}" if "grad0_err" in r else ""))
    assert r["loss_err"] <= TOL and r["param_err"] <= TOL, (plan, r)
    assert r["one_parameter"] == tied, r
    if "grad0_err" in r:
        assert r["grad0_err"] <= TOL, r
        assert r["local"] == ((49, 32), (49, 32), (8, 32)), r


def test_llama_tp_pays_megatrons_all_reduces(result, measured):
    """One training step, from the ledger. Megatron: per block 2 forward g (after o_proj, down_proj)
    and 2 backward f (one for q, k, v; one for gate, up): 4·L = 8; plus the embedding's g, the
    head's f and the vocabulary-parallel loss's 2 (MAX of the row max, one SUM of (2, B, T)): 12.
    One f per projection (shared_f=False) pays 7 per block: 18. DTensor's ColwiseParallel is one f
    per projection too (7 per block) and loss_parallel all-reduces 3 (B, T) tensors: 7·L + 5 = 19.
    Tying the head to the embedding changes none of these."""
    tp_, unshared, dt = result["tp"]["ledger"], result["tp_unshared"]["ledger"], result["dtensor"]["ledger"]
    measured(f"all-reduces per step: apply_plan {tp_}, one f per projection {unshared}, DTensor {dt}")
    assert tp_ == {"all_reduce": 4 * LAYERS + 4} and tp_["all_reduce"] == 12, tp_
    assert unshared == {"all_reduce": 7 * LAYERS + 4}, unshared
    assert dt == {"all_reduce": 7 * LAYERS + 5}, dt
    assert result["tied"]["tp"]["ledger"] == tp_ and result["tied"]["dtensor"]["ledger"] == dt, result["tied"]


def test_plan_refuses_splitting_the_kv_heads():
    """tp = 4 would split 2 key-value heads (GQA) over 4 ranks: check_plan refuses before anything
    changes, naming the module (no launch)."""
    model = made(lambda: LlamaForCausalLM(config()).to("meta"))
    with pytest.raises(tp.PlanError, match=r"'model\.layers\.0\.self_attn\.k_proj'.*2 heads of head_dim=8 "
                                                r"over tp=4"):
        tp.check_plan(model, LLAMA_PLAN, 4)


def test_dtensor_plan_refuses_a_tied_weight_split_unlike():
    """The tied embedding split ('vocab_embed') and its head left whole: refused before anything
    changes or communicates (no mesh needed, no launch)."""
    model = llama(tied=True)  # (not .to("meta"): Module.to makes one Parameter per holder, untying them)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(tp.PlanError, match=r"'model\.embed_tokens\.weight' \(vocab_embed\), "
                                                r"'lm_head\.weight' \(replicated\)"):
        tp.apply_dtensor_plan(model, {"model.embed_tokens": "vocab_embed"}, mesh=None)
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.model.embed_tokens._forward_hooks


# --- heavier: the data-parallel wrappers at world size 4 (slow tier) ----------------------------------


def rank_dp_only(ctx):
    out = {tied: data_parallel(ctx, reference(tied), tied) for tied in (False, True)}
    return out if ctx.rank == 0 else None


@pytest.mark.slow
def test_wrappers_at_world_size_4(measured):
    """One row per rank; the (97, 32) embedding and head padded to 100 rows (25 per rank) in ZeRO-2 / FSDP."""
    result = launch(rank_dp_only, 4)[0]
    for tied, dp in result.items():
        for wrapper, r in dp.items():
            measured(f"N=4 {wrapper}{' tied' if tied else ''}: loss {r['loss_err']:.1e}, params {r['param_err']:.1e}")
            assert r["loss_err"] <= TOL and r["param_err"] <= TOL, (wrapper, tied, r)
            assert ledger_of(r["ledger"]) == r["theory"], (wrapper, tied, r)
            if "model" in r:
                assert r["model"] == r["theory"], (wrapper, tied, r)
