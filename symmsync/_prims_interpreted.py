"""The device primitives of :mod:`symmsync.language` under Triton's interpreter (host backend).

The same names as :mod:`symmsync._prims_compiled`. These are plain Python, called from
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
