"""symmsync: symmetric memory with direct peer access, and the device-side
synchronization to use it safely.

    import symmsync as ss

    buf = ss.SymmetricBuffer(nbytes)            # collective over torch.distributed
    view = ss.pcp_view(buf, tp=2)               # this rank's PCP subgroup
    fence = ss.Fence(view)                      # fused publish-and-wait, device epochs
    fence.fence()

Kernels use the device primitives in :mod:`symmsync.language`; tests on machines
without GPUs use :func:`symmsync.testing.run` and the host backend.
"""

from .buffer import SymmetricBuffer
from .errors import (
    BackendError,
    BoundsError,
    ClosedError,
    ConfigError,
    FenceTimeout,
    InputError,
    RankFailure,
    SizeMismatchError,
    SymmSyncError,
    ViewError,
)
from .fence import Fence
from .group import TP_PCP_ORDER, PeerView, pcp_view, tp_pcp_ranks, tp_view

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BoundsError",
    "ClosedError",
    "ConfigError",
    "Fence",
    "FenceTimeout",
    "InputError",
    "PeerView",
    "RankFailure",
    "SizeMismatchError",
    "SymmSyncError",
    "SymmetricBuffer",
    "TP_PCP_ORDER",
    "ViewError",
    "pcp_view",
    "tp_pcp_ranks",
    "tp_view",
]
