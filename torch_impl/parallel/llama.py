"""The plans for transformers' ``LlamaForCausalLM``: plain dicts and functions (transformers is not
imported here; ``cp_attention`` imports it when called, through parallel/cp.py's ``register``).

    apply_plan(model, TP_PLAN, group)                  # tp (parallel/tp.py): Megatron's splits
    pipeline(model, stage_split(layers, pp), ...)      # pp: module paths per stage (parallel/pp.py)
    LlamaForCausalLM(cp_attention(config))             # cp: every attention through the seam
    loss = ce(cp_logits(model, tokens, positions), y)  # ... at the ranks' global positions

TP_PLAN is transformers' own ``LlamaConfig.base_model_tp_plan`` (q, k, v, gate, up colwise; o, down
rowwise; under "model.") plus the vocabulary split Megatron's way: the embedding "vocab_embed" and the
head "colwise_vocab" (any V: rows padded to ⌈V/tp⌉; with tie_word_embeddings the tied weight is split
alike in both holders). Per layer: 2 all-reduces of B·T·D forward, 2 backward (parallel/tp.py). Head
counts come from the weights, so tp must divide the key-value heads (GQA): ``check_plan`` refuses
otherwise. No sequence-parallel variant: transformers' Llama computes its rotary embeddings outside
the planned modules.

``stage_split`` names the modules of each pipeline stage (embedding with the first layers, the final
norm and head with the last). ``parallel/pp.py``'s seam runs a stage as a chain of those modules; a
transformers decoder layer takes the rotary embeddings as an argument, which the chain does not pass,
so the seam's chain check decides whether a given model version runs as a plain chain.

For composition (parallel/compose.py) ``Stage(model, s, S)`` is stage s of S as ONE module that does
what ``LlamaModel.forward`` does for its layers: the embedding (first stage), the rotary embeddings
computed from ``positions`` (every stage: they carry no parameters, so each stage recomputes them
instead of sending them), the decoder layers given them, the final norm and head (last stage). It
holds the model's own modules under the model's own names (``model.layers.2.self_attn.q_proj``), so
the tp plan, FSDP units and parameter names apply to a stage unchanged. ``positions`` (T,) or the
rank's T/c global positions under cp (``cp_positions``) are set by the composition; no attention mask
(causal: SDPA's is_causal, or the cp seam).

``full_precision(model)``: transformers computes RMSNorm and RoPE's angles in float32 even in a float64
model (``.to(torch.float32)``, ``.float()``), ~1e-7 from float64. It makes every RMSNorm and the rotary
embedding compute the same formulas in the input's dtype — what the JAX twin (jax_impl/parallel/llama.py)
computes, so the two frameworks' float64 losses agree to ~1e-15 (float32 arithmetic of two libraries
does not agree to the last bit).
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn as nn

from torch_impl.parallel.cp import register

TP_PLAN = {
    "model.embed_tokens": "vocab_embed",
    "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_vocab",
}


def stage_split(layers: int, stages: int) -> list[list[str]]:
    """Module paths per pipeline stage: ``layers`` decoder layers in ``stages`` equal runs, the
    embedding before the first, the final norm and the head after the last."""
    if stages < 1 or layers % stages:
        raise ValueError(f"llama stage_split: {layers} layers do not split into {stages} equal stages. Fix: a "
                         f"stage count that divides {layers}")
    per = layers // stages
    split = [[f"model.layers.{l}" for l in range(s * per, (s + 1) * per)] for s in range(stages)]
    split[0].insert(0, "model.embed_tokens")
    split[-1] += ["model.norm", "lm_head"]
    return split


def cp_attention(config):
    """``config`` (a LlamaConfig) with every attention routed through the cp seam (parallel/cp.py:
    registered in transformers' attention registry as ``cp.NAME``). Returns ``config``."""
    config._attn_implementation = register()
    return config


def cp_logits(model, tokens, positions):
    """Logits (B, T/N, V) of this rank's tokens (B, T/N) at their GLOBAL positions (T/N,): the seam
    refuses a step whose position_ids are the local arange transformers makes when given none."""
    return model(input_ids=tokens, position_ids=positions[None]).logits


class Stage(nn.Module):
    """Stage ``s`` of ``S`` of a transformers ``LlamaForCausalLM`` (``stage_split``'s layers) as one
    module: tokens (B, T) -> hidden (B, T, D) on the first stage, hidden -> hidden in the middle,
    -> logits (B, T, V) on the last (S = 1: tokens -> logits, the whole model)."""

    def __init__(self, model: nn.Module, s: int = 0, stages: int = 1):
        super().__init__()
        paths = stage_split(len(model.model.layers), stages)[s]
        self.first, self.last, self.positions = s == 0, s == stages - 1, None  # positions: set by compose
        self.model = nn.Module()  # the model's names: model.embed_tokens, model.layers.{i}, model.norm, lm_head
        self.model.layers = nn.ModuleDict({p.rsplit(".", 1)[1]: model.get_submodule(p)
                                           for p in paths if p.startswith("model.layers.")})
        if self.first:
            self.model.embed_tokens = model.model.embed_tokens
        if self.last:
            self.model.norm, self.lm_head = model.model.norm, model.lm_head
        self.rotary = [model.model.rotary_emb]  # no parameters; a list: not this module's child

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.first:
            h = self.model.embed_tokens(h)  # (B, T) ids -> (B, T, D)
        pos = self.positions if self.positions is not None else torch.arange(h.shape[1], device=h.device)
        ids = pos[None]  # (1, T): the GLOBAL positions (the cp seam checks them)
        rope = self.rotary[0](h, position_ids=ids)  # (cos, sin), each (1, T, hd)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=None, position_ids=ids, position_embeddings=rope)
        return self.lm_head(self.model.norm(h)) if self.last else h


def _rms(self, x: torch.Tensor) -> torch.Tensor:  # transformers' LlamaRMSNorm without its float32 cast
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rope(self, x: torch.Tensor, position_ids: torch.Tensor):  # LlamaRotaryEmbedding in x's dtype
    dim = self.inv_freq.shape[0] * 2
    inv = 1.0 / (self.config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=x.dtype,
                                                                            device=x.device) / dim))
    emb = torch.cat([position_ids[..., None].to(x.dtype) * inv] * 2, dim=-1)  # (1, T, hd)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def full_precision(model: nn.Module) -> nn.Module:
    """Every RMSNorm and rotary embedding of a transformers Llama computed in its input's dtype (the module
    docstring); refuses a RoPE scaling other than the default, whose inverse frequencies it would not recompute."""
    for path, m in model.named_modules():
        kind = type(m).__name__
        if kind.endswith("RotaryEmbedding"):
            if getattr(m, "rope_type", "default") != "default":
                raise ValueError(f"llama.full_precision: {path!r} uses rope_type={m.rope_type!r}; only the default "
                                 "RoPE is recomputed in float64. Fix: leave the model as it is (float32 angles)")
            m.forward = MethodType(_rope, m)
        elif kind.endswith("RMSNorm"):
            m.forward = MethodType(_rms, m)
    return model
