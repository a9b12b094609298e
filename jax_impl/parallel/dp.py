"""Data parallelism and ZeRO-1 for any Flax NNX model live in jax_impl/parallel/fsdp.py: one
``Trainer`` (``parallelize(model, loss, tx, mesh, "dp" | "zero1", style)``) runs every ZeRO stage,
because in JAX the stages differ only in where the gradients and moments live, not in the model
wrapping. torch's twin (torch_impl/parallel/dp.py) holds BucketedDDP and Zero1Optimizer.

    dp     params replicated; pmean of every gradient (jit: XLA's all-reduce)
    zero1  psum_scatter of the flat padded gradient, AdamW on 1/N of it, all_gather of the update
"""
