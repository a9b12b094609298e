"""The planner's machines (shared/plan.py): a GPU preset's datasheet figures (``GPUS``, ``gpu``), a link's
α–β time (``Link``, ``bus_factor``: nccl-tests' bus factor) and a ``Cluster`` of GPUs with what they achieve
(shared/efficiency.py's measured tables: ``Cluster.preset``), the defaults the time model (shared/plan_time.py)
reads: the matmul size table and FlashAttention's fraction of peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared import efficiency
from shared.plan_framework import check
from shared.theory import BUSBW_FACTOR


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus factor of ``op`` over ``n`` ranks (a point-to-point send: sendrecv's 1)."""
    return BUSBW_FACTOR.get({"send": "sendrecv"}.get(op, op), lambda n: 1.0)(n)


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per collective call
    beta: float  # bus bandwidth, bytes/s (nccl-tests' busbw: t = α + S·factor/β)
    per_op: dict = field(default_factory=dict, compare=False)  # op -> (α, β) measured (--calibrate)

    def time(self, op: str, count: int, nbytes: int, n: int) -> float:
        alpha, beta = self.per_op.get(op, (self.alpha, self.beta))
        factor = bus_factor(op, n)
        return count * alpha + nbytes * factor / beta


# GPU presets (``--gpu NAME``): peak dense (no 2:4 sparsity) BF16 = FP16 tensor-core FLOP/s, HBM bytes and
# bandwidth, NVLink (the datasheets give both directions summed: each way is half) and the inter-node
# network per GPU. SXM parts, as the published runs used.
#  A100 40 GB / 80 GB SXM: 312 TFLOP/s BF16 and FP16 dense (624 with sparsity); HBM2 1 555 GB/s (40 GB),
#    HBM2e 2 039 GB/s (80 GB); NVLink 3 600 GB/s = 300 GB/s each way (NVIDIA A100 Tensor Core GPU datasheet,
#    2021, the specifications table). Across nodes: DGX A100 has 8 single-port ConnectX-6 HDR 200 Gb/s
#    InfiniBand HCAs, one per GPU = 25 GB/s (NVIDIA DGX A100 datasheet; Narayanan et al. 2021, arXiv:2104.04473
#    §5: Selene's nodes, "eight NVIDIA 80-GB A100 GPUs … eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs").
#  H100 SXM5: 989 TFLOP/s dense BF16 and FP16 (1 979 with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 4
#    900 GB/s = 450 GB/s each way (NVIDIA H100 Tensor Core GPU datasheet, 2023, the H100 SXM column).
#  H200 SXM: 989 TFLOP/s dense BF16/FP16, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s (NVIDIA H200 Tensor Core
#    GPU datasheet, 2024, the H200 SXM column).
#  H100/H200 across nodes: one ConnectX-7 NDR InfiniBand port per GPU, 400 Gb/s = 50 GB/s (NVIDIA DGX H100
#    user guide: 8 × single-port ConnectX-7 for the compute fabric; the Llama 3 paper's 405B run, Grattafiori
#    et al. 2024 arXiv:2407.21783 §3.3.1: "400 Gbps interconnects between GPUs").
#  α (per-call latency): no vendor figure; 5 µs inside a node, 10 µs across, the order of nccl-tests'
#    small-message times on NVSwitch / InfiniBand systems — an assumption.
#  fp32 (--dtype float32) runs on the same tensor cores as TF32 here: not modelled separately.
GPUS = {
    "a100-40gb": {"memory": 40 * 10 ** 9, "flops": 312e12, "hbm": 1555e9, "intra": Link(5e-6, 300e9),
                  "inter": Link(10e-6, 25e9)},
    "a100-80gb": {"memory": 80 * 10 ** 9, "flops": 312e12, "hbm": 2039e9, "intra": Link(5e-6, 300e9),
                  "inter": Link(10e-6, 25e9)},
    "h100": {"memory": 80 * 10 ** 9, "flops": 989e12, "hbm": 3.35e12, "intra": Link(5e-6, 450e9),
             "inter": Link(10e-6, 50e9)},
    "h200": {"memory": 141 * 10 ** 9, "flops": 989e12, "hbm": 4.8e12, "intra": Link(5e-6, 450e9),
             "inter": Link(10e-6, 50e9)},
}


def gpu(name: str) -> dict:
    """The preset ``name`` (case-insensitive; "a100" = the 80 GB part), or ValueError naming the known ones."""
    key = {"a100": "a100-80gb", "h100-sxm": "h100", "h200-sxm": "h200"}.get(name.lower(), name.lower())
    if key not in GPUS:
        raise ValueError(f"unknown GPU preset {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]


# the matmul size table (smallest side, fraction of the largest GEMMs' rate): see "the matmul time model"
# (shared/plan_time.py)
SIZE_FACTOR = ((64, 0.5), (128, 0.7), (256, 0.8), (512, 0.9), (1024, 0.95), (2048, 1.0))
# FlashAttention's fused core: 50–73 % of peak forward + backward on A100 (Dao 2023, FlashAttention-2,
# arXiv:2307.08691 §4.1, Figure 5: 225 TFLOP/s of 312 at best, head dim 128); 0.5: causal, backward-heavy.
ATTENTION_EFFICIENCY = 0.5


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    memory: float = GPUS["h100"]["memory"]  # bytes per GPU
    flops: float = GPUS["h100"]["flops"]  # peak FLOP/s per GPU in the compute dtype
    efficiency: float = 0.8  # the fraction of peak the largest matmuls reach ("flat": every FLOP)
    intra: Link = GPUS["h100"]["intra"]
    inter: Link = GPUS["h100"]["inter"]

    headroom: float = 0.1  # kept free: the CUDA context, NCCL buffers, the allocator's fragmentation
    hbm: float = GPUS["h100"]["hbm"]  # HBM bytes/s (the roofline's memory bound, the elementwise ops)
    matmul: str = "shapes"  # "shapes": every matmul from its shape (roofline); "flat": FLOPs × efficiency
    size_table: tuple = SIZE_FACTOR  # (smallest side, fraction of the largest GEMMs' rate), ascending
    hbm_table: tuple = ()  # (bytes per transfer, fraction of ``hbm``), ascending; () = every size at ``hbm``
    overlap: bool | str = True  # the data axis' traffic: OVERLAPS ("backward" = True, "none" = False: after the
    #                             backward, as Megatron-LM's 2021 DDP all-reduced the gradients once it was done)
    tp_overlap: bool = False  # tensor-parallel traffic hidden behind the matmuls (torchtitan's async TP);
    #                           off by default: Megatron and plain DTensor TP run it on the critical path
    overlap_cost: tuple = (0.0, 0.0)  # (intra, inter): the fraction of an overlapped transfer's time the
    #                                   compute beside it loses (its kernels' SMs; efficiency.OVERLAP_COST)
    framework: str = "torchtitan"  # what it sends and waits for beyond the ledgers' bytes (shared/plan_framework.py)
    attention: tuple = ()  # ((heads, T, fraction of peak), ...) ascending: FlashAttention's causal forward +
    #                        backward by width (sequences × heads of a micro-batch on one rank) and sequence
    #                        length (efficiency.TABLES, a profile); () = ATTENTION_EFFICIENCY

    def __post_init__(self):
        check(self.framework)  # an unknown framework: refused, not run as the default

    @classmethod
    def preset(cls, name: str, gpus: int, dtype: str = "bfloat16", profile: dict | None = None, **kw) -> Cluster:
        """A cluster of ``gpus`` of the preset ``name`` with what it achieves (shared/efficiency.py: memory as
        the device reports it, the GEMM table by shape, HBM copy and nccl-tests busbw per op, each cited), or
        with a measured ``profile`` (efficiency.load) in their place."""
        gpu(name)  # the known names, or ValueError
        table = efficiency.TABLES[{"a100": "a100-80gb", "h100-sxm": "h100", "h200-sxm": "h200"}.get(
            name.lower(), name.lower())]
        t = {"memory": table["memory"], **(profile or table)}  # a profile without memory: the preset's
        top = max(f for _, f in t["matmul"])
        link = lambda ops: Link(*ops.get("all_gather", next(iter(ops.values()))), per_op=dict(ops))
        return cls(gpus, **{"memory": t["memory"], "flops": efficiency.peak(t, dtype),
                            "efficiency": top, "size_table": tuple((s, round(f / top, 6)) for s, f in t["matmul"]),
                            "intra": link(t["intra"]), "inter": link(t["inter"]), "hbm": t["hbm_copy"],
                            "hbm_table": tuple(t.get("hbm_table", ())),
                            "overlap_cost": tuple(t.get("overlap_cost", (0.0, 0.0))),
                            "attention": tuple(t.get("attention", ())), **kw})

    def link_cost(self, link: Link) -> float:
        """overlap_cost of ``link`` (intra or inter)."""
        return self.overlap_cost[link is self.inter and link is not self.intra]

    def hbm_at(self, nbytes: float) -> float:
        """The HBM bandwidth a transfer of ``nbytes`` streams at (hbm_table's step at its size)."""
        out = 1.0 if not self.hbm_table else self.hbm_table[0][1]
        for size, f in self.hbm_table:
            if nbytes >= size:
                out = f
        return self.hbm * out

    def attention_at(self, seq: int, width: int = 16) -> float:
        """FlashAttention's fraction of peak for ``width`` heads × sequences at sequence length ``seq``: the
        table's widest width at or below ``width`` (its narrowest below that), then its step at or below
        ``seq`` (its first below the first); ATTENTION_EFFICIENCY without a table."""
        if not self.attention:
            return ATTENTION_EFFICIENCY
        widths = sorted({h for h, _, _ in self.attention})
        w = max([h for h in widths if h <= width] or widths[:1])
        rows = [(t, f) for h, t, f in self.attention if h == w]
        out = rows[0][1]
        for t, f in rows:
            if seq >= t:
                out = f
        return out

    @property
    def overlap_mode(self) -> str:
        return {True: "backward", False: "none"}.get(self.overlap, self.overlap)

    @property
    def usable(self) -> float:
        return self.memory * (1 - self.headroom)

    def link(self, stride: int, size: int) -> Link:
        """The slowest link of a group of ``size`` ranks ``stride`` apart (nodes hold consecutive ranks)."""
        return self.intra if stride * size <= self.gpus_per_node else self.inter
