"""symmsync: symmetric memory with direct peer access, and the device-side
synchronization to use it safely.

    import symmsync as ss

    buf = ss.SymmetricBuffer(nbytes)            # collective over torch.distributed
    view = ss.pcp_view(buf, tp=2)               # this rank's PCP subgroup
    fence = ss.Fence(view)                      # fused publish-and-wait, device epochs
    fence.fence()
    sigs = ss.Signals(view, slots=4)            # point-to-point slots for your kernels

Kernels use the device primitives in :mod:`symmsync.language`; tests on machines
without GPUs use :func:`symmsync.testing.run` and the host backend.

On a machine where torch sees no CUDA device and ``TRITON_INTERPRET`` is not set,
importing symmsync sets ``TRITON_INTERPRET=1`` (see
:func:`symmsync.backends.mode.enable_interpreter_without_gpu`), so a plain ``torchrun``
job on CPUs runs symmsync's kernels in Triton's interpreter.
"""

from .backends.mode import enable_interpreter_without_gpu as _enable_interpreter

_enable_interpreter()  # before any symmsync kernel is defined (buffer -> views -> failure -> language)

from .core.buffer import SymmetricBuffer  # noqa: E402
from .core.consumer import Consumer  # noqa: E402
from .core.fence import Fence, launch_grid_sync  # noqa: E402
from .core.making import Making  # noqa: E402
from .core.regions import carve  # noqa: E402
from .core.signals import Signals  # noqa: E402
from .core.views import TP_PCP_ORDER, PeerView, pcp_view, tp_pcp_ranks, tp_view  # noqa: E402
from .errors import (  # noqa: E402
    BackendError,
    BoundsError,
    CallMismatch,
    CaptureError,
    ClosedError,
    ConfigError,
    DebugCheckError,
    FenceTimeout,
    IndexCheckError,
    InputError,
    PeerAborted,
    PeerRefused,
    RankFailure,
    SignalAborted,
    SignalTimeout,
    SizeMismatchError,
    SymmSyncError,
    ViewError,
)
from .ops.oplib import define_op  # noqa: E402
from .spanning import exchange as _offnode  # noqa: E402, F401 - registers the post of spanning views' aborts (symmsync.core.failure)

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BoundsError",
    "CallMismatch",
    "CaptureError",
    "ClosedError",
    "ConfigError",
    "Consumer",
    "DebugCheckError",
    "Fence",
    "FenceTimeout",
    "IndexCheckError",
    "InputError",
    "Making",
    "PeerAborted",
    "PeerRefused",
    "PeerView",
    "RankFailure",
    "SignalAborted",
    "SignalTimeout",
    "Signals",
    "SizeMismatchError",
    "SymmSyncError",
    "SymmetricBuffer",
    "TP_PCP_ORDER",
    "ViewError",
    "carve",
    "define_op",
    "launch_grid_sync",
    "pcp_view",
    "tp_pcp_ranks",
    "tp_view",
]
