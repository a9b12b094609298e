"""The run configuration: one frozen dataclass that validates itself.

``Config(...)`` checks what holds for every pattern (positive sizes, known dtype, AdamW
hyper-parameters in range); ``cfg.check(pattern)`` adds what one pattern needs (divisibility by
the world size, micro-batches, ...). Both raise ``ValueError`` with a message that names the
offending values, so the CLI can print one line and exit 2 before any process starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DTYPES = ("float32", "float64", "bfloat16")
PATTERNS = ("collectives", "dp", "fsdp", "tp", "pp", "cp")
SEQUENCE_PATTERNS = ("cp",)  # patterns that split the sequence: the transformer only
MODELS = ("mlp", "transformer")
BYTES_PER_ELEMENT = {"float32": 4, "float64": 8, "bfloat16": 2}


@dataclass(frozen=True)
class Config:
    world_size: int = 4
    layers: int = 4
    dim: int = 32
    batch: int = 32
    microbatches: int = 4
    steps: int = 5
    seed: int = 0
    dtype: str = "float64"
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    bucket_mb: float = 25.0  # DDP-style bucket size for the bucketed DP variant
    # The workload: "mlp" (CS336 lecture 8) or "transformer" (GPT-style decoder, shared.problem).
    # heads / seq / vocab are read by the transformer only (dim, layers, batch by both).
    model: str = "mlp"
    heads: int = 2
    seq: int = 8
    vocab: int = 32

    def __post_init__(self) -> None:
        for name in ("world_size", "layers", "dim", "batch", "microbatches", "steps", "heads", "seq", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not self.lr > 0:  # `not x > 0` also refuses NaN
            raise ValueError(f"lr must be > 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not self.weight_decay >= 0:  # also refuses NaN
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.model == "transformer" and self.dim % self.heads:
            raise ValueError(f"transformer: dim={self.dim} is not divisible by heads={self.heads} "
                             "(every head has dim/heads features)")

    @property
    def bytes_per_element(self) -> int:
        return BYTES_PER_ELEMENT[self.dtype]

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def zigzag_chunks(self) -> int:
        """cp's ring_zigzag cuts the sequence into 2·cp chunks (rank r takes r and 2·cp−1−r)."""
        return 2 * self.world_size

    def applies(self, pattern: str) -> bool:
        """Whether ``pattern`` has something to split on this model (cp needs a sequence)."""
        return not (pattern in SEQUENCE_PATTERNS and self.model != "transformer")

    @property
    def n_params(self) -> int:
        """Φ: parameter count. MLP: L weights of D×D, no biases. Transformer: embeddings
        (V + T)·D, per layer 12·D² (W_qkv 3D², W_o D², W_up 4D², W_down 4D²) + 2·D (norm gains),
        final norm D, head D·V."""
        d = self.dim
        if self.model == "mlp":
            return self.layers * d * d
        return (self.vocab + self.seq) * d + self.layers * (12 * d * d + 2 * d) + d + d * self.vocab

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def check(self, pattern: str) -> Config:
        """Validate what ``pattern`` needs on top of the basic checks; returns self."""
        if pattern not in PATTERNS:
            raise ValueError(f"unknown pattern {pattern!r}; choose from {', '.join(PATTERNS)}")
        name = pattern if self.model == "mlp" else f"{pattern} ({self.model})"
        if not self.applies(pattern):
            raise ValueError(f"{pattern}: the {self.model} has no sequence to split (use --model transformer)")
        for size, by, why in self.divisibility(pattern):
            if getattr(self, size) % getattr(self, by):
                raise ValueError(f"{name}: {size}={getattr(self, size)} is not divisible by "
                                 f"{by}={getattr(self, by)} ({why})")
        return self

    def divisibility(self, pattern: str) -> list[tuple[str, str, str]]:
        """What ``pattern`` splits on this model: (size, divided by, why) for every split."""
        n, mlp = "world_size", self.model == "mlp"
        batch = ("batch", n, "every rank takes an equal slice of the global batch")
        if pattern == "dp":
            return [batch]
        if pattern == "fsdp":
            why = "every weight is split into equal slices" if mlp else \
                "every matrix and embedding is split into equal row blocks"
            return [batch] + [(size, n, why) for size in (("dim",) if mlp else ("dim", "vocab", "seq"))]
        if pattern == "tp":
            if mlp:
                return [("dim", n, "every weight is split into equal slices")]
            return [("heads", n, "every rank owns whole attention heads"),
                    ("vocab", n, "embedding and head are split over the vocabulary"),
                    ("seq", n, "megatron_sp splits the sequence outside the matmuls")]
        if pattern == "pp":
            return [("layers", n, f"every stage holds the same number of {'layers' if mlp else 'blocks'}"),
                    ("batch", "microbatches", "every micro-batch has the same number of rows")]
        if pattern == "cp":
            return [("seq", n, "every rank holds T/cp tokens of every sequence"),
                    ("seq", "zigzag_chunks", "ring_zigzag: rank r takes chunks r and 2·cp−1−r"),
                    ("heads", n, "ulysses: the all-to-all hands every rank H/cp whole heads")]
        return []
