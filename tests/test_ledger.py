"""The communication ledgers: HLO parsing (JAX) and c10d dispatch recording (torch)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.devices import make_mesh
from jax_impl.ledger import comm_from_hlo, comm_of

# Lines as XLA prints them: CPU (sync forms) and GPU (async -start/-done forms, iota groups).
HLO = """
HloModule m, num_partitions=4
  %a = f32[8,4]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %b = f64[16,2]{1,0} all-gather(%p), replica_groups={{0,1},{2,3}}, dimensions={0}
  %c = f32[2,4]{1,0} reduce-scatter(%p), replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
  %d = bf16[4]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}
  %e = (f32[1,2]{1,0}, f32[1,2]{1,0}) all-to-all(%x, %y), replica_groups={{0,1}}
  %f = (f32[4]{0}, f32[16]{0}) all-gather-start(%p), replica_groups={{0,1,2,3}}, dimensions={0}
  %g = f32[16]{0} all-gather-done(%f)
  %h = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%p), source_target_pairs={{0,1}}
  %i = f32[8]{0} collective-permute-done(%h)
  %j = f32[32]{0} all-reduce-start(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  %k = f32[32]{0} all-reduce-done(%j)
  %l = f32[4,4]{1,0} reduce-scatter(%p), replica_groups=mesh['dp'=2,'tp'=2] {'tp'}, dimensions={0}
  %m = ((f32[16]{0}), f32[4]{0}) reduce-scatter-start(%p), replica_groups={{0,1,2,3}}, dimensions={0}
  %n = f32[4]{0} reduce-scatter-done(%m)
  %o = ((f32[2,4]{1,0}), f32[2,4]{1,0}) all-to-all-start(%p), replica_groups={{0,1}}
  %q = f32[2,4]{1,0} all-to-all-done(%o)
"""


def test_hlo_parsing_follows_nccl_tests_sizes():
    comm = comm_from_hlo(HLO)
    assert comm["all_reduce"] == {"count": 2, "bytes": 8 * 4 * 4 + 32 * 4}
    assert comm["all_gather"] == {"count": 2, "bytes": 16 * 2 * 8 + 16 * 4}  # gathered outputs
    # reduce-scatter counts the input: output × group size (4 from the iota form, 2 from the mesh form)
    assert comm["reduce_scatter"] == {"count": 3, "bytes": 2 * 4 * 4 * 4 + 4 * 4 * 4 * 2 + 16 * 4}
    assert comm["collective_permute"] == {"count": 2, "bytes": 4 * 2 + 8 * 4}
    assert comm["all_to_all"] == {"count": 2, "bytes": 2 * 2 * 4 + 2 * 4 * 4}


def test_comm_of_reads_a_compiled_resharding():
    mesh = make_mesh(4, "x")
    x = jax.device_put(jnp.arange(32.0).reshape(16, 2), NamedSharding(mesh, P("x")))
    gather = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P()))
    comm = comm_of(gather, x)
    assert comm == {"all_gather": {"count": 1, "bytes": 16 * 2 * 8}}
    np.testing.assert_array_equal(gather(x), np.arange(32.0).reshape(16, 2) * 2)


def test_torch_ledger_tables_cover_every_collective_dist_offers():
    """Every c10d op the ledger names exists in this torch build (a rename would silently drop it)."""
    import torch

    from torch_impl.ledger import _C10D, _FUNCTIONAL

    for name in _C10D:
        assert hasattr(torch.ops.c10d, name), name
    missing = [n for n in _FUNCTIONAL if not hasattr(torch.ops._c10d_functional, n)]
    assert missing == [], missing
