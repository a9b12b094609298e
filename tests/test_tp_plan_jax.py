"""Tensor parallelism by a PLAN on Flax NNX models the project does not own (issue 24, JAX):
``parallel.tp.apply_plan`` in both styles against single-device training of the same model from the
same weights, 3 AdamW steps at tp = 2; the psum count of a Llama-like model against Megatron's;
every refusal of ``check_plan``.

Models (defined here): ``Llama`` — separate q, k, v, o with grouped-query attention (4 query / 2 kv
heads), SwiGLU gate / up / down, RMSNorm, an untied head, a vocabulary of 13 (tp = 2 does not divide
it: the embedding and the head are padded to 7 rows per device); ``BiasedMLP`` — LayerNorm and
biased Linears (the colwise bias split, the rowwise one added once after the psum).

Tolerance: float64, 1e-12. The parallel step computes the same sums split over two devices (the
psums add the partial sums in another order), ~1e-16 relative per op; 3 AdamW steps carry that to
~1e-15. 1e-12 leaves three orders of margin and sits far below any layout defect (a bias added on
both devices, a missing f, a shard used as a full weight change the loss at 1e-2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params
from own_models_jax import STEPS, adamw, flat, train_single

from jax_impl.devices import make_mesh
from jax_impl.ledger import comm_from_hlo
from jax_impl.parallel.tp import PlanError, apply_plan, check_plan, cross_entropy

TOL = 1e-12  # float64: see the module docstring
V, D, T, B, N, HD, LAYERS = 13, 8, 6, 4, 2, 2, 2
F64 = {"param_dtype": jnp.float64, "dtype": jnp.float64}


class Attention(nnx.Module):
    """Separate q, k, v (grouped-query) or, ``fused``, one biased [q|k|v] Linear (multi-head)."""

    def __init__(self, rngs, heads=4, kv_heads=2, head_dim=HD, fused=False):
        self.head_dim = head_dim  # check_plan reads it: whole heads per device
        if fused:
            self.qkv = nnx.Linear(D, 3 * heads * head_dim, rngs=rngs, **F64)
        else:
            self.q = nnx.Linear(D, heads * head_dim, use_bias=False, rngs=rngs, **F64)
            self.k = nnx.Linear(D, kv_heads * head_dim, use_bias=False, rngs=rngs, **F64)
            self.v = nnx.Linear(D, kv_heads * head_dim, use_bias=False, rngs=rngs, **F64)
        self.o = nnx.Linear(heads * head_dim, D, use_bias=False, rngs=rngs, **F64)

    def __call__(self, h):  # (B, T, D); under TP q holds H/tp heads, k and v Hkv/tp: the -1 below
        b, t, _ = h.shape
        qkv = jnp.split(self.qkv(h), 3, axis=-1) if hasattr(self, "qkv") else (self.q(h), self.k(h), self.v(h))
        q, k, v = (a.reshape(b, t, -1, self.head_dim) for a in qkv)  # (B, T, h, dh)
        k, v = (jnp.repeat(a, q.shape[2] // k.shape[2], axis=2) for a in (k, v))  # GQA: kv head per group
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.head_dim)  # (B, h, T, T)
        probs = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf), axis=-1)
        return self.o(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, -1))  # (B, T, D)


class SwiGLU(nnx.Module):
    def __init__(self, rngs):
        self.gate = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs, **F64)
        self.up = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs, **F64)
        self.down = nnx.Linear(2 * D, D, use_bias=False, rngs=rngs, **F64)

    def __call__(self, h):
        return self.down(jax.nn.silu(self.gate(h)) * self.up(h))  # (B, T, 2D/tp) inside


class Block(nnx.Module):
    def __init__(self, rngs, **attn):
        self.norm1, self.norm2 = nnx.RMSNorm(D, rngs=rngs, **F64), nnx.RMSNorm(D, rngs=rngs, **F64)
        self.attn, self.mlp = Attention(rngs, **attn), SwiGLU(rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Llama(nnx.Module):
    def __init__(self, rngs, layers=LAYERS, **attn):
        self.emb = nnx.Embed(V, D, rngs=rngs, **F64)
        self.blocks = nnx.List([Block(rngs, **attn) for _ in range(layers)])
        self.norm = nnx.RMSNorm(D, rngs=rngs, **F64)
        self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs, **F64)  # untied

    def __call__(self, tokens):
        x = self.emb(tokens)  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, V); colwise_vocab: (B, T, ⌈V/tp⌉) per device


LLAMA_PLAN = {"emb": "vocab_embed", "blocks.*.attn.[qkv]": "colwise", "blocks.*.attn.o": "rowwise",
              "blocks.*.mlp.gate": "colwise", "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise",
              "head": "colwise_vocab"}


class BiasedMLP(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs, **F64)
        self.up = nnx.Linear(D, 4 * D, rngs=rngs, **F64)
        self.down = nnx.Linear(4 * D, D, rngs=rngs, **F64)
        self.out = nnx.Linear(D, 3, rngs=rngs, **F64)  # 3 features: replicated

    def __call__(self, x):  # (B, D)
        h = x + self.down(jax.nn.gelu(self.up(self.norm(x)), approximate=False))  # (B, 4D/tp) inside
        return self.out(h)


MLP_PLAN = {"up": "colwise", "down": "rowwise"}


def llama_loss(model, tokens, targets):
    return cross_entropy(model(tokens), targets)


def mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)




def data(kind, seed=0):
    rng = np.random.default_rng(seed)
    if kind in ("llama", "fused"):
        return rng.integers(0, V, (B, T)).astype(np.int32), rng.integers(0, V, (B, T)).astype(np.int32)
    return rng.normal(size=(B, D)), rng.normal(size=(B, 3))


FUSED_PLAN = {"emb": "vocab_embed", "blocks.*.attn.qkv": "colwise_heads", "blocks.*.attn.o": "rowwise",
              "head": "colwise_vocab"}  # the SwiGLU replicated
MODELS = {"llama": (lambda: Llama(nnx.Rngs(0)), LLAMA_PLAN, llama_loss),
          "mlp": (lambda: BiasedMLP(nnx.Rngs(1)), MLP_PLAN, mse),
          "fused": (lambda: Llama(nnx.Rngs(2), layers=1, heads=2, fused=True), FUSED_PLAN, llama_loss)}




def single_device(kind):
    """The reference: plain NNX on one device, the same AdamW and loss."""
    make, _, loss = MODELS[kind]
    return train_single(make(), loss, *data(kind))


CACHE: dict = {}


def parallel(kind, style):
    if (kind, style) not in CACHE:
        make, plan, loss = MODELS[kind]
        trainer = apply_plan(make(), plan, loss, adamw(), make_mesh(N, "tp"), style)
        x, y = data(kind)
        CACHE[kind, style] = trainer, [trainer.train_step(x, y) for _ in range(STEPS)]
    return CACHE[kind, style]


@pytest.mark.parametrize("style", ["shard_map", "jit"])
@pytest.mark.parametrize("kind", ["llama", "mlp", "fused"])
def test_parity_with_single_device(kind, style, measured):
    ref_losses, ref = single_device(kind)
    trainer, losses = parallel(kind, style)
    got = flat(trainer.module())
    assert got.keys() == ref.keys() and all(got[k].shape == ref[k].shape for k in ref)  # padding dropped
    diff = {k: np.abs(got[k] - ref[k]) for k in ref}
    if kind == "fused":  # the k bias: its true gradient is 0 (softmax is shift-invariant), so AdamW's
        k_bias = diff.pop("blocks.0.attn.qkv.bias")  # m/(√v + eps) turns ~1e-18 of rounding into 1e-11 steps
        assert np.max(k_bias[4:8]) < 1e-9 and np.max(np.delete(k_bias, np.s_[4:8])) <= TOL, k_bias
    err = max(float(np.max(d)) for d in diff.values())
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    measured(f"{kind}/{style}: max |param - single device| = {err:.2e}, loss {loss_err:.2e}")
    assert err <= TOL and loss_err <= TOL, (err, loss_err)


def test_llama_plan_splits_what_it_says():
    styles = check_plan(MODELS["llama"][0](), LLAMA_PLAN, N)
    assert styles["emb.embedding"] == "vocab_embed" and styles["head.kernel"] == "colwise_vocab"
    assert {k for k, s in styles.items() if s == "colwise"} == {
        f"blocks.{i}.{m}.kernel" for i in range(LAYERS) for m in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up")}
    mlp = check_plan(MODELS["mlp"][0](), MLP_PLAN, N)
    assert mlp == {"up.kernel": "colwise", "up.bias": "colwise", "down.kernel": "rowwise"}  # down.bias replicated
    trainer = parallel("llama", "shard_map")[0]
    assert trainer.state[0]["emb.embedding"].shape == (14, D) and trainer.state[0]["head.kernel"].shape == (D, 14)
    assert trainer.state[0]["blocks.0.attn.k.kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "tp")


def _psums(jaxpr, counts=None) -> dict[str, int]:
    """psum / pmax equations of a jaxpr, nested ones included (the program as traced)."""
    counts = {} if counts is None else counts
    for e in jaxpr.eqns:
        if e.primitive.name in ("psum_invariant", "psum", "pmax"):
            counts[e.primitive.name] = counts.get(e.primitive.name, 0) + 1
        for sub in jaxprs_in_params(e.params):
            _psums(sub, counts)
    return counts


def test_llama_pays_megatrons_all_reduces():
    """Sibling projections share one f: per block 2 psums of B·T·D forward (after o, down) and 2
    backward (before q|k|v, before gate|up), + the embedding's g, the head's f, the loss's pmax and
    psum of (2, B, T): (4L+2) + 2 all-reduces, (4L+2)·B·T·D·8 + 3·B·T·8 bytes (tp_transformer_comm).
    One f per projection traces 3 more backward psums per block (q, k, v: 3; gate, up: 2); XLA's
    all-reduce reassociation (psum(a) + psum(b) -> psum(a + b)) happens to fold them back on CPU."""
    trainer = parallel("llama", "shard_map")[0]
    comm = comm_from_hlo(trainer.compiled_text())
    act, rows = B * T * D * 8, B * T * 8
    assert comm == {"all_reduce": {"count": 4 * LAYERS + 4, "bytes": (4 * LAYERS + 2) * act + 3 * rows}}, comm
    for shared, extra in ((True, 0), (False, 3)):  # one block: 7 psums (4 fwd incl. the loss's, 3 bwd) + pmax
        trainer = apply_plan(Llama(nnx.Rngs(0), layers=1), LLAMA_PLAN, llama_loss, adamw(), make_mesh(N, "tp"),
                             shared_f=shared)
        traced = jax.make_jaxpr(trainer.step)(*trainer.state, *trainer.replicate(*data("llama")))
        assert _psums(traced.jaxpr) == {"psum_invariant": 7 + extra, "pmax": 1}, (shared, _psums(traced.jaxpr))


def test_jit_ledger(measured):
    """GSPMD picks the collectives from the shardings: reported, not asserted."""
    measured(f"llama/jit: {comm_from_hlo(parallel('llama', 'jit')[0].compiled_text())}")


def _refused(model, plan, match):
    with pytest.raises(PlanError, match=match):
        check_plan(model, plan, N)


def test_refuses_a_key_matching_no_module():
    _refused(BiasedMLP(nnx.Rngs(0)), {"upp": "colwise"}, r"key 'upp' \(colwise\) matches no module.*close: \['up'\]")


def test_refuses_an_unknown_style():
    _refused(BiasedMLP(nnx.Rngs(0)), {"up": "columnwise"}, "unknown style 'columnwise'")


def test_refuses_a_style_on_a_module_it_cannot_split():
    _refused(BiasedMLP(nnx.Rngs(0)), {"norm": "colwise"}, r"'colwise' at 'norm' \(LayerNorm\).*nnx.Linear")
    _refused(BiasedMLP(nnx.Rngs(0)), {"up": "vocab_embed"}, r"'vocab_embed' at 'up' \(Linear\).*nnx.Embed")


def test_refuses_two_styles_on_one_module():
    _refused(BiasedMLP(nnx.Rngs(0)), {"up": "colwise", "u*": "rowwise"}, "give each module one style")


def test_refuses_sizes_tp_does_not_divide():
    _refused(BiasedMLP(nnx.Rngs(0)), {"out": "colwise"}, "out_features=3 is not divisible by tp=2")
    model = BiasedMLP(nnx.Rngs(0))
    model.down = nnx.Linear(5, D, rngs=nnx.Rngs(0), **F64)
    _refused(model, {"down": "rowwise"}, "in_features=5 is not divisible by tp=2")


def test_refuses_part_of_a_head_on_a_device():
    """One kv head of head_dim 4 (multi-query): its 4 columns divide by 2, its 1 head does not."""
    model = Llama(nnx.Rngs(0), layers=1, heads=2, kv_heads=1, head_dim=4)
    _refused(model, {"blocks.*.attn.k": "colwise"}, r"'colwise' at 'blocks.0.attn.k'.*split 1 heads of head_dim=4")


def test_refuses_a_fused_qkv_split_across_heads():
    model = Llama(nnx.Rngs(0), layers=1, heads=3, fused=True)
    _refused(model, {"blocks.*.attn.qkv": "colwise_heads"}, r"split 3 heads of head_dim=2 over tp=2")
    del model.blocks[0].attn.head_dim
    _refused(model, {"blocks.*.attn.qkv": "colwise_heads"}, r"head_dim=None.*give the attention module a head_dim")


def test_refuses_a_stacked_kernel():
    model = BiasedMLP(nnx.Rngs(0))
    model.up.kernel = nnx.Param(jnp.zeros((2, D, 4 * D)))
    _refused(model, MLP_PLAN, r"kernel has shape \(2, 8, 32\), not \(in, out\)")


def test_refuses_a_split_output_reaching_the_loss():
    loss = lambda m, x, y: jnp.mean(m.up(x) ** 2)  # (B, 4D/tp): no rowwise after it
    trainer = apply_plan(BiasedMLP(nnx.Rngs(0)), {"up": "colwise"}, loss, adamw(), make_mesh(N, "tp"))
    with pytest.raises(PlanError, match="a split output \\(colwise\\) reaches it without a rowwise"):
        trainer.train_step(*data("mlp"))


def test_refuses_a_parent_reading_a_split_module():
    """A tied head read as ``self.emb.attend(h)``: the table is split there (found at the first trace)."""

    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(V + 1, D, rngs=rngs, **F64)

        def __call__(self, tokens):
            return self.emb.attend(jnp.tanh(self.emb(tokens)))

    trainer = apply_plan(Tied(nnx.Rngs(0)), {"emb": "vocab_embed"}, llama_loss, adamw(), make_mesh(N, "tp"))
    with pytest.raises(PlanError, match="'attend' of 'emb' .* was read by its parent"):
        trainer.train_step(*data("llama"))


def test_refuses_a_module_reachable_from_two_places():
    model = BiasedMLP(nnx.Rngs(0))
    model.again = model.up  # one module, two paths: only one place would get f
    _refused(model, MLP_PLAN, r"'colwise' at 'up' \(Linear\): the module is reachable from 2 places")


def test_refuses_a_mesh_without_the_axis_and_an_unknown_style():
    with pytest.raises(PlanError, match=r"no 'tp'. Fix: pass axis="):
        apply_plan(BiasedMLP(nnx.Rngs(0)), MLP_PLAN, mse, adamw(), make_mesh(N, "dp"))
    with pytest.raises(PlanError, match="unknown style 'pjit'"):
        apply_plan(BiasedMLP(nnx.Rngs(0)), MLP_PLAN, mse, adamw(), make_mesh(N, "tp"), style="pjit")
    with pytest.raises(PlanError, match="style 'typed' is not built for a plan: .* Fix: style='shard_map' or 'jit'"):
        apply_plan(BiasedMLP(nnx.Rngs(0)), MLP_PLAN, mse, adamw(), make_mesh(N, "tp"), style="typed")


def test_refuses_non_param_state():
    model = BiasedMLP(nnx.Rngs(0))
    model.stats = nnx.BatchStat(jnp.zeros(3))
    _refused(model, MLP_PLAN, r"state other than nnx.Param \(stats\)")


def test_refuses_a_tied_parameter():
    model = BiasedMLP(nnx.Rngs(0))
    model.twin = nnx.Linear(D, 4 * D, rngs=nnx.Rngs(0), **F64)
    model.twin.kernel = model.up.kernel
    _refused(model, MLP_PLAN, r"'up'.*Param 'kernel' is also held by \['twin'\] \(tied\)")


def test_refuses_split_logits_without_cross_entropy():
    make, plan, _ = MODELS["llama"]
    wrong = lambda m, x, y: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    trainer = apply_plan(Llama(nnx.Rngs(0), layers=1), plan, wrong, adamw(), make_mesh(N, "tp"))
    with pytest.raises(PlanError, match="never called parallel.tp.cross_entropy"):
        trainer.train_step(*data("llama"))
