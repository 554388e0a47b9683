"""The call header: how the members of a consumer tell each other which call they make, and
whether they refuse it. The device half; the host half is :class:`symmsync.core.calls.Calls`.

Every call of a consumer made with the kit (:mod:`symmsync.core.consumer`) carries a header:
its kind, its number (counted on the device), four size words, and a refusal with its reason.
A member stores its header into every member's header memory before the release that ends its
part of the call, and every member compares every member's header with its own after the
acquire that starts its reads. So every member reaches the same verdict on a call, in the
kernel, before it reads a byte of it::

    n = call_number(calls)                        # this call's number (the device counts calls)
    ...this member's stores to its peers...
    post_call(calls, me, n, KIND, a, b, c, d, refused, where, value, SIZE)   # one program
    ...the consumer's release (publish, signal), then its acquire (wait)...
    status, who = check_call(calls, me, n, KIND, a, b, c, d, refused, SIZE)
    ...read only if status == OK; else store the outputs' poison (NaN)...
    end_call(calls, me, n, KIND, status, who, SIZE, EVERY)   # keeps a failure, counts the call

``status`` is :data:`OK` when every member's header is this call's and nobody refused;
:data:`MISMATCH` when a member's kind, number or size words differ (``who``: the first such
member, in view order); :data:`REFUSED` when a member refused its part (``who``: the first
refusing member). Every member compares the same headers, so every member reaches the same
status: a refused or differing call reads nothing anywhere, and each member still takes part
in the call's synchronization, so the next call of every member is in step.

Why a header is read only once it is whole, and never overwritten while a member reads it:
a member's header stores precede its release (after a block barrier), and the members read it
after their acquire of that release; member ``m`` writes headers of parity ``n % 2`` for call
``n`` only after its own call ``n - 1`` ended, and that call waited for every member's release
of call ``n - 1``, which each member made after its reads of call ``n - 2``'s headers, of the
same parity (the argument of ``verify/moe.pml``, whose steps carry this header).

Memory (int64 words). The handle a kernel takes (``Calls.kernel_args[0]``, on the device)::

    --8<-- [start:handle]
    handle   [state, reason, base[0], ..., base[SIZE - 1]]
      state    address of this member's state words (device memory: the status word first)
      reason   address of this member's staged refusal reason (REASON_WORDS words, host memory
               a kernel reads: pinned on GPUs)
      base[p]  address of member p's header memory (memory of the Calls object's own)
    headers  at base[r]: header[2][SIZE], HEADER_WORDS words each: header[q][m] is member m's
             header of its last call of parity q, as member r received it
    header   [tag + kind, number, a, b, c, d, refused, where, value, 0 ..., reason[REASON_WORDS], 0 ...]
      refused  0, REFUSED_HOST (the member's arguments failed its host checks: the reason words
               say why), or a consumer's own code >= REFUSED_DEVICE (found in a kernel; where and
               value say what)
    state    [status, number, kind, who, later, calls, arrived, worst, own, 0 ..., header[SIZE]]
      status   OK, or the earliest failed call the host has not settled: REFUSED, MISMATCH,
               WAIT_FAILED (a wait of the call failed); number, kind, who: that call's
      later    failed calls after it
      calls    calls made: the number of the next call
      arrived, worst   end_call(EVERY): the launch's programs counted, and their worst status
      own      this member's refusal code of the call in progress (post_call)
      header   every member's header of the earliest failed call (what the host reads)
    --8<-- [end:handle]

A refusal of this member's own arguments found on its host (``REFUSED_HOST``) is not kept in
its own state: its call raised at once. Every other failure is kept until the host settles it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import cells
from .core import ARRIVALS, arrive, program_index
from .fence import _wait_or_trap, epoch_ptr
from .records import MEMBER, P_GRID_FENCE, check_index

#: Words of the handle before the bases.
HANDLE_STATE, HANDLE_REASON, HANDLE_BASES = 0, 1, 2
#: Words of a header, and the fields in it; the first COMPARED words are compared across members.
HEADER_WORDS = 32
H_TAG, H_NUMBER, H_A, H_B, H_C, H_D, H_REFUSED, H_WHERE, H_VALUE = range(9)
COMPARED = 6
H_REASON = 16
#: Word 0 of a header: ``TAG + kind``, so that a header never written (zeros) matches no call.
TAG = 0x4341_4C4C_0000  # "CALL" << 16
#: Words of the state before the copy of the failed call's headers.
S_STATUS, S_NUMBER, S_KIND, S_WHO, S_LATER, S_CALLS, S_ARRIVED, S_WORST, S_OWN = range(9)
S_HEADERS = 16
#: A call's status (the state's status word, and what check_call returns), worst last.
OK, REFUSED, MISMATCH, WAIT_FAILED = 0, 1, 2, 3
#: Refusal codes in a header: none; the member's host checks (its reason in the header); a
#: consumer's own codes from here up (found in a kernel; ``where`` and ``value`` say what).
REFUSED_NONE, REFUSED_HOST, REFUSED_DEVICE = 0, 1, 2

assert H_REASON + cells.REASON_WORDS <= HEADER_WORDS and H_VALUE < H_REASON and COMPARED <= H_REFUSED


def handle_words(size: int) -> int:
    """int64 words of the handle of a view of ``size`` members."""
    return HANDLE_BASES + size


def header_memory_bytes(size: int) -> int:
    """Bytes of a member's header memory (two parities of ``size`` headers)."""
    return 2 * size * HEADER_WORDS * 8


def state_words(size: int) -> int:
    """int64 words of the state of a view of ``size`` members."""
    return S_HEADERS + size * HEADER_WORDS


_HW = tl.constexpr(HEADER_WORDS)
_HB = tl.constexpr(HEADER_WORDS * 8)
_TAG = tl.constexpr(TAG)
_H_NUMBER, _H_A, _H_B, _H_C, _H_D = (tl.constexpr(w) for w in (H_NUMBER, H_A, H_B, H_C, H_D))
_H_REFUSED, _H_WHERE, _H_VALUE, _H_REASON = (tl.constexpr(w) for w in (H_REFUSED, H_WHERE, H_VALUE, H_REASON))
_COMPARED = tl.constexpr(COMPARED)
_REASON_WORDS = tl.constexpr(cells.REASON_WORDS)
_S_STATUS, _S_NUMBER, _S_KIND, _S_WHO, _S_LATER = (
    tl.constexpr(w) for w in (S_STATUS, S_NUMBER, S_KIND, S_WHO, S_LATER)
)
_S_CALLS, _S_ARRIVED, _S_WORST, _S_OWN = (tl.constexpr(w) for w in (S_CALLS, S_ARRIVED, S_WORST, S_OWN))
_S_HEADERS = tl.constexpr(S_HEADERS)
_OK, _REFUSED, _MISMATCH = tl.constexpr(OK), tl.constexpr(REFUSED), tl.constexpr(MISMATCH)
_WAIT_FAILED = tl.constexpr(WAIT_FAILED)
_REFUSED_HOST = tl.constexpr(REFUSED_HOST)
_HANDLE_STATE, _HANDLE_REASON, _HANDLE_BASES = (tl.constexpr(w) for w in (HANDLE_STATE, HANDLE_REASON, HANDLE_BASES))


@triton.jit
def _ptr(calls, word):
    # The address in word ``word`` of the handle, as an int64 pointer.
    return tl.load(calls + word).to(tl.pointer_type(tl.int64))


@triton.jit
def _state(calls):
    return _ptr(calls, _HANDLE_STATE)


@triton.jit
def _i64(v):
    # ``v`` as an int64 scalar, whether a kernel passes a tensor or a literal.
    return tl.full((), 0, tl.int64) + v


@triton.jit
def _one(shape):
    # A full block of true: a block mask ANDed with a scalar flag (triton 3.9's interpreter
    # refuses a block ANDed with a scalar flag of another dtype).
    return tl.full(shape, 1, tl.int1)


@triton.jit
def call_number(calls):
    """This call's number: the calls this member made before it (counted on the device, by
    :func:`end_call`; a captured graph's replays count on). Read it before any program of the
    launch can reach :func:`end_call` (at the kernel's start)."""
    return tl.load(_state(calls) + _S_CALLS)


@triton.jit
def _compared(n, KIND: tl.constexpr, a, b, c, d):
    # The compared words of call n, as a block of HEADER_WORDS lanes (zeros past COMPARED).
    w = tl.arange(0, _HW)
    words = tl.where(w == 0, _TAG + KIND, 0).to(tl.int64)
    words = tl.where(w == _H_NUMBER, _i64(n), words)
    words = tl.where(w == _H_A, _i64(a), words)
    words = tl.where(w == _H_B, _i64(b), words)
    words = tl.where(w == _H_C, _i64(c), words)
    words = tl.where(w == _H_D, _i64(d), words)
    return words


@triton.jit
def post_call(calls, me, n, KIND: tl.constexpr, a, b, c, d, refused, where, value, SIZE: tl.constexpr):
    """Store this member's header of call ``n`` into every member's header memory (its own too).

    Call it from one program, after the call's stores to the peers and before the consumer's
    release (which comes after a block barrier: every thread's header stores are released with
    it). ``KIND`` tells the consumer's kinds of call apart; ``a`` .. ``d`` are the call's size
    words (what the members must pass alike; 0 where unused); ``refused`` is 0, or the
    refusal's code (:data:`REFUSED_HOST`: the reason words this member's host staged go with
    it; a consumer's own code from :data:`REFUSED_DEVICE` up, with ``where`` and ``value``).
    """
    w = tl.arange(0, _HW)
    words = _compared(n, KIND, a, b, c, d)
    code = _i64(refused)
    words = tl.where(w == _H_REFUSED, code, words)
    words = tl.where(w == _H_WHERE, _i64(where), words)
    words = tl.where(w == _H_VALUE, _i64(value), words)
    lane = w - _H_REASON
    in_reason = (lane >= 0) & (lane < _REASON_WORDS)
    reason = _ptr(calls, _HANDLE_REASON)
    staged = _one(w.shape) & (code == _REFUSED_HOST)
    text = tl.load(reason + tl.where(in_reason, lane, 0), mask=in_reason & staged, other=0)
    words = tl.where(in_reason, text, words)
    q = _i64(n % 2)
    for m in tl.static_range(SIZE):
        dst = _ptr(calls, _HANDLE_BASES + m) + (q * SIZE + me) * _HW
        tl.store(dst + w, words)
    tl.store(_state(calls) + _S_OWN, code)


@triton.jit
def posted_refusal(calls):
    """This member's refusal code of the call in progress, as its :func:`post_call` stored it: what
    a launch after the one that posted passes :func:`check_call` as ``refused``."""
    return tl.load(_state(calls) + _S_OWN)


@triton.jit
def check_call(calls, me, n, KIND: tl.constexpr, a, b, c, d, refused, SIZE: tl.constexpr):
    """The verdict on call ``n``, after the acquire that follows every member's release of it:
    ``(status, who)``. :data:`OK` and -1 when every member's header is this call's and nobody
    refused; else, in this order, :data:`MISMATCH` and the first member (view index) whose kind or
    number differs from this call's; :data:`REFUSED` and the first refusing member (whose size
    words are not compared: it sends nothing); :data:`MISMATCH` and the first member whose size
    words differ. This member's own words come from the arguments (another program of the launch
    may be storing them); loads of this member's own memory only, and no branch on them (a kernel
    may issue its first payload loads before the verdict arrives and hold back its stores). Every
    member reaches the same status."""
    w = tl.arange(0, _HW)
    mine = _compared(n, KIND, a, b, c, d)
    q = _i64(n % 2)
    own = _ptr(calls, _HANDLE_BASES + me) + q * SIZE * _HW
    none = tl.full((), -1, tl.int64)  # not from ``me``: a launch may pass it as the constant 1
    call, refuser, sizes = none, none, none  # the first member whose call, refusal, sizes differ
    for m in tl.static_range(SIZE):
        theirs = tl.load(own + m * _HW + w, mask=w <= _H_REFUSED, other=0, volatile=True)
        code = tl.sum(tl.where(w == _H_REFUSED, theirs, 0), axis=0)
        code = tl.where(m == me, _i64(refused), code)
        off = (theirs != mine) & (m != me)
        call = tl.where((tl.sum((off & (w < _H_A)).to(tl.int32), axis=0) > 0) & (call < 0), m, call)
        refuser = tl.where((code != 0) & (refuser < 0), m, refuser)
        size_off = tl.sum((off & (w >= _H_A) & (w < _COMPARED)).to(tl.int32), axis=0) > 0
        sizes = tl.where(size_off & (code == 0) & (sizes < 0), m, sizes)
    # A call (kind or number) that differs first; then a refusal (a refusing member sends nothing, and
    # its size words are not its call's: not compared); then sizes that differ among the others.
    status = tl.where(call >= 0, _MISMATCH, tl.where(refuser >= 0, _REFUSED, tl.where(sizes >= 0, _MISMATCH, _OK)))
    who = tl.where(call >= 0, call, tl.where(refuser >= 0, refuser, sizes))
    return _i64(status), who


@triton.jit
def end_call(calls, me, n, KIND: tl.constexpr, status, who, SIZE: tl.constexpr, EVERY: tl.constexpr):
    """End call ``n``: keep its failure for the host and count it (the next call is ``n + 1``).

    ``EVERY``: every program of the launch calls it (each with its own ``status``: the call's is
    the worst of them, a failed wait first); the last to arrive keeps and counts. Else exactly one
    program calls it. A failed call is kept until the host settles it (the earliest one, with every
    member's header of it; later ones are counted), so a runtime that reads the status word after
    many calls sees the first failure; a refusal of this member's own arguments found on its host
    is not kept (its call raised at once). Returns True for the program that kept and counted
    (the last to arrive; with ``EVERY`` False, the caller).
    """
    state = _state(calls)
    last = True
    if EVERY:
        tl.debug_barrier()
        tl.atomic_max(state + _S_WORST, _i64(status), sem="relaxed", scope="gpu")
        k = tl.atomic_add(state + _S_ARRIVED, 1, sem="acq_rel", scope="gpu")
        last = k == tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2) - 1
        if last:
            status = tl.maximum(tl.atomic_xchg(state + _S_WORST, 0, sem="relaxed", scope="gpu"), _i64(status))
            tl.atomic_xchg(state + _S_ARRIVED, 0, sem="relaxed", scope="gpu")
    if last:
        own = tl.load(state + _S_OWN)
        keep = (status != _OK) & ((status != _REFUSED) | (own != _REFUSED_HOST))
        if keep:
            if tl.load(state + _S_STATUS) == _OK:  # the earliest failure the host has not settled
                w = tl.arange(0, _HW)
                q = _i64(n % 2)
                mine = _ptr(calls, _HANDLE_BASES + me) + q * SIZE * _HW
                for m in tl.static_range(SIZE):
                    tl.store(state + _S_HEADERS + m * _HW + w, tl.load(mine + m * _HW + w, volatile=True))
                tl.store(state + _S_NUMBER, _i64(n))
                tl.store(state + _S_KIND, tl.full((), KIND, tl.int64))
                tl.store(state + _S_WHO, _i64(who))
                tl.store(state + _S_STATUS, _i64(status))
            else:
                tl.store(state + _S_LATER, tl.load(state + _S_LATER) + 1)
        tl.store(state + _S_OWN, 0)
        tl.store(state + _S_CALLS, _i64(n) + 1)
    return last


@triton.jit
def fence_call(
    calls, cells, cell, me, timeout_ns, record, KIND: tl.constexpr, a, b, c, d, refused,
    SIZE: tl.constexpr, TRAP: tl.constexpr,
):  # fmt: skip
    """The tail of a call's kernel that stores to its peers and reads nothing of theirs after: its
    header, a whole fence, the verdict and the call's end, in no extra launch. Every program calls
    it after its last store to the peers (the arguments as :func:`post_call`'s and a
    :class:`~symmsync.Fence`'s ``kernel_args``).

    Pseudocode::

        n = call_number()                                  # read before arriving
        program 0: post_call(n, KIND, a, b, c, d, refused) # released with the arrivals below
        k, e = arrive(&mem[me].cell.arrivals, num_programs - 1, RESET)   # the last one publishes e
        if k == num_programs - 1:                          # last one in
            waited = wait_or_trap(e)
            status, who = check_call(n, ...); end_call(n, status, who)   # kept, counted
        return status, last

    As :func:`~symmsync.language.grid_fence` (whose arrival it shares): on return of the launch
    every member's stores before its own ``fence_call`` are visible here. Returns ``(status,
    last)``: the call's status in the last program to arrive (``last`` True), :data:`OK` elsewhere.
    """
    check_index(me, SIZE, record, -1, P_GRID_FENCE, MEMBER, True)
    n = call_number(calls)
    if program_index() == 0:
        post_call(calls, me, n, KIND, a, b, c, d, refused, 0, 0, SIZE)
    counter = (tl.load(cells + me) + cell + ARRIVALS).to(tl.pointer_type(tl.int64))
    final = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2) - 1
    k, e = arrive(counter, epoch_ptr(cells, cell, me), final, cells, cell, me, SIZE, True)
    status = tl.full((), _OK, tl.int64)
    last = k == final
    if last:
        waited = _wait_or_trap(cells, cell, me, e, timeout_ns, record, SIZE, TRAP)
        status, who = check_call(calls, me, n, KIND, a, b, c, d, refused, SIZE)
        status = tl.where(waited == 0, status, _WAIT_FAILED)
        end_call(calls, me, n, KIND, status, who, SIZE, False)
    return status, last
