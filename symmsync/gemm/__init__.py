"""All-gather + GEMM and GEMM + reduce-scatter with tile signals, for tensor-parallel layers.

Built on the consumer kit's public names only (:class:`~symmsync.Consumer`,
:class:`~symmsync.Making`, :class:`~symmsync.Signals`, :func:`~symmsync.define_op` and the device
primitives of :mod:`symmsync.language`)::

    from symmsync import gemm

    nbytes = gemm.all_gather_matmul_bytes(view.size, max_rows, k, torch.bfloat16)
    ag_mm = gemm.AllGatherMatmul(view, max_rows, k, torch.bfloat16, offset=0)
    y = ag_mm(a, w)            # torch.cat(all_gather(a)) @ w, one launch
    mm_rs = gemm.MatmulReduceScatter(view, max_rows, n, torch.bfloat16, offset=nbytes)
    z = mm_rs(h, w2)           # member i's block of reduce_scatter(h @ w2), one launch

Each GEMM program waits only for the blocks of a peer's rows (or partial sums) that its tiles
need, signalled one block at a time (docs/gemm.md has the protocol, the order contract and the
costs).
"""

from .consumers import (
    DTYPES,
    AllGatherMatmul,
    MatmulReduceScatter,
    Tiles,
    all_gather_matmul_bytes,
    matmul_reduce_scatter_bytes,
)

__all__ = [
    "DTYPES",
    "AllGatherMatmul",
    "MatmulReduceScatter",
    "Tiles",
    "all_gather_matmul_bytes",
    "matmul_reduce_scatter_bytes",
]
