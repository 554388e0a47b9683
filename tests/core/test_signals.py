"""Point-to-point signals on the host backend: the pipelined transfer, comparisons, timeouts,
aborts, replayed rounds, peer atomics, the grid-wide wait and publish_and_wait from a kernel.

The pipeline oracle: rank 0 sends 8 chunks through a ring of 4 tiles in rank 1's memory
(``put_signal`` on the data slot); rank 1, a slow consumer, waits for each chunk, copies it
out and hands the tile back (a credit signal); the producer waits for a credit before it
reuses a tile. The oracle, written from the rule and not from the kernels: every chunk
arrives exactly (a torch reference), and the consumer finished chunk 0 before the producer
published chunk 7 (both clocks are the host's monotonic clock). The same run with the
consumer's wait removed, or the producer's credit wait removed, is caught by that oracle
(``test_the_pipeline_oracle_bites_without_*``).
"""

import time

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl
from helpers import spin

import symmsync as ss
import symmsync.language as ssl
from symmsync.testing import run

CHUNKS, RING, CHUNK = 8, 4, 64
DATA, CREDIT = 0, 1  # slots: the producer's data signals at the consumer; the consumer's credits back
RUN_S = 240


@triton.jit
def producer_kernel(
    sig,
    me,
    timeout_ns,
    record,
    src,
    log,
    ring,
    consumer,
    delay_ns,
    SIZE: tl.constexpr,
    NSLOTS: tl.constexpr,
    TRAP: tl.constexpr,
    CHUNKS: tl.constexpr,
    RING: tl.constexpr,
    CHUNK: tl.constexpr,
    CREDITS: tl.constexpr,
):
    spin(delay_ns)
    i = tl.arange(0, CHUNK)
    failed = me * 0
    for c in range(CHUNKS):
        if CREDITS:  # a free tile: the consumer granted RING credits up front, then one per chunk
            failed += ssl.wait_count(sig, me, consumer, 1, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
        vals = tl.load(src + c * CHUNK + i)
        live = (i < CHUNK) & (i * 0 + failed == 0)  # (a block: the interpreter's masks must not broadcast)
        ssl.put_signal(sig, me, consumer, ring + ((c % RING) * CHUNK + i) * 8, vals, live, 0, NSLOTS)
        tl.store(log + c, ssl.clock_ns())


@triton.jit
def consumer_kernel(
    sig,
    me,
    timeout_ns,
    record,
    out,
    log,
    ring,
    producer,
    delay_ns,
    SIZE: tl.constexpr,
    NSLOTS: tl.constexpr,
    TRAP: tl.constexpr,
    CHUNKS: tl.constexpr,
    RING: tl.constexpr,
    CHUNK: tl.constexpr,
    WAIT: tl.constexpr,
):
    i = tl.arange(0, CHUNK)
    failed = me * 0
    for c in range(CHUNKS):
        if WAIT:
            failed += ssl.wait_count(sig, me, producer, 0, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
        spin(delay_ns)  # a slow consumer: the tile stays in use a while after it arrived
        v = tl.load(ssl.data_ptr(sig, me, ring + ((c % RING) * CHUNK + i) * 8, tl.int64))
        tl.store(out + c * CHUNK + i, v, mask=(i < CHUNK) & (i * 0 + failed == 0))
        tl.store(log + c, ssl.clock_ns())
        tl.debug_barrier()  # every lane's read of the tile before the credit that frees it
        ssl.signal(sig, me, producer, 1, 1, ssl.ADD, NSLOTS)


def chunk_reference():
    """Chunk c holds c * 1000 + j + 1 (no chunk is zero, so a stale or missing tile shows)."""
    return (
        torch.arange(CHUNKS * CHUNK, dtype=torch.int64).view(CHUNKS, CHUNK) % CHUNK
        + 1
        + (torch.arange(CHUNKS, dtype=torch.int64) * 1000).view(CHUNKS, 1)
    )


def pipeline(modes=("full",), producer_delay_s=1.0, consumer_delay_s=0.3):
    buf = ss.SymmetricBuffer(RING * CHUNK * 8, backend="host")
    view = buf.view([0, 1])
    results = {}
    for mode in modes:
        sigs = ss.Signals(view, slots=2, timeout_s=60)
        buf.local_memory()[: RING * CHUNK * 8].zero_()
        dist.barrier()
        log = torch.zeros(CHUNKS, dtype=torch.int64)
        common = dict(CHUNKS=CHUNKS, RING=RING, CHUNK=CHUNK, **sigs.constexprs)
        if view.local_index == 0:
            src = chunk_reference().flatten()
            delay = int(producer_delay_s * 1e9)
            producer_kernel[(1,)](*sigs.kernel_args, src, log, 0, 1, delay, CREDITS=mode != "nocredit", **common)
            got = None
        else:
            out = torch.zeros(CHUNKS * CHUNK, dtype=torch.int64)
            sigs.signal(0, CREDIT, RING)  # every tile of the ring starts free
            delay = int(consumer_delay_s * 1e9)
            consumer_kernel[(1,)](*sigs.kernel_args, out, log, 0, 0, delay, WAIT=mode != "nowait", **common)
            got = out.view(CHUNKS, CHUNK)
        sigs.check()
        dist.barrier()
        results[mode] = {"log": log, "got": got, "values": sigs.values(), "consumed": sigs.consumed()}
        sigs.close()
    buf.close()
    return results


def _pipeline_verdict(results, mode):
    """(every chunk exact, consumer finished chunk 0 before the producer published chunk 7)."""
    prod, cons = results[0][mode], results[1][mode]
    exact = torch.equal(cons["got"], chunk_reference())
    in_order = int(cons["log"][0]) < int(prod["log"][CHUNKS - 1])
    return exact, in_order


@pytest.fixture(scope="module")
def pipelines(host_ranks):
    return host_ranks(pipeline, 2, ("full", "nowait", "nocredit"), timeout_s=RUN_S)


def test_the_pipelined_transfer_delivers_every_chunk_exactly_and_in_step(pipelines):
    exact, in_order = _pipeline_verdict(pipelines, "full")
    assert exact, pipelines[1]["full"]["got"]
    assert in_order, "the producer published chunk 7 before the consumer finished chunk 0: no credit held it"
    cons, prod = pipelines[1]["full"], pipelines[0]["full"]
    assert cons["values"][0, DATA] == CHUNKS and cons["consumed"][0, DATA] == CHUNKS
    assert prod["values"][1, CREDIT] == RING + CHUNKS and prod["consumed"][1, CREDIT] == CHUNKS


def test_the_pipeline_oracle_bites_without_the_wait(pipelines):
    exact, _ = _pipeline_verdict(pipelines, "nowait")
    assert not exact, "a consumer that does not wait read every chunk right: the oracle cannot see a missing wait"


def test_the_pipeline_oracle_bites_without_the_credit(pipelines):
    exact, in_order = _pipeline_verdict(pipelines, "nocredit")
    assert not in_order, "a producer that ignores credits still published chunk 7 late: the oracle cannot see it"


# ---------------------------------------------------------------------- comparisons
@triton.jit
def compare_kernel(sig, me, timeout_ns, record, out, SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):
    # slot 0 holds 5 (SET by the peer). Row 0: comparisons that hold; row 1: that do not.
    p = 1 - me
    tl.store(out + 0, ssl.wait_signal(sig, me, p, 0, 5, ssl.EQ, timeout_ns, record, SIZE, NSLOTS, TRAP))
    tl.store(out + 1, ssl.wait_signal(sig, me, p, 0, 4, ssl.NE, timeout_ns, record, SIZE, NSLOTS, TRAP))
    tl.store(out + 2, ssl.wait_signal(sig, me, p, 0, 5, ssl.GE, timeout_ns, record, SIZE, NSLOTS, TRAP))
    tl.store(out + 3, ssl.wait_signal(sig, me, p, 0, 4, ssl.GT, timeout_ns, record, SIZE, NSLOTS, TRAP))
    tl.store(out + 4, ssl.wait_signal(sig, me, p, 0, 5, ssl.LE, timeout_ns, record, SIZE, NSLOTS, TRAP))
    tl.store(out + 5, ssl.wait_signal(sig, me, p, 0, 6, ssl.LT, timeout_ns, record, SIZE, NSLOTS, TRAP))
    tl.store(out + 6, ssl.wait_signal(sig, me, p, 0, 4, ssl.EQ, timeout_ns, record, SIZE, NSLOTS, TRAP))
    tl.store(out + 7, ssl.wait_signal(sig, me, p, 0, 5, ssl.NE, timeout_ns, record, SIZE, NSLOTS, TRAP))
    tl.store(out + 8, ssl.wait_signal(sig, me, p, 0, 6, ssl.GE, timeout_ns, record, SIZE, NSLOTS, TRAP))
    tl.store(out + 9, ssl.wait_signal(sig, me, p, 0, 5, ssl.GT, timeout_ns, record, SIZE, NSLOTS, TRAP))
    tl.store(out + 10, ssl.wait_signal(sig, me, p, 0, 4, ssl.LE, timeout_ns, record, SIZE, NSLOTS, TRAP))
    tl.store(out + 11, ssl.wait_signal(sig, me, p, 0, 5, ssl.LT, timeout_ns, record, SIZE, NSLOTS, TRAP))
    tl.store(out + 12, ssl.read_signal(sig, me, p, 0, NSLOTS))


def comparisons():
    buf = ss.SymmetricBuffer(1024, backend="host")
    sigs = ss.Signals(buf.view([0, 1]), slots=1, timeout_s=0.2)
    sigs.signal(1 - buf.rank, 0, 7, op="set")
    sigs.signal(1 - buf.rank, 0, 5, op="set")  # the last store wins: the slot holds 5
    dist.barrier()
    out = torch.full((13,), -1, dtype=torch.int64)
    compare_kernel[(1,)](*sigs.kernel_args, out, **sigs.constexprs)  # its status words are the result
    dist.barrier()  # a member that closed first would end the other's waits with its abort (status 2)
    buf.close()
    return out.tolist()


def test_each_comparison_operator_passes_when_it_holds_and_times_out_when_it_does_not(host_ranks):
    for out in host_ranks(comparisons, 2, timeout_s=RUN_S):
        assert out[:6] == [0] * 6, f"EQ 5, NE 4, GE 5, GT 4, LE 5, LT 6 on a slot holding 5: {out[:6]}"
        assert out[6:12] == [1] * 6, f"EQ 4, NE 5, GE 6, GT 5, LE 4, LT 5 must time out: {out[6:12]}"
        assert out[12] == 5


# ---------------------------------------------------------------------- failures
def timeouts(budget_s):
    buf = ss.SymmetricBuffer(1024, backend="host")
    view = buf.view([0, 1])
    sigs = ss.Signals(view, slots=3, timeout_s=budget_s)
    out = {}
    if buf.rank == 0:
        sigs.signal(1, 1, 2, op="set")
        sigs.signal(1, 2, 4)  # two counted signals' worth
    dist.barrier()
    if buf.rank == 1:
        t0 = time.monotonic()
        try:
            sigs.wait(0, 1, 3, "GE")
        except ss.SignalTimeout as e:
            out["absolute"] = _fields(e, time.monotonic() - t0)
        try:  # the failed object refuses more work (fails closed), and aborts the view
            sigs.wait_count(0, 2, 1)
        except ss.SignalTimeout as e:
            out["refused"] = type(e).__name__
    dist.barrier()
    # A failed wait gave up on the view, as a failed fence does: a fresh view for the rest.
    sigs2 = ss.Signals(buf.view([0, 1]), slots=3, timeout_s=budget_s)
    if buf.rank == 0:
        sigs2.signal(1, 2, 4)
    dist.barrier()
    if buf.rank == 1:
        sigs2.wait_count(0, 2, 3)  # 3 of the 4 consumed
        try:
            sigs2.wait_count(0, 2, 2)  # 1 left, 2 asked
        except ss.SignalTimeout as e:
            out["counted"] = _fields(e, 0.0)
    dist.barrier()
    buf.close()
    return out


def _fields(e, elapsed):
    return {
        "type": type(e).__name__,
        "msg": str(e),
        "rank": e.rank,
        "peer": e.peer,
        "slot": e.slot,
        "cmp": e.cmp,
        "expected": e.expected,
        "observed": e.observed,
        "base": e.base,
        "counted": e.counted,
        "late": e.late,
        "is_fence_timeout": isinstance(e, ss.FenceTimeout),
        "elapsed": elapsed,
    }


def test_a_signal_timeout_names_the_peer_slot_expected_and_observed_values_within_the_budget(host_ranks):
    budget = 0.5
    out = host_ranks(timeouts, 2, budget, timeout_s=RUN_S)[1]
    a = out["absolute"]
    assert a["type"] == "SignalTimeout" and a["is_fence_timeout"]
    assert (a["rank"], a["peer"], a["slot"], a["cmp"], a["expected"], a["observed"]) == (1, 0, 1, "GE", 3, 2)
    assert a["late"] == {0: 2}
    for text in ("rank 1", "rank 0's slot 1 >= 3", "holds 2", f"{budget:g} s"):
        assert text in a["msg"], (text, a["msg"])
    assert budget <= a["elapsed"] < budget + 60, a["elapsed"]  # it waited the budget out, then gave up
    assert out["refused"] == "SignalTimeout"  # fails closed: the object raises its error again
    c = out["counted"]
    assert (c["counted"], c["expected"], c["base"], c["observed"], c["slot"]) == (True, 2, 3, 4, 2)
    assert "2 more signal(s) from rank 0 on slot 2" in c["msg"] and "3 consumed before" in c["msg"], c["msg"]


@triton.jit
def wait_long_kernel(sig, me, timeout_ns, record, out, SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):
    tl.store(out, ssl.wait_signal(sig, me, 0, 0, 1, ssl.GE, timeout_ns, record, SIZE, NSLOTS, TRAP))


def abort_ends_wait(budget_s):
    buf = ss.SymmetricBuffer(1024, backend="host")
    view = buf.view([0, 1, 2])
    sigs = ss.Signals(view, slots=1, timeout_s=budget_s)
    dist.barrier()
    out = {}
    if buf.rank == 0:
        # This sleep stays: ranks 1 and 2 wait inside a kernel that publishes nothing, so no host
        # check can see that their wait has begun. The test does not rest on it: an abort that
        # lands before their wait begins ends it at its first poll just the same (status 2, the
        # same error, at once); the sleep only makes the case named, an abort during the wait,
        # the likely one.
        time.sleep(0.5)
        out["at"] = time.monotonic()
        view.abort("planted abort")
        try:
            _ = sigs.kernel_args
        except ss.PeerAborted as e:
            out["refused"] = str(e)
    else:  # ranks 1 and 2 wait on rank 0's slot, which it never signals
        status = torch.full((1,), -1, dtype=torch.int64)
        wait_long_kernel[(1,)](*sigs.kernel_args, status, **sigs.constexprs)
        out["at"] = time.monotonic()
        out["status"] = int(status)
        try:
            sigs.check()
        except ss.SignalAborted as e:
            out["err"] = {"type": type(e).__name__, "aborted": e.aborted, "msg": str(e), "peer": e.peer}
            out["is_peer_aborted"] = isinstance(e, ss.PeerAborted)
    dist.barrier()
    buf.close()
    return out


def test_a_members_abort_ends_a_signal_wait_at_once_naming_it(host_ranks):
    budget = 120.0
    out = host_ranks(abort_ends_wait, 3, budget, timeout_s=RUN_S)
    assert "refused" in out[0] and "aborted the view" in out[0]["refused"]
    for r in (1, 2):
        o = out[r]
        assert o["status"] == 2, o
        assert o["is_peer_aborted"] and o["err"]["aborted"] == {0: "planted abort"}, o
        assert "rank 0 aborted: planted abort" in o["err"]["msg"], o["err"]["msg"]
        ended = o["at"] - out[0]["at"]
        assert ended < budget / 4, f"the wait ended {ended:.1f} s after the abort: the budget ran out, not the abort"


# ---------------------------------------------------------------------- replays
@triton.jit
def rounds_kernel(
    sig,
    me,
    timeout_ns,
    record,
    wrong,
    start,
    ROUNDS: tl.constexpr,
    SIZE: tl.constexpr,
    NSLOTS: tl.constexpr,
    TRAP: tl.constexpr,
):
    # Ping-pong with the peer: round r puts r into the peer's word r % 2 and signals; then
    # waits for the peer's round r and checks its word. The same arguments on every launch:
    # only the device-resident bases tell one launch from the next.
    p = 1 - me
    i = tl.arange(0, 2)
    for k in range(ROUNDS):
        r = start + k
        ssl.put_signal(sig, me, p, (r % 2) * 8 + i * 0, r + i * 0, i == 0, 0, NSLOTS)
        ok = ssl.wait_count(sig, me, p, 0, 1, timeout_ns, record, SIZE, NSLOTS, TRAP) == 0
        got = tl.load(ssl.data_ptr(sig, me, (r % 2) * 8, tl.int64))
        tl.atomic_add(wrong, ((got != r) | (ok == 0)).to(tl.int64))


def many_rounds(launches, rounds):
    buf = ss.SymmetricBuffer(1024, backend="host")
    sigs = ss.Signals(buf.view([0, 1]), slots=1, timeout_s=60)
    wrong = torch.zeros(1, dtype=torch.int64)
    for n in range(launches):
        rounds_kernel[(1,)](*sigs.kernel_args, wrong, n * rounds, ROUNDS=rounds, **sigs.constexprs)
        sigs.check()
    dist.barrier()
    r = {"wrong": int(wrong), "values": sigs.values().tolist(), "consumed": sigs.consumed().tolist()}
    buf.close()
    return r


def test_a_thousand_signal_and_wait_rounds_stay_in_step_without_a_reset(host_ranks):
    launches, rounds = 50, 20
    for me, r in enumerate(host_ranks(many_rounds, 2, launches, rounds, timeout_s=RUN_S)):
        assert r["wrong"] == 0
        assert r["values"][1 - me] == [launches * rounds] and r["consumed"][1 - me] == [launches * rounds], r


# ---------------------------------------------------------------------- peer atomics
ADDS = 2000


@triton.jit
def atomics_kernel(ptrs, me, n, SIZE: tl.constexpr):
    # Words in member 0's memory: 0 counts adds, 1 holds the max, 2 counts CAS increments,
    # 3 counts exchanges' old values, 4 and 5 and/or bits.
    total = ssl.peer_ptr(ptrs, 0, 0, tl.int64)
    for _ in range(n):
        tl.atomic_add(total, 1, sem="relaxed", scope="sys")
    tl.atomic_max(total + 1, me * 100 + 7, sem="acq_rel", scope="sys")
    for _ in range(100):
        old = tl.atomic_add(total + 2, 0, sem="acquire", scope="sys")
        won = (tl.atomic_cas(total + 2, old, old + 1, sem="acq_rel", scope="sys") == old).to(tl.int32)
        while won == 0:
            old = tl.atomic_add(total + 2, 0, sem="acquire", scope="sys")
            won = (tl.atomic_cas(total + 2, old, old + 1, sem="acq_rel", scope="sys") == old).to(tl.int32)
    tl.atomic_xchg(total + 3, me + 1, sem="acq_rel", scope="sys")
    tl.atomic_or(total + 4, 1 << me, sem="relaxed", scope="sys")
    tl.atomic_and(total + 5, ~(1 << me), sem="relaxed", scope="sys")


def atomics():
    buf = ss.SymmetricBuffer(1024, backend="host")
    view = buf.view([0, 1, 2])
    if buf.rank == 0:
        buf.tensor(0, (6,), torch.int64)[5] = -1  # word 5: and-ed down from all ones
    dist.barrier()
    atomics_kernel[(1,)](view.ptrs, view.local_index, ADDS, SIZE=view.size)
    dist.barrier()
    words = buf.tensor(0, (6,), torch.int64, rank=0).tolist()
    buf.close()
    return words


def test_peer_atomics_on_the_host_backend_are_exact_across_three_ranks(host_ranks):
    for words in host_ranks(atomics, 3, timeout_s=RUN_S):
        assert words[0] == 3 * ADDS, words
        assert words[1] == 207 and words[2] == 300, words
        assert words[3] in (1, 2, 3) and words[4] == 0b111 and words[5] == -1 & ~0b111, words


# ---------------------------------------------------------------------- grid-wide wait
@triton.jit
def sync_read_kernel(data, ptrs, cell, me, timeout_ns, record, out, epoch, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    half = (epoch % 2) * SIZE * BLOCK  # double-buffered: a fast member writes the next round's half
    for p in tl.static_range(SIZE):  # this member's part of every member's payload
        tl.store(ssl.peer_ptr(data, p, 0, tl.int64) + half + me * BLOCK + i, epoch * 100 + me)
    status = ssl.grid_sync(ptrs, cell, me, timeout_ns, record, SIZE, False)
    for p in tl.static_range(SIZE):  # and every member's part, read in the same launch
        got = tl.load(ssl.peer_ptr(data, me, 0, tl.int64) + half + p * BLOCK + i)
        tl.store(out + p * BLOCK + i, tl.where(status == 0, got, -1))


def _own_cause(e):
    while e is not None and not isinstance(e, ss.SymmSyncError):
        e = e.__cause__
    return e


def grid_wide(rounds):
    buf = ss.SymmetricBuffer(4096, backend="host")
    view = buf.view([0, 1])
    fence = ss.Fence(view, timeout_s=60)
    wrong = 0
    for e in range(1, rounds + 1):
        out = torch.zeros(2 * 16, dtype=torch.int64)
        ss.launch_grid_sync(sync_read_kernel, (1,), view.ptrs, *fence.kernel_args, out, e, SIZE=2, BLOCK=16)
        fence.check()
        want = torch.tensor([e * 100 + p for p in range(2)]).repeat_interleave(16)
        wrong += int((out != want).sum())
    res = {"wrong": wrong, "epoch": fence.epoch}
    try:
        ss.launch_grid_sync(sync_read_kernel, (2,), view.ptrs, *fence.kernel_args, out, 0, SIZE=2, BLOCK=16)
    except ss.ConfigError as e:
        res["refused"] = str(e)
    try:  # launched without the helper: the primitive refuses too, before waiting
        sync_read_kernel[(2,)](view.ptrs, *fence.kernel_args, out, 0, SIZE=2, BLOCK=16)
    except Exception as e:  # noqa: BLE001 - the interpreter wraps it: the cause is symmsync's
        res["direct"] = type(_own_cause(e)).__name__
    buf.close()
    return res


def test_the_grid_wide_wait_reads_every_members_data_in_the_same_launch_and_refuses_what_cannot_be_co_resident(
    host_ranks,
):
    for r in host_ranks(grid_wide, 2, 5, timeout_s=RUN_S):
        assert r["wrong"] == 0 and r["epoch"] == 5, r
        assert "2 programs on the host backend" in r["refused"], r["refused"]
        assert r["direct"] == "ConfigError", r


# ---------------------------------------------------------------------- publish_and_wait from a kernel
@triton.jit
def stamp_and_fence_kernel(data, ptrs, cell, me, timeout_ns, record, out, step, SIZE: tl.constexpr):
    for p in tl.static_range(SIZE):
        tl.store(ssl.peer_ptr(data, p, 0, tl.int64) + (step % 2) * SIZE + me, step * 10 + me)
    tl.debug_barrier()
    status = ssl.publish_and_wait(ptrs, cell, me, timeout_ns, SIZE)
    for p in tl.static_range(SIZE):
        got = tl.load(ssl.peer_ptr(data, me, 0, tl.int64) + (step % 2) * SIZE + p)
        tl.store(out + p, tl.where(status == 0, got, -1))


def publish_and_wait_from_a_kernel(steps):
    buf = ss.SymmetricBuffer(1024, backend="host")
    view = buf.view([0, 1])
    fence = ss.Fence(view, timeout_s=60)
    wrong = 0
    for step in range(1, steps + 1):
        if step % 3 == view.local_index:
            time.sleep(0.05)  # one member late now and then
        out = torch.zeros(2, dtype=torch.int64)
        stamp_and_fence_kernel[(1,)](view.ptrs, *fence.kernel_args, out, step, SIZE=2)
        fence.check()
        wrong += int((out != torch.tensor([step * 10, step * 10 + 1])).sum())
    r = (wrong, fence.epoch)
    buf.close()
    return r


def test_publish_and_wait_called_from_a_user_kernel_delivers_the_payload(host_ranks):
    assert host_ranks(publish_and_wait_from_a_kernel, 2, 12, timeout_s=RUN_S) == [(0, 12), (0, 12)]


# ---------------------------------------------------------------------- made during capture
def made_while_capturing():
    from symmsync import backends

    buf = ss.SymmetricBuffer(1024, backend="host")
    view = buf.view([0, 1])
    if buf.rank == 1:  # what a capture on this rank's current stream reads
        backends.capturing = lambda device: True
    try:
        ss.Signals(view)
    except ss.CaptureError as e:
        return str(e)
    finally:
        buf.close()
    return None


def test_signals_made_during_graph_capture_raise_on_every_rank_saying_create_it_before():
    for msg in run(made_while_capturing, 2, backend="host", timeout_s=RUN_S):
        assert msg and "Signals" in msg and "rank 1" in msg and "before capture" in msg, msg
