"""Fail closed inside kernels, on the host backend: indices checked on every call, kept arguments
that fail after a close or an abort, and put_signal's checks.

* Indices are checked on every call, debug mode off: a peer, slot or member index out of range
  in a signal or fence primitive raises :class:`~symmsync.IndexCheckError` naming the rank, the
  program, the primitive, which index, its value and the bound, and never touches another
  member's word. The reported case: rank 0's ``signal(peer=2, slot=1)`` with ``slots=1`` would
  land in rank 1's slot 0 at rank 2 and make rank 2's wait on rank 1 pass.
* A wait through ``kernel_args`` kept past ``Signals.close()``, or past this rank's abort of the
  view, returns 2 at once whatever the slot holds (EQ 0 on a fresh slot, EQ 7 after a SET 7),
  and the record says why; a signal through them stores nothing. A fence's kept arguments fail
  even when a slot was forced past the epoch ``close()`` stores.
* ``put_signal`` takes a value and ADD or SET; debug mode refuses a counted wait on a SET slot.

Oracles come from outside the kernels: the slot values the host reads back, the error's fields
against the indices the test passed, the wait statuses the kernels store.
"""

import ctypes

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync.language import cells, records
from symmsync.testing import run

RUN_S = 240
NBYTES = 4096


def _own_cause(e):
    while e is not None and not isinstance(e, ss.SymmSyncError):
        e = e.__cause__
    return e


def _outcome(call):
    """``("ok", result, {})``, or the symmsync error the call raised (the interpreter may wrap it):
    ``(type name, message, its fields)``."""
    try:
        return ("ok", call(), {})
    except Exception as e:  # noqa: BLE001 - the interpreter wraps symmsync's error
        own = _own_cause(e)
        if own is None:
            return ("foreign", repr(e), {})
        fields = {k: getattr(own, k) for k in ("rank", "primitive", "which", "value", "bound") if hasattr(own, k)}
        return (type(own).__name__, str(own), fields)


def _words(address, n):
    return [ctypes.c_int64.from_address(address + 8 * i).value for i in range(n)]


# ---------------------------------------------------------------------- kernels
@triton.jit
def signal_kernel(sig, me, peer, slot, value, OP: tl.constexpr, NSLOTS: tl.constexpr):
    ssl.signal(sig, me, peer, slot, value, OP, NSLOTS)


@triton.jit
def wait_kernel(
    sig,
    me,
    timeout_ns,
    record,
    peer,
    slot,
    value,
    out,
    COUNTED: tl.constexpr,
    SIZE: tl.constexpr,
    NSLOTS: tl.constexpr,
    TRAP: tl.constexpr,
):
    if COUNTED:
        tl.store(out, ssl.wait_count(sig, me, peer, slot, value, timeout_ns, record, SIZE, NSLOTS, TRAP))
    else:
        tl.store(out, ssl.wait_signal(sig, me, peer, slot, value, ssl.EQ, timeout_ns, record, SIZE, NSLOTS, TRAP))


@triton.jit
def read_kernel(sig, me, peer, slot, out, NSLOTS: tl.constexpr):
    tl.store(out, ssl.read_signal(sig, me, peer, slot, NSLOTS))


@triton.jit
def put_kernel(sig, me, peer, slot, value, OP: tl.constexpr, NSLOTS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ssl.put_signal(sig, me, peer, i * 8, (i + 100).to(tl.int64), i < BLOCK, slot, NSLOTS, value, OP)


@triton.jit
def put_default_kernel(sig, me, peer, slot, NSLOTS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ssl.put_signal(sig, me, peer, i * 8, (i + 100).to(tl.int64), i < BLOCK, slot, NSLOTS)  # ADD 1


@triton.jit
def data_ptr_kernel(sig, peer, NSLOTS: tl.constexpr):
    tl.store(ssl.data_ptr(sig, peer, 0, tl.int64), 7)


@triton.jit
def publish_kernel(ptrs, cell, me, SIZE: tl.constexpr):
    ssl.publish(ptrs, cell, me, SIZE)


@triton.jit
def wait_or_trap_kernel(ptrs, cell, me, timeout_ns, record, out, SIZE: tl.constexpr):
    e = tl.load(ssl.epoch_ptr(ptrs, cell, 0))
    tl.store(out, ssl.wait_or_trap(ptrs, cell, me, e, timeout_ns, record, SIZE, False))


@triton.jit
def forge_then_fence(ptrs, cell, me, timeout_ns, record, peer, forged, out, SIZE: tl.constexpr):
    # A slot of this rank's cell forced to a value past any epoch (garbage, or an overrun),
    # then a whole fence through the same arguments.
    slot = (tl.load(ptrs + me) + cell + ssl.SLOTS).to(tl.pointer_type(tl.int64)) + peer
    tl.store(slot, forged)
    e = ssl.publish(ptrs, cell, me, SIZE)
    tl.store(out, ssl.wait_or_trap(ptrs, cell, me, e, timeout_ns, record, SIZE, False))


# ---------------------------------------------------------------------- indices (item 2), 3 ranks, debug off
def reported_case():
    buf = ss.SymmetricBuffer(NBYTES, backend="host")
    view = buf.view([0, 1, 2])
    sigs = ss.Signals(view, slots=1, timeout_s=1.0)
    me, c = view.local_index, sigs.constexprs
    args = sigs.kernel_args
    out = {"debug": ssl.DEBUG}
    status = torch.full((1,), -1, dtype=torch.int64)
    if me == 0:  # the reported case: slot 1 of 1, to member 2 (inbox[0][1] is inbox[1][0] there)
        out["reported"] = _outcome(lambda: signal_kernel[(1,)](args[0], me, 2, 1, 1, OP=ssl.ADD, NSLOTS=1))
    dist.barrier()
    if me == 2:  # rank 1 never signalled: the wait on its slot 0 must not pass
        out["victim"] = _outcome(
            lambda: wait_kernel[(1,)](*args, 1, 0, 1, status, COUNTED=False, **c) or int(status.item())
        )
    dist.barrier()
    out["values"] = sigs.values().tolist()
    buf.close()
    return out


def bad_indices():
    buf = ss.SymmetricBuffer(NBYTES, backend="host")
    view = buf.view([0, 1, 2])
    sigs = ss.Signals(view, slots=1, timeout_s=1.0)
    fence = ss.Fence(view, timeout_s=30)
    me, c = view.local_index, sigs.constexprs
    args = sigs.kernel_args
    out = {}
    status = torch.full((1,), -1, dtype=torch.int64)
    cases = {
        "signal peer 3": lambda: signal_kernel[(1,)](args[0], me, 3, 0, 1, OP=ssl.ADD, NSLOTS=1),
        "signal peer -1": lambda: signal_kernel[(1,)](args[0], me, -1, 0, 1, OP=ssl.SET, NSLOTS=1),
        "signal slot -1": lambda: signal_kernel[(1,)](args[0], me, 1, -1, 1, OP=ssl.ADD, NSLOTS=1),
        "wait_signal peer 3": lambda: wait_kernel[(1,)](*args, 3, 0, 0, status, COUNTED=False, **c),
        "wait_signal slot 1": lambda: wait_kernel[(1,)](*args, 1, 1, 0, status, COUNTED=False, **c),
        "wait_count peer -2": lambda: wait_kernel[(1,)](*args, -2, 0, 0, status, COUNTED=True, **c),
        "wait_count slot 5": lambda: wait_kernel[(1,)](*args, 0, 5, 0, status, COUNTED=True, **c),
        "read_signal peer 3": lambda: read_kernel[(1,)](args[0], me, 3, 0, status, NSLOTS=1),
        "read_signal slot -1": lambda: read_kernel[(1,)](args[0], me, 0, -1, status, NSLOTS=1),
        "put_signal peer 3": lambda: put_default_kernel[(1,)](args[0], me, 3, 0, NSLOTS=1, BLOCK=8),
        "put_signal slot 1": lambda: put_default_kernel[(1,)](args[0], me, 1, 1, NSLOTS=1, BLOCK=8),
        "data_ptr peer 3": lambda: data_ptr_kernel[(1,)](args[0], 3, NSLOTS=1),
        "data_ptr peer -1": lambda: data_ptr_kernel[(1,)](args[0], -1, NSLOTS=1),
        "signal member 3": lambda: signal_kernel[(1,)](args[0], 3, 0, 0, 1, OP=ssl.ADD, NSLOTS=1),
    }
    for name, call in cases.items():
        out[name] = _outcome(call)
    out["record"] = records.read_misuse_record(sigs._record.tolist())
    ptrs, cell, rec = fence.kernel_args[0], fence.cell, fence.record
    out["publish member 3"] = _outcome(lambda: publish_kernel[(1,)](ptrs, cell, 3, SIZE=3))
    out["wait_or_trap member -1"] = _outcome(
        lambda: wait_or_trap_kernel[(1,)](ptrs, cell, -1, fence.timeout_ns, rec, status, SIZE=3)
    )
    out["fence record"] = _outcome(lambda: fence.timeout_error())
    dist.barrier()  # every bad call made: nothing may have landed anywhere
    out["values"] = sigs.values().tolist()
    out["user"] = buf.local_memory()[:64].view(torch.int64).tolist()
    out["epoch"] = fence.epoch
    buf.close()
    return out


@pytest.fixture(scope="module")
def index_runs():
    return run(bad_indices, 3, backend="host", timeout_s=RUN_S)


def test_the_reported_slot_past_the_end_raises_on_the_signalling_rank_and_never_passes_the_victims_wait():
    runs = run(reported_case, 3, backend="host", timeout_s=RUN_S)
    assert not runs[0]["debug"]
    victim = runs[2]["victim"]
    assert victim == ("ok", 1, {}), victim  # timed out, never 0: rank 1 never signalled
    assert runs[2]["values"] == [[0], [0], [0]]  # rank 1's slot at rank 2 untouched
    kind, msg, fields = runs[0]["reported"]
    assert kind == "IndexCheckError", runs[0]["reported"]
    assert fields == {"rank": 0, "primitive": "signal", "which": "slot", "value": 1, "bound": 1}, fields
    assert "rank 0, program (0, 0, 0): signal: slot index 1 is out of range [0, 1)" in msg, msg


BAD = [
    ("signal peer 3", "signal", "peer", 3, 3),
    ("signal peer -1", "signal", "peer", -1, 3),
    ("signal slot -1", "signal", "slot", -1, 1),
    ("wait_signal peer 3", "wait_signal", "peer", 3, 3),
    ("wait_signal slot 1", "wait_signal", "slot", 1, 1),
    ("wait_count peer -2", "wait_count", "peer", -2, 3),
    ("wait_count slot 5", "wait_count", "slot", 5, 1),
    ("read_signal peer 3", "read_signal", "peer", 3, 3),
    ("read_signal slot -1", "read_signal", "slot", -1, 1),
    ("put_signal peer 3", "put_signal", "peer", 3, 3),
    ("put_signal slot 1", "put_signal", "slot", 1, 1),
    ("data_ptr peer 3", "data_ptr", "peer", 3, 3),
    ("data_ptr peer -1", "data_ptr", "peer", -1, 3),
    ("signal member 3", "signal", "member", 3, 3),
    ("publish member 3", "publish", "member", 3, 3),
    ("wait_or_trap member -1", "wait_or_trap", "member", -1, 3),
]


@pytest.mark.parametrize("case,primitive,which,value,bound", BAD, ids=[b[0] for b in BAD])
def test_an_index_out_of_range_raises_index_check_error_naming_rank_primitive_index_and_bound(
    index_runs, case, primitive, which, value, bound
):
    for rank, out in enumerate(index_runs):
        kind, msg, fields = out[case]
        assert kind == "IndexCheckError", (rank, out[case])
        assert fields == {"rank": rank, "primitive": primitive, "which": which, "value": value, "bound": bound}
        assert f"rank {rank}, program (0, 0, 0): {primitive}: {which} index {value} is out of range [0, {bound})" in msg


def test_a_bad_index_touches_no_members_word(index_runs):
    for out in index_runs:
        assert out["values"] == [[0], [0], [0]], out["values"]  # no slot of any member moved
        assert out["user"] == [0] * 8, out["user"]  # no put_signal or data_ptr store landed
        assert out["epoch"] == 0  # the bad publish advanced nothing


def test_a_bad_index_is_recorded_for_the_host_reader(index_runs):
    for rank, out in enumerate(index_runs):
        rec = out["record"]  # the last bad Signals call's record: data_ptr, then signal's member
        assert rec is not None and not rec.refused, rec
        assert (rec.rank, rec.primitive, rec.which, rec.value, rec.bound) == (rank, "signal", "member", 3, 3)
        kind, msg, fields = out["fence record"]  # wait_or_trap recorded it in the fence's record
        assert kind == "ok" and isinstance(msg, ss.IndexCheckError), out["fence record"]
        assert (msg.rank, msg.which, msg.value, msg.bound) == (rank, "member", -1, 3)


# ---------------------------------------------------------------------- closed handles (item 3)
def kept_signals(how):
    buf = ss.SymmetricBuffer(NBYTES, backend="host")
    view = buf.view([0, 1])
    sigs = ss.Signals(view, slots=2, timeout_s=30)
    me, peer = view.local_index, 1 - view.local_index
    args, c = sigs.kernel_args, sigs.constexprs
    sigs.signal(peer, 1, 7, op="set")  # the peer's slot 1 here will hold 7
    dist.barrier()
    status = torch.full((1,), -1, dtype=torch.int64)

    def wait(slot, value, counted=False):
        wait_kernel[(1,)](*args, peer, slot, value, status, COUNTED=counted, **c)
        return int(status.item())

    out = {"before": [wait(0, 0), wait(1, 7), wait(1, 0, counted=True)]}  # all hold: 0, 0, 0
    dist.barrier()
    if how == "close":
        sigs.close()
    else:
        view.abort("planted by the test")
    out["after"] = [wait(0, 0), wait(1, 7), wait(1, 0, counted=True)]
    out["record"] = records.read_signal_record(_words(args[3], records.SIGNAL_RECORD_WORDS))
    dist.barrier()  # both waited: now signal through the kept handle, which must store nothing
    signal_kernel[(1,)](args[0], me, peer, 0, 5, OP=ssl.ADD, NSLOTS=2)
    put_kernel[(1,)](args[0], me, peer, 0, 9, OP=ssl.SET, NSLOTS=2, BLOCK=8)
    out["refused"] = records.read_misuse_record(_words(args[3], records.SIGNAL_RECORD_WORDS))
    dist.barrier()
    inbox = int(args[0][cells.HANDLE_INBOX + me])  # this rank's inbox, kept mapped by the handle
    out["slots"] = _words(inbox, 4)[2 * peer : 2 * peer + 2]  # inbox[peer][0..1]: what the peer signalled here
    out["user"] = buf.local_memory()[:64].view(torch.int64).tolist() if how == "abort" else None
    buf.close()
    return out


@pytest.mark.parametrize("how", ["close", "abort"])
def test_a_wait_through_kept_signals_args_fails_at_once_whatever_the_slot_holds(how):
    for rank, out in enumerate(run(kept_signals, 2, how, backend="host", timeout_s=RUN_S)):
        assert out["before"] == [0, 0, 0], out  # the conditions hold: a live handle passes
        assert out["after"] == [2, 2, 2], out  # the same waits through the kept handle: fail closed
        rec = out["record"]
        assert rec is not None and rec.aborted and rec.aborter == rec.index == rank, rec
        why = cells.decode_reason(rec.reason)
        assert why == ("closed" if how == "close" else "planted by the test"), why


@pytest.mark.parametrize("how", ["close", "abort"])
def test_a_signal_through_kept_signals_args_stores_nothing_and_says_so(how):
    for out in run(kept_signals, 2, how, backend="host", timeout_s=RUN_S):
        # this rank's slots from the peer: slot 0 never moved (no ADD 5, no SET 9), slot 1 holds the SET 7
        assert out["slots"][:2] == [0, 7], out["slots"]
        rec = out["refused"]
        assert rec is not None and rec.refused and rec.primitive == "put_signal", rec
        assert rec.which == ("closed" if how == "close" else "aborted"), rec
        if how == "abort":  # the buffer is open: the tile of the refused put_signal never landed
            assert out["user"] == [0] * 8, out["user"]


def kept_fence(_):
    buf = ss.SymmetricBuffer(NBYTES, backend="host")
    view = buf.view([0, 1])
    fence = ss.Fence(view, timeout_s=2)
    fence.fence()
    args = fence.kernel_args
    buf.close()
    dist.barrier()
    status = torch.full((1,), -1, dtype=torch.int64)
    forged = cells.CLOSED_EPOCH + 5  # past the epoch this launch's publish waits for
    forge_then_fence[(1,)](*args, 1 - view.local_index, forged, status, SIZE=2)
    rec = records.read_fence_record(_words(args[4], records.fence_record_words(2)))
    if rec is None:  # the wait passed: nothing recorded
        return int(status.item()), None
    return int(status.item()), rec.aborted, rec.aborter == rec.index, cells.decode_reason(rec.reason)


def test_a_fence_wait_through_kept_args_fails_even_with_a_slot_forced_past_the_closed_epoch():
    for out in run(kept_fence, 2, None, backend="host", timeout_s=RUN_S):
        assert out == (2, True, True, "closed"), out


# ---------------------------------------------------------------------- put_signal value and op (item 6)
def put_values():
    buf = ss.SymmetricBuffer(NBYTES, backend="host")
    view = buf.view([0, 1])
    sigs = ss.Signals(view, slots=2, timeout_s=30)
    me, peer = view.local_index, 1 - view.local_index
    args, c = sigs.kernel_args, sigs.constexprs
    if me == 0:
        put_kernel[(1,)](args[0], me, peer, 0, 41, OP=ssl.SET, NSLOTS=2, BLOCK=8)
        put_kernel[(1,)](args[0], me, peer, 1, 3, OP=ssl.ADD, NSLOTS=2, BLOCK=8)
        put_kernel[(1,)](args[0], me, peer, 1, 4, OP=ssl.ADD, NSLOTS=2, BLOCK=8)
    status = torch.full((1,), -1, dtype=torch.int64)
    if me == 1:
        wait_kernel[(1,)](*args, peer, 0, 41, status, COUNTED=False, **c)
    dist.barrier()
    out = {"values": sigs.values().tolist(), "status": int(status.item()), "tile": None}
    if me == 1:
        out["tile"] = buf.local_memory()[:64].view(torch.int64).tolist()
    buf.close()
    return out


def test_put_signal_sets_or_adds_the_value_it_is_given():
    receiver = run(put_values, 2, backend="host", timeout_s=RUN_S)[1]
    assert receiver["status"] == 0  # wait_signal EQ 41 on the SET slot passed
    assert receiver["values"] == [[41, 7], [0, 0]], receiver["values"]  # SET 41; ADD 3 then ADD 4
    assert receiver["tile"] == list(range(100, 108)), receiver["tile"]


# ---------------------------------------------------------------------- counted waits on SET slots (item 6)
def counted_on_set():
    buf = ss.SymmetricBuffer(NBYTES, backend="host")
    view = buf.view([0, 1])
    sigs = ss.Signals(view, slots=2, timeout_s=30)
    peer = 1 - view.local_index
    sigs.signal(peer, 0, 3, op="set")  # slot 0: a flag the peer SET
    sigs.signal(peer, 1, 3, op="add")  # slot 1: a counter
    dist.barrier()
    out = {"debug": ssl.DEBUG}
    out["add"] = _outcome(lambda: sigs.wait_count(peer, 1, 3))
    out["set"] = _outcome(lambda: sigs.wait_count(peer, 0, 1))
    dist.barrier()
    buf.close()
    return out


def test_debug_mode_refuses_a_counted_wait_on_a_slot_a_peer_set():
    for rank, out in enumerate(run(counted_on_set, 2, backend="host", timeout_s=RUN_S, env={"SYMMSYNC_DEBUG": "1"})):
        assert out["debug"] and out["add"] == ("ok", None, {}), out
        kind, msg, _fields = out["set"]
        assert kind == "DebugCheckError" and f"rank {rank}" in msg, out["set"]
        assert "wait_count on slot 0, which a peer SET" in msg and "wait_signal" in msg, msg


def test_without_debug_mode_a_counted_wait_reads_a_set_value_as_that_many_signals():
    for out in run(counted_on_set, 2, backend="host", timeout_s=RUN_S):
        assert not out["debug"] and out["set"] == ("ok", None, {}), out  # the documented pitfall, unchecked
