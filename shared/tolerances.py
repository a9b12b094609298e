"""How close two runs must be, per dtype and run length. One place, one reason per number.

Errors are *relative*: ``max|a - b| / max(max|b|, tiny)`` per array, then the max over arrays
(see ``shared.results.rel_err``). ``tolerance(dtype)`` is for a short run (up to ``STEPS_MEASURED``
steps) and for the step-0 gradients; ``tolerance(dtype, steps)`` for the losses and parameters of a
run of ``steps`` steps (``STEP_GROWTH``).
"""

import math

# float64: the sharded runs sum the same products in a different order (per-rank partial sums,
# then a collective), so they differ from the single-device run by a few ulps per reduction;
# over 5 AdamW steps of a small MLP we see ~1e-15. 1e-12 leaves three orders of headroom
# while still catching any real bug (a wrong scale or a missing term is >= 1e-3).
FLOAT64 = 1e-12

# float32: same reordering argument with eps ~1.2e-7; gradients agree to ~1e-7..1e-6. AdamW then
# divides by sqrt(v)+eps, which turns the round-off of a near-zero gradient entry into a visible
# difference of its update (measured: the transformer at L=4, D=32, tp=4, an entry of 6e-8 whose
# float32 noise is 1e-8 moves the parameter by 1.3e-5 after 5 steps, 1.8e-5 of that array's max;
# the MLP stays below 1e-6). 5e-5 covers that and still catches any real bug (a wrong scale or a
# missing term is >= 1e-3).
FLOAT32 = 5e-5

# bfloat16: 8 mantissa bits (eps ~7.8e-3); a different summation order moves results by a
# few eps, compounded over layers and steps. 5e-2 separates "same algorithm" from "bug".
BFLOAT16 = 5e-2

# Collectives move or add small integers; in every dtype the result is exact.
COLLECTIVES = 0.0

TOLERANCE = {"float64": FLOAT64, "float32": FLOAT32, "bfloat16": BFLOAT16}

# Mixed precision (Config.precision "mixed": float32 master weights, bf16 compute). A bf16 constant would
# sit at the bug scale (BFLOAT16 above), so a mixed run is judged against a MEASURED floor instead: the
# single-device mixed run against itself with every step's batch split in two (the references compute
# it once per config: shared.results.mixed_extra), per quantity (losses, step-0 gradients, parameters).
# That is the rounding a different summation order alone causes, which is all a correct sharded run
# changes. Measured (compare.py's transformer, L=4 D=32 T=16 V=64 B=32, 4 steps, 2 ranks): the floor is
# loss 7e-5..2e-4, gradients 5e-3..9e-3, parameters 5e-3..2e-2 (AdamW's normalised update turns the
# rounding of near-zero gradient entries into whole-lr differences). Every torch dp / fsdp run on 2
# ranks IS the split-in-two run (ratio 1.0, bit for bit); on 4 ranks (compare.py's default sizes, both
# models) torch sits at 1.2-3.6x the floor, JAX shard_map / jit at 0-2.0x; the issue measured 2.7-3.6x
# for torch tp / cp. MIXED_FACTOR = 8 covers those with room; a real bug (a lost 1/N, a dropped rank's
# gradient, a missing term) moves the gradients by >= 50%, i.e. >= 50x the floor.
# A floor never counts below MIXED_FLOOR_MIN: the float32 master weights are still summed in another
# order (the FLOAT32 argument), and a floor that happens to be ~0 must not turn rounding into a failure.
# What the floor cannot see is a bf16 gradient reduction (one more bf16 rounding, ~4e-3, below it):
# the ledger shows that instead (float32 reductions: 4 bytes per element, shared.theory with them).
MIXED_FACTOR = 8.0
# The floor sees summation order only: the split run computes every row's forward exactly as the whole
# batch does. A DIFFERENT PROGRAM for the same math — the other framework, or JAX's sharding-in-types
# ("typed") program, which XLA fuses differently — also rounds the bf16 forward at other points: the
# step-0 loss, same parameters and batch, differs by 1.1e-3 (typed, transformer L=2 D=8), 4.0e-3 (typed,
# MLP D=16) and 5.0e-3 (torch vs JAX, MLP), where shard_map / jit are bit for bit the split run. One
# bf16 rounding is up to its unit roundoff 2^-8 = 3.9e-3 relative; MIXED_PROGRAM_MIN = four of them is
# the least such a comparison is allowed. typed's gradients and parameters also reach 3.9x (transformer,
# 4 ranks) to 8.3x (L=2 D=8) the floor: MIXED_STYLE_FACTOR 16 for that style. A lost 1/N or a dropped
# rank's gradient (>= 50% on the gradients) stays beyond both.
MIXED_STYLE_FACTOR = {"typed": 16.0}
# Layouts that round in other places than the reference by construction (JAX; every bf16 op rounds where
# the program says: jax_impl/model.py MIXED_COMPILER_OPTIONS). tp: a row-parallel product's N partial
# sums are each rounded to bf16 and added by the activation all-reduce (Megatron's bf16 all-reduce),
# where one device rounds the whole dot once: step-0 gradients 5.8x the floor (L=2 D=16, 2 devices)
# and 7.0x (compare.py's transformer, L=4 D=32, 4 devices), every style alike. cp's ring: the online
# softmax merges the hops' partial results (in float32, as attention is computed everywhere), whose
# float32 round-off flips a few bf16 roundings of the attention output: gradients 1.8x, parameters
# 10.7x (AdamW's normalised update of a near-zero gradient entry: wpe moved 2.2e-3 by step 3, L=2 D=16).
# MIXED_LAYOUT_FACTOR (below) for those; a lost 1/N (>= 50%) stays beyond it.
# tp's rounded partial sums change the forward itself (the MLP's megatron pairs: step-0 loss 2.9e-3 off,
# one bf16 rounding, where the split-batch floor is 8e-8): a different program (MIXED_PROGRAM_LAYOUTS).
# torch's compiled style (torch.compile: inductor) is a different program too: inductor fuses a matmul's epilogue
# and the elementwise ops after it into one kernel that computes in float32 and rounds to bf16 only where it stores
# (eager autocast rounds after every op). Measured (compare.py --precision mixed, L=2 D=16, 2 ranks, 3 steps): the
# MLP under compiled ddp and each pipeline stage compiled, step-0 loss 1.9e-3 off (half a bf16 rounding; the
# split-batch floor is 1e-7), gradients 7.4e-3 (2.0x their floor), parameters 9.0e-4 (17x a floor of 5.3e-5: AdamW's
# normalised steps); the transformer's compiled fsdp2 2.7x, its pipeline stages 1.0x, tp within MIXED_LAYOUT_FACTOR.
# So "compiled" is a MIXED_PROGRAM_STYLE (never below MIXED_PROGRAM_MIN) with the default MIXED_FACTOR. float64
# keeps FLOAT64: inductor's reordered reductions measured <= 2.6e-14 (transformer, 4 ranks, 5 steps).
MIXED_PROGRAM_MIN = 4 * 2.0**-8
MIXED_PROGRAM_STYLES = ("typed", "compiled")
MIXED_FLOOR_MIN = FLOAT32
# torch tp and cp's ring cores (keys "pattern" or "pattern/variant") are other programs for the same math
# as well: tp's row-parallel matmuls round each rank's partial sum to bf16 and add them in bf16 (the g
# all-reduce; the reference rounds the whole dot product once); the ring attends block by block (its
# probabilities rounded to bf16 per block, as a flash kernel does per tile, but over other tiles). The
# gradients stay within 3.5-7x the floor; the losses reach 10x (tp, L=2 D=8 T=4, 2 ranks: 9e-4, still a
# quarter of one bf16 rounding) and the parameters 25x (ring, same sizes: AdamW moves an entry whose
# gradient is rounding noise by a whole lr either way); compare.py's sizes, 4 ranks: tp 8.5x, ring 11.5x.
# Being other programs, their tolerance never falls below MIXED_PROGRAM_MIN either: the MLP's split run
# computes every row's loss exactly as the whole batch (loss floor 2.7e-6 at L=4 D=16 B=8, 4 ranks), where
# tp's bf16 partial sums cancel in its small outputs (loss 9.6e-3 off, 2.5 bf16 roundings; gradients 1.1e-2).
# A lost 1/N or a dropped rank's gradient (>= 50% on the gradients, 100x their floor) stays beyond both.
# One table for both frameworks (keyed by pattern or variant): tp 16, the rings 32 (torch's 25x; JAX's
# 10.7x fits 16 too), and all three are other programs (never below MIXED_PROGRAM_MIN).
# A composed layout (the mesh pattern, variant "fsdp=2,tp=2") takes the largest factor of its axes (cp: the
# ring), as each axis rounds where its 1-D pattern does: measured (torch, fsdp=2,tp=2, --clip 1.0, bf16) the
# parameters 4.04e-2 against a floor of 5.0e-3 (8.1x: past MIXED_FACTOR, within tp's 16).
MIXED_LAYOUT_FACTOR = {"tp": 16.0, "ring": 32.0, "ring_zigzag": 32.0}
# Ulysses is the reference's attention on H/c heads after an exact all-to-all, bit for bit the split run on
# AVX-512 (float16 parameters <= 8x the floor); on AVX2 (ATEN_CPU_CAPABILITY=avx2, an AMD EPYC's path: issue 51)
# its float16 step differs where the reference's kernels, blocked for the whole sequence and every head, round
# elsewhere: gradients 0.8x the floor but parameters 1.5e-3 = 16.6x it (AdamW's whole-lr moves of near-zero
# entries, tests/cpu_paths.py, transformer L=2 D=16, 2 ranks). So it counts as another program too (its float16
# parameters x MIXED_FLOAT16_PARAM_FACTOR); its gradients keep MIXED_FACTOR, and a lost 1/N (>= 50%) stays beyond.
MIXED_PROGRAM_LAYOUTS = ("tp", "ring", "ring_zigzag", "ulysses")
# Cross-framework in mixed: torch (autocast: matmuls in bf16, norms / softmax / loss and the residual
# stream in float32) and Flax (dtype=bfloat16: every parameter and activation in bf16, statistics in
# float32) round in different places, so the two references differ by more than either's floor:
# transformer 2.0x (loss), 3.1x (gradients), 2.1x (parameters) the larger floor, a run against the other
# framework's reference up to 3.3x; the MLP's forward differs by 5e-3 in the step-0 loss (MIXED_PROGRAM_MIN
# below). At L=2 D=32 T=16 V=64 B=16 on 2 ranks the parameters after 3 steps reach 8.9x (4.2e-2 against a
# floor of 4.7e-3: AdamW's whole-lr moves of near-zero gradient entries, rounded at other places), the
# gradients 5.3x: 16 × the larger floor, never below MIXED_PROGRAM_MIN (a lost 1/N, >= 50%, stays beyond).
MIXED_CROSS_FRAMEWORK_FACTOR = 16.0


def layout_names(layout: tuple) -> tuple:
    """``layout``'s names (pattern, variant), an N-D layout's variant ("fsdp=2,tp=2") read as its axes of
    size > 1, cp as its "ring" (the mesh runs the ring): a composed layout rounds where each axis does."""
    out = []
    for n in layout:
        if isinstance(n, str) and "=" in n:
            out += ["ring" if a == "cp" else a for a, _, k in (p.partition("=") for p in n.split(",")) if k != "1"]
        else:
            out.append(n)
    return tuple(out)


def mixed_factor(style: str | None = None, layout: tuple = ()) -> float:
    """MIXED_FACTOR, or the style's MIXED_STYLE_FACTOR, or the largest MIXED_LAYOUT_FACTOR of ``layout``'s
    names (its pattern and variant; an N-D layout's axes), whichever is largest."""
    return max([MIXED_STYLE_FACTOR.get(style, MIXED_FACTOR)] +
               [MIXED_LAYOUT_FACTOR.get(n, 0.0) for n in layout_names(layout)])


# float16 (mixed, with dynamic loss scaling): the same measured floor and factors. float16 rounds 8x finer
# than bf16 (2^-11 vs 2^-8) and its floor is 5.4-7.8x smaller (torch, transformer L=2 D=16 T=16 V=64
# B=32, 2 ranks, 5 steps: loss 8.0e-6 / gradients 6.1e-4 / parameters 5.6e-4, bf16 6.2e-5 / 3.6e-3 /
# 3.0e-3); dp and fsdp stay the split run (1.0x), ulysses 2.2x, ring_zigzag 8.5x. The other programs'
# PARAMETERS do not follow: their error is AdamW's whole-lr move of an entry whose gradient is rounding
# noise, the same size in either dtype (tp 2.4e-2 in float16 vs 2.6e-2 in bf16; ring 2.4e-2 vs 3.3e-2),
# i.e. 43x the float16 floor where bf16's is 9-11x. So for a different program's parameters float16
# multiplies the tolerance by MIXED_FLOAT16_PARAM_FACTOR = 8 (the rounding ratio: bf16's tolerance in
# absolute terms); its losses (4.9x) and gradients (2.5-2.9x) keep the bf16 factors, and a lost 1/N
# (>= 50% on the gradients, 800x their float16 floor) stays far beyond them.
# JAX (the same sizes, 2 devices): loss 4.9e-6, step-0 gradients 6.1e-4, parameters 1.0e-2 (AdamW's
# normalised noise, as large in either dtype); dp / zero1 / zero2 / zero3 (shard_map) at 1.00x that floor,
# jit and typed at 1.23x; cp ring 2.4x, tp megatron 13.75x (its float16 partial sums, as bf16's): the
# bf16 factors stand. MIXED_PROGRAM_MIN stands too (no float16 minimum): four float16
# roundings (2e-3) would be too tight for the parameters, whose distance between two programs is AdamW
# turning near-zero gradient entries' rounding into lr-sized steps in either dtype (measured: tp megatron,
# tiny transformer, 3 of 5 steps skipped: parameters 4.4e-3 apart, gradients 6.2e-3).
MIXED_FLOAT16_PARAM_FACTOR = 8.0


def mixed_tolerance(floor: float, style: str | None = None, program: bool = False, layout: tuple = (),
                    dtype: str | None = None, quantity: str | None = None) -> float:
    """A mixed run's tolerance for one quantity from its measured floor: mixed_factor × the floor, the
    floor never below MIXED_FLOOR_MIN; a different program (the other framework: ``program``; a
    MIXED_PROGRAM_STYLES style, a MIXED_PROGRAM_LAYOUTS layout) never below MIXED_PROGRAM_MIN, and in
    float16 (``dtype``) its parameters (``quantity`` "max_rel_err_param") × MIXED_FLOAT16_PARAM_FACTOR."""
    tol = mixed_factor(style, layout) * max(floor, MIXED_FLOOR_MIN)
    names = layout_names(layout)
    different = program or style in MIXED_PROGRAM_STYLES or any(n in MIXED_PROGRAM_LAYOUTS for n in names)
    if different and dtype == "float16" and quantity == "max_rel_err_param":
        tol *= MIXED_FLOAT16_PARAM_FACTOR
    return max(tol, MIXED_PROGRAM_MIN) if different else tol


# Cross-framework (torch vs JAX) agreement: each side is within TOLERANCE of its own reference
# and the two references agree to the same order, so twice the tolerance bounds their distance.
CROSS_FRAMEWORK_FACTOR = 2.0


# Run length. The numbers above were set on runs of up to 5 steps (compare.py's default --steps).
# Reordering error grows with the steps: each step adds a few ulps to the parameters, the error
# stays in them (one integration: ~S), and the perturbed parameters and AdamW moments bias every
# later update (a second integration: ~S^2). Issue 38 reports torch fsdp in float64 at 1.5e-11 after
# 600 steps against ~1e-15 after 5: a factor 1.5e4 for 120x the steps, i.e. S^2 (1.44e4). So the
# losses' and final parameters' tolerance is the short-run one times (S / STEPS_MEASURED)^2, which
# keeps three orders of headroom over that drift at every length (600 steps: 1.4e-8 against 1.5e-11).
# Measured here (torch fsdp, float64, compare.py's default sizes, 4 ranks, 600 steps): the MLP stays
# at 1.1e-15 and passes either way. The transformer has ~1e-16 between two sharded variants up to
# step 200, then grows exponentially once its loss nears its floor (2.8e-13 at 300, 1e-9 at 500,
# 1.9e-7 at 599), and reaches 9.5e-4 against the single-device run. That is chaotic amplification:
# no growth law separates it from a bug at that length, so runs past PURE_FLOOR_STEPS are judged by
# a measured floor instead (below; docs/reliability.md). A bug is not hidden: the step-0 gradients keep the one-step
# tolerance (one step, nothing accumulates), and a wrong averaging factor (x2, x0.5) moves them by
# 50-100%. In the parameters alone (a resumed run has no step-0 gradients), AdamW's near
# scale-invariance leaves only eps to see the factor: 3e-7 after 3 steps and 3.5e-6 after 600
# (tests/test_tolerances.py's simulation), 1.5e-4 on compare.py's MLP fixture. So the growth stops
# at STEP_CEILING, below those.
STEPS_MEASURED = 5
STEP_GROWTH = 2  # the exponent of S / STEPS_MEASURED
# float64: 1e-7, three times below the smallest wrong-factor effect above (reached at ~1600 steps,
# where the S^2 law puts the drift at ~1e-10). float32: 2e-4, five times below the ">= 1e-3" of a
# real bug (so it grows only to ~10 steps: longer float32 runs may need a measured floor).
# bfloat16: 5e-2 already sits at the bug scale: no growth.
STEP_CEILING = {"float64": 1e-7, "float32": 2e-4, "bfloat16": BFLOAT16}


def tolerance(dtype: str, steps: int | None = None) -> float:
    """The tolerance for ``dtype``; with ``steps``, for the losses and final parameters of a run of
    that many optimizer steps (never below the short-run one, never above STEP_CEILING)."""
    base = TOLERANCE[dtype]
    if not steps or steps <= STEPS_MEASURED:
        return base
    return max(base, min(base * (steps / STEPS_MEASURED) ** STEP_GROWTH, STEP_CEILING[dtype]))


# Long pure runs: a MEASURED floor (issue 38), as mixed runs have. Past PURE_FLOOR_STEPS optimizer steps
# the references also train the single-device run against itself with every step's batch split in two
# (shared.results.floor_extra; the mixed runs' floor, in the run's own dtype): the distance a different
# summation order alone reaches at that length, per quantity, and for the losses per step. A long
# transformer run drifts chaotically once its loss nears its floor (above: 9.5e-4 at 600 steps, no growth
# law holds), and the split run drifts the same way, so the losses' and parameters' tolerance becomes
# max(tolerance(dtype, steps), PURE_FLOOR_FACTOR × the floor). The losses are judged step by step against
# the floor reached by that step (its running maximum): where the floor is still ~1e-16 (the first
# hundreds of steps), the growth law's tolerance alone applies, so a wrong reduction (>= 1e-3 from step 1
# on) fails on its first steps; the step-0 gradients keep the one-step tolerance whatever the floor.
# PURE_FLOOR_FACTOR: a sharded run reorders differently from the split run (other partial sums, another
# number of parts), so once chaos amplifies them their distances differ by the amplification of two
# different seeds. Measured in tests/test_tolerances.py's simulation in its chaotic regime (lr 0.3, 600
# steps; the split run reaches 1e-2 in the parameters): the batch in 4 or 8 parts sits at up to 3x the
# floor of 2 parts, per step (losses) and at the end (parameters); 10 covers that with room. A wrong
# weighting (sum not averaged, averaged twice, uneven parts) is 1e5x its floor on the first steps.
# The floor costs one more single-device run of the same length, so short runs (<= PURE_FLOOR_STEPS, the
# growth law's measured range with room) do not pay it.
PURE_FLOOR_STEPS = 100
# Large float32 models measure the floor too, whatever their length (issue 46's GPU sizes): FLOAT32 above was
# measured at D <= 32, where a dot product sums <= 128 products; compare.py --size gpu (D=512, T=256,
# Φ = 16.8 M) sums 2048 in its MLP and 256 over the sequence, and the rounding of a sum grows with its length
# (~√K: 4x that of D=32's), so the constant would be fitted to sizes it never saw. From this many parameters
# on, a float32 run's losses and parameters are judged by max(FLOAT32, PURE_FLOOR_FACTOR × the floor its own
# references measure on that machine); the step-0 gradients keep FLOAT32 (one step: nothing accumulates, a
# wrong factor moves them by >= 50 %).
FLOAT32_FLOOR_PARAMS = 1_000_000
PURE_FLOOR_FACTOR = 10.0


def floor_tolerance(dtype: str, steps: int | None, floor: float | None) -> float:
    """A pure run's tolerance for its losses / parameters: the step-aware one, or PURE_FLOOR_FACTOR × the
    measured ``floor`` when that is larger (``floor`` None: no floor was measured)."""
    tol = tolerance(dtype, steps)
    return tol if floor is None else max(tol, PURE_FLOOR_FACTOR * floor)


# Mixed precision's parameters, entry by entry (issue 51). AdamW normalises every entry's update
# (m̂ / √v̂), so an entry whose gradient is rounding noise moves by up to a whole lr per step, in whatever
# direction the noise points. Two programs that round at other places (tp's bf16 / float16 partial sums,
# the ring's tiles, the other framework) can disagree on the sign of such an entry, and then its
# parameter ends ~lr per step apart, however correct both are. Measured (torch tp, float16, the
# transformer at L=2 D=16 T=8 V=32 B=8, 3 steps, 2 ranks; explicit megatron, DTensor and both SP variants
# bit for bit alike): one entry of wte, (31, 5), whose step-0 gradient is 3.4e-5 of wte's largest while
# the two programs' gradients differ there by 7.7e-5, ended 2.99e-3 (3 lr) apart — 3.7e-2 of wte's
# largest entry, 2.4x the 1.6e-2 allowed (on an Intel Xeon and an AMD EPYC alike); every other entry
# stayed within 1.2e-3 (6x the floor). Whether a run has such an entry, and where, depends on the CPU's
# kernels: no constant fitted on one machine bounds it. So a mixed comparison splits the entries by what
# the two runs' own step-0 gradients say, measured in that run on that machine (shared.results.mixed_parity):
# - noise-driven: 2·|g_run − g_ref| > |g_ref| (NOISE_MARGIN: the two programs do not agree on the sign
#   of the entry's first update to better than a factor of 2). Such an entry is held to AdamW's own bound
#   on how far two runs can move it apart (adam_noise_bound: 2 lr·c_t per step), which any correct program
#   meets and a wrong update (a NaN, an unclipped or unnormalised step) does not; the row reports how many
#   there were ("noise_entries"). At the sizes above: bf16 108 of 7376 entries (1.5 %), float16 42 (0.6 %).
# - every other entry: the measured floor as before (the floor's own split run is judged the same way).
# A bug in the gradients does not hide here: the step-0 gradients are still judged whole, where a lost 1/N
# or a dropped rank moves them by >= 50 % (>= 50x their floor); a bug in a later step or in the update
# leaves the step-0 split unchanged and moves the determined entries. And when more than
# NOISE_MAX_FRACTION of all entries are "noise-driven" the gradients disagree too broadly to call it
# rounding: no split is made (every entry judged by the floor).
NOISE_MARGIN = 2.0
NOISE_MAX_FRACTION = 0.05


def adam_ratio_bound(t: int, beta1: float, beta2: float) -> float:
    """The largest |m̂_t| / √v̂_t that Adam's bias-corrected moments can reach at step ``t`` (from 1) over any
    gradient sequence (Cauchy–Schwarz on the two exponential averages; 1 at t = 1, 1.004 at t = 3, 1.04 at
    t = 10, 2.2 at t = 100 for β = (0.9, 0.999)). The update is lr × this at most (eps only lowers it)."""
    s = sum(((1 - beta1) * beta1 ** (t - k)) ** 2 / ((1 - beta2) * beta2 ** (t - k)) for k in range(1, t + 1))
    return math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t) * math.sqrt(s)


def adam_noise_bound(lrs, beta1: float, beta2: float, start: int = 0) -> float:
    """How far apart (absolute) two AdamW runs can end up in one entry over the steps whose learning rates
    are ``lrs`` (the schedule applied), starting equal at step ``start``: each step moves each run by at most
    lr_t × adam_ratio_bound(t), in either direction; decoupled weight decay only pulls two values together."""
    return sum(2 * lr * adam_ratio_bound(start + k + 1, beta1, beta2) for k, lr in enumerate(lrs))
