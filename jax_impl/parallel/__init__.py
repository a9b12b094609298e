"""The JAX library layer: wrappers, plans and seams for ANY Flax NNX model, on a mesh.

    tree     module paths, ZeRO-3 units, WrapError / ShardReadError, fetch (no torch twin)
    theory   communication and state per device from the model wrapped
    fsdp     parallelize: the Trainer, ZeRO stages dp / zero1 / zero2 / zero3 in shard_map and jit
    dp       where dp and zero1 live (parallel/fsdp.py)
    typed    sharding in types: explicit_mesh, Stated, InMesh, TypedTrainer, rows_like
    tp       apply_plan: a tensor-parallel plan keyed by module path
    pp       pipeline: GPipe over a stage split of module paths
    cp       context_parallel: the attention seam, ring / zigzag / Ulysses
    ep       expert parallelism's generic pieces (the axis, slots)
    compose  dp/fsdp × tp × pp × cp on one mesh: a model, a layout, a plan, a stage split, the cp seam
    llama    a Flax NNX Llama with transformers' names and shapes, its tp plan and stage split
    recipe   the optimizer probe (refuses a tx a layout cannot apply exactly), clip= with the true
             global norm, compute_dtype= casts (docs/recipe.md)

Import rule: jax, flax, optax, numpy, shared.theory, shared.llama and jax_impl.parallel modules only; never
shared.config / problem / results, the harness, reference, launch, the runners or the project's
models (tests/test_layers_jax.py checks). No re-exports here: import the submodule.
"""
