"""torch's library layer: what a user applies to their own ``nn.Module`` on their own process group
or DeviceMesh — wrappers, plans, seams and the theory they answer with. The runners above it
(torch_impl/dp.py, fsdp.py, tp.py, pp.py, cp.py, ep.py, mesh.py) only turn the shared fixtures into
a Setup for the harness's training loop. The twin: jax_impl/parallel/, file for file.

    dp.py      allreduce_gradients, BucketedDDP, Zero1Optimizer, local_batch
    fsdp.py    FSDP (ZeRO-3) and Zero2 over any module: Unit, split_params, gather_full, average_flat
    tp.py      tensor-parallel plans (module path -> style): check_plan, apply_plan, apply_dtensor_plan
    tp_ops.py  tp's collectives as autograd Functions (Megatron's f/g, SP's gather/scatter, vocab CE)
    pp.py      the pipeline seam: a stage split over torch.distributed.pipelining (GPipe, 1F1B)
    cp.py      the attention seam for context parallelism and its cores (ring, zigzag, Ulysses)
    ep.py      expert parallelism's all-to-alls and Dispatcher for an MoE layer's seams
    theory.py  communication and state bytes from the module a wrapper wraps
    recipe.py  the recipe's sharded parts: global-norm clipping (clip_, clip_dtensor_), refuse_stale
    llama.py   transformers' LlamaForCausalLM: tp plan, pp stage split and Stage, cp attention
    compose.py dp|fsdp × pp × cp × tp on one DeviceMesh: apply_tp / apply_fsdp / apply_pp, parallelize
    compiled.py         torch.compile per unit (compile_units), the watch (Watch, steady), torch's private bits
    compiled_ledger.py  a compiled step's collectives from torch's profiler (who issued each: compiled or eager)

Import rule: these modules import torch, numpy, shared.theory, shared.llama and each other (by module, never
through this package: it re-exports nothing) — never shared.config / problem / results, the
harness, launch, the runners or the project's models (tests/test_layers.py checks).
"""
