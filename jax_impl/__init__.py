"""JAX implementations: jax.shard_map with explicit collectives, and jax.jit with shardings.

One process drives every device. Never imports torch. Importing this package turns on float64
support (the float64 parity runs need it) and full-precision matmuls (on GPU, f32 matmuls
default to TF32-like reduced precision, which would break float32 parity).
"""

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_default_matmul_precision", "highest")
