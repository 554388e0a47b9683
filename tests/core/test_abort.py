"""Failures reach every member at once , on the host backend.

A rank that gives up marks an abort flag in its slot at every member; a member
waiting for an epoch that rank never published raises ``PeerAborted`` naming it and
its reason within a poll, long before the fence's budget (60 s here, so a miss is
obvious). ``FenceTimeout`` tells a peer that closed from one that never arrived, and a
clean close after the last fence never fails a fence that already completed.

Oracles: the elapsed time against the budget, the error's type and fields, and the raw
slot words read with torch (``test_an_abort_is_never_taken_for_an_arrival`` shows that
a compare that ignored the flag would take an aborted member for an arrived one).
"""

import time

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl
from helpers import describe_error

import symmsync as ss
import symmsync.language as ssl
from symmsync.language import cells
from symmsync.language import core as _language_core

BUDGET_S = 60.0  # the fence budget: an abort that is missed shows up as a minute
FAST_S = 1.0  # an abort must reach every waiting member within this


def _setup(channels=1, budget=BUDGET_S):
    buf = ss.SymmetricBuffer(4096, backend="host", channels=channels)
    view = buf.view(list(range(buf.world_size)))
    fence = ss.Fence(view, timeout_s=budget)
    return buf, view, fence


def _raw_slots(buf, fence, view):
    """This rank's slot words of the fence's cell, read with torch (count | flag)."""
    local = buf.cell_memory()
    start = fence.cell + cells.SLOTS
    return local[start : start + 8 * view.size].view(torch.int64).tolist()


def _wait_for_abort(fence):
    t0 = time.monotonic()
    try:
        fence.fence()
    except ss.FenceTimeout as err:
        out = describe_error(err)
        out["elapsed"] = time.monotonic() - t0
        return out
    return "no error"


# ---------------------------------------------------------------------- an explicit abort
def one_rank_aborts(aborter, reason, rounds):
    buf, view, fence = _setup()
    for _ in range(rounds):
        fence.fence()
    if buf.rank == aborter:
        try:
            raise ValueError("bad input on this rank")
        except ValueError:
            fence.abort(reason)  # what an operation does before it raises
        out = {}
        try:
            fence.fence()  # the aborting rank's own fences fail closed
        except ss.PeerAborted as err:
            out["own"] = describe_error(err)
        dist.barrier()  # stay mapped until the peers have read the reason
        buf.close()
        return out
    out = _wait_for_abort(fence)
    out["slots"] = _raw_slots(buf, fence, view)
    dist.barrier()
    buf.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_that_aborts_makes_every_waiting_peer_raise_naming_it_at_once(world, host_ranks):
    aborter, reason, rounds = world - 1, "bad input: kv_c has 3 rows, the batch 4", 3
    results = host_ranks(one_rank_aborts, world, aborter, reason, rounds, timeout_s=120)
    own = results[aborter]["own"]
    assert own["type"] == "PeerAborted" and own["aborted"] == {aborter: reason}, own
    for rank in range(world):
        if rank == aborter:
            continue
        r = results[rank]
        assert isinstance(r, dict) and r["type"] == "PeerAborted", r
        assert r["elapsed"] < FAST_S, r["elapsed"]
        assert r["is_timeout"] and r["pickled"] == "PeerAborted"
        assert r["rank"] == rank and r["epoch"] == rounds + 1
        assert r["aborted"] == {aborter: reason} and r["closed"] == []
        # Another survivor may still be on its way to this fence (late), never the aborter.
        assert set(r["late"]) <= set(range(world)) - {aborter, rank}, r["late"]
        assert f"rank {aborter} aborted" in r["msg"] and reason in r["msg"], r["msg"]
        # The flag is the sign bit of the aborter's slot; the count stays what it published.
        raw = r["slots"][aborter]
        assert raw < 0 and raw & (2**63 - 1) == rounds, raw


def long_reason(aborter):
    buf, view, fence = _setup()
    fence.fence()
    reason = "é" * 80  # 160 bytes of UTF-8: cut at a character boundary
    if buf.rank == aborter:
        fence.abort(reason)
        fence.abort("a second reason is ignored")
        dist.barrier()
        buf.close()
        return reason
    out = _wait_for_abort(fence)
    dist.barrier()
    buf.close()
    return out


def test_a_long_reason_arrives_cut_at_a_character_and_a_second_abort_changes_nothing(host_ranks):
    results = host_ranks(long_reason, 2, 1, timeout_s=120)
    got = results[0]["aborted"][1]
    # 96 bytes hold 46 two-byte characters and the 3-byte "…" that says the text was cut.
    assert got == "é" * ((cells.REASON_TEXT_BYTES - 3) // 2) + "…"


# ---------------------------------------------------------------------- a fence after its own error
def fences_again_after_its_own_error(failer):
    buf, view, fence = _setup()
    fence.fence()
    if buf.rank == failer:
        error = ss.FenceTimeout("planted: this rank's fence failed", rank=failer, epoch=1, late={}, channel=0)
        view.failure.fail(fence, error)  # what a wait of its own that timed out reports
        try:
            fence.fence()  # raises the planted error, after marking the view aborted
        except ss.FenceTimeout as err:
            planted = str(err)
        dist.barrier()
        buf.close()
        return planted
    out = _wait_for_abort(fence)
    dist.barrier()
    buf.close()
    return out


def test_a_fence_after_the_ranks_own_error_aborts_the_view_before_raising(host_ranks):
    results = host_ranks(fences_again_after_its_own_error, 2, 0, timeout_s=120)
    assert results[0] == "planted: this rank's fence failed"
    r = results[1]
    assert r["type"] == "PeerAborted" and r["elapsed"] < FAST_S, r
    assert list(r["aborted"]) == [0] and "FenceTimeout on channel 0" in r["aborted"][0], r


# ---------------------------------------------------------------------- closed vs never arrived
def one_rank_closes(closer, channels):
    buf, view, fence = _setup(channels)
    fences = [fence] + [ss.Fence(view, channel=c, timeout_s=BUDGET_S) for c in range(1, channels)]
    fence.fence()
    if buf.rank == closer:
        buf.close()
        return "closed"
    return [_wait_for_abort(f) for f in fences]  # every channel of the view was marked


def test_a_peer_that_closed_is_reported_as_closed_on_every_channel_at_once(host_ranks):
    results = host_ranks(one_rank_closes, 3, 2, 2, timeout_s=120)
    for rank in (0, 1):
        for r in results[rank]:
            assert r["type"] == "PeerAborted" and r["elapsed"] < FAST_S, r
            assert r["aborted"] == {2: "closed"} and r["closed"] == [2], r
            # The closed rank is never "late"; the other survivor may be, if the abort was
            # seen before that rank reached the same fence (it is on its way, not gone).
            assert 2 not in r["late"] and set(r["late"]) <= {0, 1} - {rank}, r
            assert "rank 2 closed its buffer" in r["msg"], r["msg"]


def one_rank_never_arrives(absent, budget):
    buf, view, fence = _setup(budget=budget)
    fence.fence()
    if buf.rank == absent:
        dist.barrier()  # alive and open, but never at the second fence
        buf.close()
        return None
    out = _wait_for_abort(fence)
    dist.barrier()
    buf.close()
    return out


def test_a_peer_that_never_arrived_is_a_timeout_that_says_not_published_not_closed(host_ranks):
    budget = 1.5
    r = host_ranks(one_rank_never_arrives, 2, 1, budget, timeout_s=120)[0]
    assert r["type"] == "FenceTimeout" and r["elapsed"] >= budget, r
    assert r["late"] == {1: 1} and r["aborted"] == {} and r["closed"] == [], r
    assert "not published, neither closed nor aborted: rank 1" in r["msg"] and "closed its buffer" not in r["msg"]
    # this rank published the epoch: the message says so by naming no launch of its own at fault
    assert "did not reach this fence" in r["msg"] and "did not publish epoch" not in r["msg"], r["msg"]


# ---------------------------------------------------------------------- a clean close
def clean_close_after_the_last_fence(closer, fences):
    buf, view, fence = _setup()
    payload = [view.tensor(0, (1,), torch.int64, index=p) for p in range(view.size)]
    for e in range(1, fences + 1):
        if buf.rank == closer:
            for p in payload:  # the closer's stamp into every member, before its publish
                p[0] = e
        if buf.rank == closer and e == fences:
            fence.arrive()  # its last publish is out ...
            buf.close()  # ... and it closes before the others' waits have seen it
            dist.barrier()  # the handshake: the others start their last fence only now
            return "closed"
        if buf.rank != closer and e == fences:
            dist.barrier()  # the closer has published and closed: the wait below sees both
        fence.fence()
    seen = payload[view.local_index].item()
    slots = _raw_slots(buf, fence, view)
    buf.close()
    return {"seen": seen, "slot": slots[closer]}


def test_a_clean_close_after_the_last_fence_never_fails_a_fence_that_completed(host_ranks):
    fences = 3
    r = host_ranks(clean_close_after_the_last_fence, 2, 0, fences, timeout_s=120)[1]
    # The closer's slot carries the flag and the full count: the masked count completed it.
    assert r["slot"] < 0 and r["slot"] & (2**63 - 1) == fences, r
    assert r["seen"] == fences, r


# ---------------------------------------------------------------------- the flag is never an arrival
@triton.jit
def _wait_kernel(ptrs, cell, me, epoch, timeout_ns, status, SIZE: tl.constexpr):
    tl.store(status, ssl.wait(ptrs, cell, me, epoch, timeout_ns, SIZE))


def _wait_on_slot(word, epoch, budget_s=BUDGET_S):
    """symmsync's ``wait`` (language.wait, its bounded poll) for ``epoch`` at member 0 of a two-member
    cell in a torch tensor whose slot for member 1 holds ``word``, with a budget of ``budget_s``:
    (status, seconds it took)."""
    memory = torch.zeros(cells.cell_bytes(2) // 8, dtype=torch.int64)
    memory[cells.SLOTS // 8 + 1] = word
    ptrs = torch.tensor([memory.data_ptr()] * 2, dtype=torch.int64)  # member 1's table entry is never read
    status = torch.full((1,), -1, dtype=torch.int32)
    t0 = time.monotonic()
    _wait_kernel[(1,)](ptrs, 0, 0, epoch, int(budget_s * 1e9), status, SIZE=2)
    return status.item(), time.monotonic() - t0


def test_an_abort_is_never_taken_for_an_arrival(monkeypatch):
    """symmsync's wait on a slot that carries the abort flag: a member that aborted before it
    published the epoch is an abort (status 2, at once), one that published it and aborted
    afterwards an arrival (status 0: its data is valid). The oracle bites both ways: the flag
    in a non-sign bit (bit 62, as a naive design would put it) makes the same wait take the
    aborted member for an arrived one, and the same wait without the count mask
    (``COUNT_MASK`` patched to every bit) takes the member that published for an abort."""
    count, epoch = 4, 5  # the member published 4 fences, then aborted; the waiter needs 5
    assert cells.ABORT_FLAG == -(2**63) and ((count | cells.ABORT_FLAG) & cells.COUNT_MASK) == count
    assert ssl.ABORT_FLAG.value == cells.ABORT_FLAG and ssl.COUNT_MASK.value == cells.COUNT_MASK  # what kernels use
    status, elapsed = _wait_on_slot(count | cells.ABORT_FLAG, epoch)
    assert status == 2 and elapsed < FAST_S, (status, elapsed)  # an abort, seen at once: not the budget
    assert _wait_on_slot(epoch | cells.ABORT_FLAG, epoch)[0] == 0  # published, then aborted: arrived
    # No flag: the count decides (a member behind it is on its way: the wait times out).
    assert _wait_on_slot(epoch, epoch)[0] == 0 and _wait_on_slot(count, epoch, budget_s=0.2)[0] == 1
    # The flag in bit 62: the same wait reports an arrival for a member that never published.
    assert _wait_on_slot(count | (1 << 62), epoch)[0] == 0
    # Without the mask: the member that published the epoch before it aborted is taken for an abort.
    monkeypatch.setattr(_language_core, "COUNT_MASK", tl.constexpr(-1))
    assert _wait_on_slot(epoch | cells.ABORT_FLAG, epoch)[0] == 2


# ---------------------------------------------------------------------- grid_fence (fused tails)
@triton.jit
def _tail_kernel(ptrs, cell, me, timeout_ns, record, status, SIZE: tl.constexpr):
    s = ssl.grid_fence(ptrs, cell, me, timeout_ns, record, SIZE, False)
    tl.atomic_max(status, s)


def tail_sees_abort(aborter):
    buf, view, fence = _setup()
    fence.fence()
    if buf.rank == aborter:
        fence.abort("writer: bad input")
        dist.barrier()
        buf.close()
        return None
    status = torch.zeros(1, dtype=torch.int32)
    t0 = time.monotonic()
    _tail_kernel[(2,)](*fence.kernel_args, status, SIZE=view.size)
    elapsed = time.monotonic() - t0
    err = fence.timeout_error()  # what DirectKVWriter's fused path raises through Fence.check()
    dist.barrier()
    buf.close()
    return {"status": status.item(), "elapsed": elapsed, "err": describe_error(err)}


def test_a_grid_fence_tail_sees_an_abort_at_once(host_ranks):
    r = host_ranks(tail_sees_abort, 2, 1, timeout_s=120)[0]
    assert r["status"] == 2 and r["elapsed"] < FAST_S, r
    assert r["err"]["type"] == "PeerAborted" and r["err"]["aborted"] == {1: "writer: bad input"}, r


def tail_counts(launches, programs):
    """(epoch after ``launches`` fused tails of ``programs`` programs each, the arrival
    counter's word, the largest status) on a view of every rank."""
    buf, view, fence = _setup()
    status = torch.zeros(1, dtype=torch.int32)
    for _ in range(launches):
        _tail_kernel[(programs,)](*fence.kernel_args, status, SIZE=view.size)
    arrivals = buf.cell_memory()[fence.cell + cells.ARRIVALS :][:8].view(torch.int64).item()
    result = (fence.epoch, arrivals, status.item())
    dist.barrier()
    buf.close()
    return result


def test_a_grid_fence_of_one_member_advances_the_epoch_once_per_launch_and_counts_no_arrival(host_ranks):
    # One member: nobody to publish to or wait for; the epoch still counts launches.
    assert host_ranks(tail_counts, 1, 5, 3, timeout_s=120) == [(5, 0, 0)]


def test_a_grid_fence_of_two_members_advances_the_epoch_once_per_launch_and_resets_its_counter(host_ranks):
    # Every program arrives; only the last one publishes, and it resets the counter.
    assert host_ranks(tail_counts, 2, 3, 3, timeout_s=120) == [(3, 0, 0), (3, 0, 0)]


# ---------------------------------------------------------------------- abort's argument
def abort_checks_its_argument():
    buf, view, fence = _setup()
    try:
        view.abort(42)
    except ss.ConfigError as e:
        msg = str(e)
    buf.close()
    fence.abort("after close")  # close() aborted the view already: nothing more to send
    return msg, view.aborted


def test_abort_takes_a_string_and_is_a_no_op_after_close(host_ranks):
    msg, aborted = host_ranks(abort_checks_its_argument, 1, timeout_s=60)[0]
    assert msg.startswith("rank 0: PeerView.abort:") and "must be a str" in msg and aborted == "closed", msg


# ---------------------------------------------------------------------- the view's failure owner
class _Probe:
    """A waiter that is not a fence: any object with an ``abort_error`` method can register."""

    def abort_error(self, reason):
        return RuntimeError(f"probe: view aborted ({reason})")


def failure_owner_rules():
    buf, view, first = _setup(channels=3)
    second = ss.Fence(view, channel=1, timeout_s=BUDGET_S)
    probe = _Probe()
    view.failure.register(probe, "the probe")
    view.failure.check(probe)  # usable: may run
    own = ss.FenceTimeout("planted: channel 0 failed", rank=0, epoch=1, late={}, channel=0)
    view.failure.fail(first, own)
    out = {}
    for _ in range(2):  # the first operation aborts the view, the second only raises
        try:
            first.fence()
        except ss.FenceTimeout as err:
            out.setdefault("first", []).append((type(err).__name__, str(err), view.aborted))
    try:
        second.fence()  # failed by the abort: raises without launching
    except ss.PeerAborted as err:
        out["second"] = describe_error(err) | {"channel": err.channel}
    try:
        view.failure.check(probe)
    except RuntimeError as err:
        out["probe"] = str(err)
    late = ss.Fence(view, channel=2, timeout_s=BUDGET_S)  # made after the abort
    epoch = late.cell + cells.EPOCH
    try:
        late.fence()
    except ss.PeerAborted as err:
        out["late"] = describe_error(err)
    out["late_epoch_word"] = buf.cell_memory()[epoch : epoch + 8].view(torch.int64).item()
    buf.close()
    return out


def test_a_failed_fence_aborts_the_view_once_and_later_fences_and_waiters_fail_at_once(host_ranks):
    r = host_ranks(failure_owner_rules, 1, timeout_s=60)[0]
    reason = "rank 0: FenceTimeout on channel 0"
    assert r["first"] == [("FenceTimeout", "planted: channel 0 failed", reason)] * 2, r["first"]
    assert r["second"]["type"] == "PeerAborted" and r["second"]["aborted"] == {0: reason}, r
    assert r["second"]["channel"] == 1 and r["second"]["epoch"] == -1, r
    assert r["probe"] == f"probe: view aborted ({reason})", r
    assert r["late"]["type"] == "PeerAborted" and r["late"]["aborted"] == {0: reason}, r
    assert r["late_epoch_word"] == 0, r  # the fence made after the abort never launched
