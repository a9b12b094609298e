"""A model and a layout at any size: what the formulas of mesh.py, pp.py and recompute.py take, for
the tiny runs (``Model.from_config(cfg)``, ``Layout.from_config(cfg)``) and for ``compare.py plan``
at full size alike.

Quantities: the decoder's sizes (L, D, H, V, T, MLP ratio, E experts, top k), Φ and the parameters a
token uses, training FLOPs per token (Kaplan et al. 2020, arXiv:2001.08361: 6 per parameter, plus
attention); a layout's axis sizes (data × pp × cp × tp, ep inside the data axis), ZeRO stage
(Rajbhandari et al. 2020, arXiv:1910.02054), micro-batches, sequence parallelism (Korthikanti et al.
2022, arXiv:2205.05198), recompute policy and model chunks per pipeline rank (Narayanan et al. 2021,
arXiv:2104.04473), and its 1F1B / interleaved bubble.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    """The repo's GPT-style decoder (shared/problem.py) at any size: learned positions, RMSNorm gains,
    no biases, MLP D → r·D → D with GELU, untied head; MoE: a router and E such MLPs per block.
    Beyond the runs (compare.py plan): ``kv_heads`` < heads is grouped-query attention (Ainslie et al.
    2023, arXiv:2305.13245: W_qkv is D × (D + 2·kv·D/H)); ``ffn`` any FFN width (default r·D);
    ``gated`` a SwiGLU MLP (Shazeer 2020, arXiv:2002.05202: W_gate, W_up D×F and W_down F×D);
    ``rope`` rotary positions (no wpe, Su et al. 2021, arXiv:2104.09864); ``dropout`` the dropout of
    GPT-2/3 and Megatron's GPT (its masks, its memory-bound work); ``bias`` linear and LayerNorm biases;
    ``tied`` the head shares the token embedding (Narayanan et al. 2021 eq. 2 counts
    12·l·h² + 13·l·h + (V + s)·h for such a model)."""

    layers: int
    dim: int
    heads: int
    vocab: int
    seq: int
    mlp_ratio: int = 4
    experts: int = 0
    topk: int = 1
    kv_heads: int = 0  # 0: = heads (multi-head attention)
    ffn_dim: int = 0  # 0: mlp_ratio · dim
    gated: bool = False  # SwiGLU: three matrices
    rope: bool = False  # rotary positions: no learned position table
    dropout: bool = False
    bias: bool = False  # GPT-2/3: biases on every linear layer and LayerNorm (gain + bias)
    tied: bool = False  # the head is the token embedding (GPT-2/3, Megatron's GPT)

    def __post_init__(self) -> None:
        for name in ("layers", "dim", "heads", "vocab", "seq", "mlp_ratio", "topk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} is not divisible by heads={self.heads}")
        if self.kv_heads < 0 or self.ffn_dim < 0 or (self.kv_heads and self.heads % self.kv_heads):
            raise ValueError(f"kv_heads must divide heads={self.heads} and ffn_dim be >= 0, got "
                             f"kv_heads={self.kv_heads}, ffn_dim={self.ffn_dim}")
        if self.experts == 1 or self.experts < 0 or self.topk > max(self.experts, 1):
            raise ValueError(f"experts must be 0 or >= 2 and topk <= experts, got E={self.experts}, k={self.topk}")

    @classmethod
    def from_config(cls, cfg) -> Model:
        return cls(cfg.layers, cfg.dim, cfg.heads, cfg.vocab, cfg.seq, 4, cfg.experts, cfg.topk)

    @property
    def ffn(self) -> int:
        return self.ffn_dim or self.mlp_ratio * self.dim

    @property
    def kv(self) -> int:
        """K/V heads (GQA: fewer than the query heads)."""
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv heads × head dim (= D without GQA)."""
        return self.kv * self.head_dim

    @property
    def positions(self) -> int:
        """Rows of the learned position table (0 with RoPE)."""
        return 0 if self.rope else self.seq

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def attn_elements(self) -> int:
        """W_qkv D·(D + 2·kv_dim) and W_o D²: 4D² without GQA."""
        return self.dim * (self.dim + 2 * self.kv_dim) + self.dim * self.dim

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def block_units(self, t: int = 1, ep: int = 1) -> tuple[int, int]:
        """(count, elements) of one block's ≥2-D parameters on one rank: W_qkv 3D²/t (GQA: D·(D + 2·kv_dim)/t),
        W_o D²/t, and W_up, W_down D·F/t (SwiGLU: + W_gate) — or the router D·E and the E/ep local
        experts' stacked MLPs."""
        d, f, g = self.dim, self.ffn, self.gated
        if self.moe:
            return 5 + g, self.attn_elements // t + d * self.experts + self.mlp_matrices * (self.experts // ep) * d * f
        return 4 + g, (self.attn_elements + self.mlp_matrices * d * f) // t

    def expert_elements(self, ep: int = 1) -> int:
        """Elements of one block's local experts (0 when dense)."""
        return self.mlp_matrices * (self.experts // ep) * self.dim * self.ffn if self.moe else 0

    def vector_elements(self, t: int = 1) -> int:
        """One block's 1-D parameters on one rank: the 2 norms' gains (D each; with ``bias`` their biases,
        and the linear layers' biases: W_qkv's and W_up's split over tp, W_o's and W_down's whole)."""
        d = self.dim
        if not self.bias:
            return 2 * d
        return 4 * d + (d + 2 * self.kv_dim + (self.mlp_matrices - 1) * self.ffn) // t + 2 * d

    @property
    def params(self) -> int:
        """Φ, every parameter: (V + T)·D + L·(block + vectors) + D + D·V (RoPE: no T·D; tied: no D·V;
        bias: the final norm's bias too)."""
        return (self.vocab + self.positions) * self.dim + self.layers * (self.block_units()[1] +
                                                                         self.vector_elements()) + \
            self.dim * (1 + self.bias) + (not self.tied) * self.dim * self.vocab

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies by (k of the E experts)."""
        return self.params - self.layers * self.expert_elements() * (self.experts - self.topk) // max(self.experts, 1)

    def flops_per_token(self, recompute: str = "none") -> float:
        """Training FLOPs per token: 6 × the matmul parameters it uses (2 fwd + 4 bwd; the embedding
        lookups are not matmuls) + causal attention 6·L·T·D (QKᵀ and ·V over half the positions);
        full recompute runs the blocks' forward again (+2·blocks), selective the attention core (+2LTD)."""
        d, L = self.dim, self.layers
        blocks = L * self.block_units()[1] - \
            self.layers * self.expert_elements() * (self.experts - self.topk) // max(self.experts, 1)
        attn = 2 * L * self.seq * d
        extra = {"none": 0, "selective": attn, "full": 2 * blocks + attn}[recompute]
        return 6 * (blocks + d * self.vocab) + 3 * attn + extra


@dataclass(frozen=True)
class Layout:
    """One way to lay the model out: axis sizes (their product is the GPU count), the ZeRO stage of the
    data axis, M micro-batches per step (each of B/(dp·M) sequences per rank), sequence parallelism,
    the recompute policy and the model chunks per pipeline rank. ``invalid`` says what it cannot run."""

    dp: int = 1  # the data axis' size ("dp" with zero 0/1/2, "fsdp" with zero 3; HSDP: dp · fsdp)
    replicate: int = 1  # HSDP (zero 3): replicas of each shard, the dp axis (the shard group: dp / replicate)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # MoE: experts sharded over ep ranks of the data axis
    zero: int = 0
    microbatches: int = 1
    sp: bool = False  # Megatron sequence parallelism with tp
    recompute: str = "none"
    virtual: int = 1  # model chunks per pp rank (interleaved 1F1B, Narayanan et al. 2021 arXiv:2104.04473 §2.2)
    trim: int = 0  # blocks fewer on the first and on the last stage (Llama 3 405B: 126 = 7 + 14·8 + 7, §3.3.2)
    pp_scatter: bool = False  # Megatron's scatter/gather pp sends: A/t per tp rank, all-gathered over tp (§4.1)
    cp_style: str = "ring"  # "allgather": K|V all-gathered over cp, dK|dV reduce-scattered (Llama 3, §3.3.2)

    def stage_layers(self, layers: int, stage: int) -> int:
        """Blocks on pipeline stage ``stage``: (L + 2·trim)/pp, less ``trim`` on the first and the last
        (the embedding's and the head's stages; Megatron's --decoder-first/last-pipeline-num-layers)."""
        per = (layers + 2 * self.trim) // self.pp
        return per - self.trim * (stage in (0, self.pp - 1))

    @property
    def bubble(self) -> float:
        """1F1B (p−1)/(M+p−1); interleaved (p−1)/(v·M+p−1)."""
        return (self.pp - 1) / (self.virtual * self.microbatches + self.pp - 1)

    @property
    def data_axis(self) -> str:
        return "fsdp" if self.zero == 3 else "dp"

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def mesh(self) -> tuple[tuple[str, int], ...]:
        """Axes of size > 1, outermost first (pp, data, cp, tp)."""
        data = (("dp", self.replicate), ("fsdp", self.dp // self.replicate)) if self.replicate > 1 else \
            ((self.data_axis, self.dp),)
        axes = (("pp", self.pp), *data, ("cp", self.cp), ("tp", self.tp))
        return tuple((a, n) for a, n in axes if n > 1)

    @property
    def name(self) -> str:
        parts = [f"{a}={n}" for a, n in self.mesh] + ([f"ep={self.ep}"] if self.ep > 1 else [])
        return ",".join(parts) or "1 GPU"

    @property
    def grad_label(self) -> str | None:
        """The group the gradients are averaged / sharded over: data and cp (theory.mesh_grad_axes)."""
        shard = self.dp // self.replicate  # HSDP: the shard group (the replicas all-reduce over "dp")
        return "+".join(a for a, n in ((self.data_axis, shard), ("cp", self.cp)) if n > 1) or None

    @classmethod
    def from_config(cls, cfg, pattern: str = "mesh", variant: str = "") -> Layout:
        """The layout a runnable config trains: the mesh pattern (cfg.mesh) or ep (ep = dp = N)."""
        if pattern == "ep":
            return cls(dp=cfg.world_size, ep=cfg.world_size)
        fsdp = cfg.data_axis == "fsdp"
        return cls(dp=cfg.data_size, tp=cfg.axis("tp"), pp=cfg.axis("pp"), cp=cfg.axis("cp"),
                   zero=3 if fsdp else 0, microbatches=cfg.pipeline_microbatches, replicate=cfg.replicate)
