"""The device primitives of :mod:`symmsync.language` for kernels compiled for NVIDIA GPUs.

Inline PTX, one statement per primitive. :mod:`symmsync.language` imports this module
or :mod:`symmsync.language.prims_interpreted` (the same names, for Triton's interpreter) once,
when it is imported, as :func:`symmsync.backends.mode.kernels_interpreted` decides.

An inline-asm statement runs in every thread that holds its operands (for a scalar,
every thread of the program). The reductions below are issued by thread 0 only, so a
program of any ``num_warps`` adds or ORs exactly once per call.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def clock_ns():
    """The global timer in nanoseconds (``%globaltimer``)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def release_add(ptr, live):
    """``red.release.sys.global.add.u64 [ptr], 1`` from thread 0, when ``live``."""
    # A reduction, not an exchange or a store: atom.exch waits for a reply across
    # NVLink, and a reduction measured faster per fence than a release store
    # (docs/performance.md, "The publish instruction").
    # Exactly once per call: only thread 0 issues it; otherwise a program of W warps
    # would add once per thread or warp and a slot would run ahead of its member's
    # epoch. Nothing is sent when not ``live``.
    tl.inline_asm_elementwise(
        "{ .reg .pred p, q; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 q, t, 0; "
        "setp.ne.and.s32 p, $2, 0, q; @p red.release.sys.global.add.u64 [$1], 1; }\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [ptr, tl.cast(live, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def release_or(ptr, value, live):
    """``red.release.sys.global.or.b64 [ptr], value`` from thread 0, when ``live``."""
    # The abort flag: the same once-per-call reduction as release_add (thread 0 only),
    # an OR so that marking twice changes nothing and the count bits stay intact.
    tl.inline_asm_elementwise(
        "{ .reg .pred p, q; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 q, t, 0; "
        "setp.ne.and.s32 p, $3, 0, q; @p red.release.sys.global.or.b64 [$1], $2; }\n\tmov.u32 $0, 0;",
        "=r,l,l,r",
        [ptr, tl.cast(value, tl.int64), tl.cast(live, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def load_acquire(ptrs):
    """``ld.acquire.sys.global.b64`` of each pointer."""
    return tl.inline_asm_elementwise(
        "ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptrs], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def memory_barrier_sys():
    """``fence.sc.sys``: a sequentially consistent memory barrier at system scope."""
    tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def trap():
    """``trap``: the kernel stops and the stream with it."""
    tl.inline_asm_elementwise("trap;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def signal_add(ptr, value):
    """``red.release.sys.global.add.u64 [ptr], value`` from thread 0."""
    # The publish reduction with a value: once per call (thread 0), no reply awaited.
    tl.inline_asm_elementwise(
        "{ .reg .pred q; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 q, t, 0; "
        "@q red.release.sys.global.add.u64 [$1], $2; }\n\tmov.u32 $0, 0;",
        "=r,l,l",
        [ptr, tl.cast(value, tl.int64)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def signal_set(ptr, value):
    """``st.release.sys.global.b64 [ptr], value`` from thread 0."""
    # A release store, not an exchange: the old value is not needed, and a store awaits no
    # reply across NVLink, so it measured faster per fence (docs/performance.md, "The
    # publish instruction").
    tl.inline_asm_elementwise(
        "{ .reg .pred q; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 q, t, 0; "
        "@q st.release.sys.global.b64 [$1], $2; }\n\tmov.u32 $0, 0;",
        "=r,l,l",
        [ptr, tl.cast(value, tl.int64)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def launch_id():
    """``%gridid``: the launch number of this grid in its context (debug checks only)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %gridid;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def pause(elapsed):
    """Nothing: a GPU's poll spins (the host backend's sleeps a moment once it waited long)."""
    pass


@triton.jit
def check_co_resident():
    """Nothing: the host checks co-residency before the launch (symmsync.core.fence.launch_grid_sync)."""
    pass


@triton.jit
def _program_index():
    # language.core.program_index (language.core imports this module, not the other way round)
    return tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))


@triton.jit
def debug_fail(bad, KIND: tl.constexpr, who, value):
    """When ``bad``: print what a debug check found (rank or index, program, value), then trap."""
    if bad:
        pid = _program_index()
        if KIND == 0:
            tl.device_print(
                "symmsync debug: publish from a second program of one launch: index, program, cell", who, pid, value
            )
        elif KIND == 1:
            tl.device_print(
                "symmsync debug: peer offset outside the user region: rank, program, offset", who, pid, value
            )
        else:
            tl.device_print(
                "symmsync debug: wait_count on a slot a peer SET (use wait_signal): rank, program, slot",
                who,
                pid,
                value,
            )
        trap()


@triton.jit
def index_fail(rank, PRIMITIVE: tl.constexpr, which, value, bound):
    """Print what an index check found (rank, program, primitive, which index, value, bound), then trap.

    Called by :func:`symmsync.language.records.check_index` after it wrote the record (where there is one)."""
    pid = _program_index()
    tl.device_print(
        "symmsync: index out of range (IndexCheckError): rank, program, primitive, which (0 peer 1 slot 2 member), "
        "value, bound",
        tl.full((), 0, tl.int64) + rank,  # each may be a compile-time constant: print them as tensors
        pid,
        tl.full((), PRIMITIVE, tl.int32),
        tl.full((), 0, tl.int32) + which,
        tl.full((), 0, tl.int64) + value,
        tl.full((), 0, tl.int64) + bound,
    )
    trap()
