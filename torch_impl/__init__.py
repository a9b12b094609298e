"""torch.distributed implementations (gloo on CPU, NCCL on GPUs). Never imports JAX."""
