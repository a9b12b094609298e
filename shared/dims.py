"""Dimension glossary for the shape comments used across the repo.

Every non-obvious tensor line carries a comment such as ``# (B/dp, D)``. The letters mean:

    B    global batch size (rows of the input)                 Config.batch
    D    model width: every weight W_l is (D, D)                Config.dim
    L    number of layers                                       Config.layers
    N    world size: ranks (torch) or devices in the mesh (JAX)
    dp   size of the data-parallel axis   (== N in the dp / fsdp patterns)
    tp   size of the tensor-parallel axis (== N in the tp pattern)
    pp   number of pipeline stages        (== N in the pp pattern), also written S
    M    number of micro-batches in a pipeline step             Config.microbatches
    T    sequence length (transformer)                          Config.seq
    H    attention heads (transformer); dh = D/H per head       Config.heads
    V    vocabulary size (transformer)                          Config.vocab
    Φ    parameter count (written Phi in code): MLP L·D·D; transformer
         (V + T)·D + L·(12·D² + 2·D) + D + D·V                  Config.n_params
    b    bytes per element of the run's dtype (8 float64, 4 float32, 2 bfloat16)

Orientation: the fixture weight W_l is applied as ``x @ W_l`` (x is (B, D), or (B, T, D)). torch's
``nn.Linear`` stores ``weight == W_l.T`` and computes ``x @ weight.T``; Flax's ``nnx.Linear``
stores ``kernel == W_l``. "Column-parallel" always means sharding W_l's columns (output
features), i.e. torch ``weight`` rows.
"""
