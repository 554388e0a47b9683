"""The device primitives of :mod:`symmsync.language` under Triton's interpreter (host backend).

The same names as :mod:`symmsync.language.prims_compiled`. These are plain Python, called from
interpreted kernels while Triton's language is patched for them: a nested
``@triton.jit`` call would patch it again, which costs more than the fence itself.
The interpreter's int64 atomics are lock-free CPU atomics that honour the order asked
for, across processes too.
"""

from __future__ import annotations

import time

import triton.language as tl


def clock_ns():
    """``time.monotonic_ns()``, as an int64 scalar."""
    return tl.full((), time.monotonic_ns(), tl.int64)


#: After how long a wait (ns) the interpreter's poll sleeps :data:`PAUSE_S` between polls.
PAUSE_AFTER_NS = 1_000_000

#: How long that sleep is, in seconds.
PAUSE_S = 0.0002


def pause(elapsed):
    """Sleep :data:`PAUSE_S` once a poll has waited :data:`PAUSE_AFTER_NS` (``elapsed``, ns).

    A thread that only polls keeps the GIL from this process's other threads (the watch of
    spanning views, :mod:`symmsync.spanning.parts`, starved for seconds on a busy host) and a
    core from the other ranks' processes; a wait that long loses nothing to a sleep this short.
    """
    if _value(elapsed) > PAUSE_AFTER_NS:
        time.sleep(PAUSE_S)


def release_add(ptr, live):
    """Add 1 at ``ptr`` with release order, when ``live``."""
    tl.atomic_add(ptr, 1, mask=live, sem="release", scope="sys")


def release_or(ptr, value, live):
    """OR ``value`` into ``ptr`` with release order, when ``live``."""
    tl.atomic_or(ptr, value, mask=live, sem="release", scope="sys")


def load_acquire(ptrs):
    """An acquire load of each pointer (an atomic add of 0)."""
    return tl.atomic_add(ptrs, 0, sem="acquire", scope="sys")


def memory_barrier_sys():
    """Nothing: the interpreter runs a program's lanes as one sequence of operations."""


def trap():
    """Nothing: the host reads the wait's status after the launch instead."""


def signal_add(ptr, value):
    """Add ``value`` at ``ptr`` with release order."""
    tl.atomic_add(ptr, value, sem="release", scope="sys")


def signal_set(ptr, value):
    """Store ``value`` at ``ptr`` with release order (an atomic exchange)."""
    tl.atomic_xchg(ptr, value, sem="release", scope="sys")


# The interpreter has no launch number: count launches where the interpreter starts each one
# (it sets the grid's size once per launch). Installed only for debug checks.
_launches = [0]


def _count_launches() -> None:
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    if getattr(builder, "_symmsync_counts_launches", False):
        return
    set_grid_dim = builder.set_grid_dim

    def counting(*dims):
        _launches[0] += 1
        return set_grid_dim(*dims)

    builder.set_grid_dim = counting
    builder._symmsync_counts_launches = True


def launch_id():
    """This process's interpreter launch number (debug checks only)."""
    _count_launches()
    return tl.full((), _launches[0], tl.int64)


def _value(x) -> int:
    return int(x.handle.data.reshape(-1)[0]) if hasattr(x, "handle") else int(x)


def _program() -> tuple[int, int, int]:
    from triton.runtime import interpreter

    return interpreter.interpreter_builder.grid_idx


def _programs() -> int:
    from triton.runtime import interpreter

    nx, ny, nz = interpreter.interpreter_builder.grid_dim
    return nx * ny * nz


def check_co_resident():
    """Refuse a grid-wide wait in a launch of more than one program: the interpreter runs
    programs one after another, so the first would wait for the last forever."""
    n = _programs()
    if n > 1:
        import torch.distributed as dist

        from ..errors import ConfigError

        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ConfigError(
            f"rank {rank}: grid_sync: a launch of {n} programs on the host backend: its programs run one after "
            "another, so no program can wait for the others; launch one program here (symmsync.launch_grid_sync checks "
            "this before the launch)"
        )


_KINDS = (
    "publish from a second program of one launch on the channel cell at offset {value}: publish from one "
    "program per launch (or let grid_fence / grid_sync pick it)",
    "peer offset {value} is outside the view's user region: keep offsets in [0, nbytes)",
    "wait_count on slot {value}, which a peer SET: a counted wait would read the stored value as that many "
    'signals; wait on a SET slot with wait_signal (docs/signals.md, "Slot kinds")',
)


def debug_fail(bad, KIND, who, value):
    """When ``bad``: raise :class:`~symmsync.DebugCheckError` naming the rank, program and value.

    (The interpreter wraps it: the launch raises Triton's ``InterpreterError`` with this
    error as its ``__cause__``.)"""
    if not bool(_value(bad)):
        return
    import torch.distributed as dist

    from ..errors import DebugCheckError

    kind = int(getattr(KIND, "value", KIND))
    rank = dist.get_rank() if dist.is_initialized() else 0
    whom = f"view index {_value(who)}" if kind == 0 else f"rank {_value(who)}"
    raise DebugCheckError(
        f"rank {rank} ({whom}), program {_program()}: SYMMSYNC_DEBUG: " + _KINDS[kind].format(value=_value(value))
    )


def index_fail(rank, PRIMITIVE, which, value, bound):
    """Raise :class:`~symmsync.IndexCheckError` naming the rank, program, primitive, index and bound
    (called by :func:`symmsync.language.records.check_index` only for a bad index).

    ``rank`` is the handle's rank, or -1 (a fence primitive): then this process's rank."""
    import torch.distributed as dist

    from ..errors import IndexCheckError
    from .cells import INDEX_NAMES, PRIMITIVES

    who = _value(rank)
    if who < 0:
        who = dist.get_rank() if dist.is_initialized() else 0
    primitive = PRIMITIVES[int(getattr(PRIMITIVE, "value", PRIMITIVE))]
    kind = INDEX_NAMES[_value(getattr(which, "value", which))]
    raise IndexCheckError.describe(who, primitive, _program(), kind, _value(value), _value(bound))
