"""How close two runs must be, per dtype. One place, one reason per number.

Errors are *relative*: ``max|a - b| / max(max|b|, tiny)`` per array, then the max over arrays
(see ``shared.results.rel_err``).
"""

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

# Cross-framework (torch vs JAX) agreement: each side is within TOLERANCE of its own reference
# and the two references agree to the same order, so twice the tolerance bounds their distance.
CROSS_FRAMEWORK_FACTOR = 2.0


def tolerance(dtype: str) -> float:
    return TOLERANCE[dtype]
