"""Reliability under faults on the host backend: processes that die or close, and a soak.

* a rank killed in the middle of a run of fences: every other rank raises
  ``PeerAborted`` naming it and that it died within a second or so, well within the fence's
  budget (the liveness watch, core/liveness.py), and ``/dev/shm`` is clean;
  a rank killed while the buffer is being built: the others raise ``BackendError``;
* a rank that exits before ``close()``: while its process lives on (it returned), the others
  time out (it never arrived); once it has ended (``os._exit``), they raise ``PeerAborted``
  naming it at once; and one
  that closes while the others fence (they raise ``PeerAborted`` saying "closed" at once);
* 500 fences at world 4 with seeded random delays between payload writes and
  fences, checked by the payload oracle (10 000 in the soak, ``make test-soak``), and the
  same run without the wait, which the oracle must catch;
(Bad input, fuzzed: tests/core/test_fuzz.py, and the writer's: tests/pcp/test_pcp_fuzz.py.)

Ranks that kill themselves are named in ``testing.run(..., may_die=...)``, so the
survivors run on and report.
"""

import glob
import os
import random
import re
import secrets
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync.testing import Died, run

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux's /dev/shm view of POSIX shm")


def _segments(prefix: str) -> list[str]:
    return sorted(glob.glob(f"/dev/shm/{prefix}-*"))


def _wait_for_segments(prefix: str, want, budget_s: float = 10.0) -> list[str]:
    """/dev/shm's segments of ``prefix`` once they match ``want`` (a predicate), or at the deadline."""
    deadline = time.monotonic() + budget_s
    left = _segments(prefix)
    while not want(left) and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _segments(prefix)
    return left


def _fenced_payload(budget):
    """A host buffer, the world view, a fence of ``budget`` s, this rank's index and the payload
    (``[2, size]`` int64 per member, double-buffered by epoch parity) as tensors over every member."""
    buf = ss.SymmetricBuffer(4096, backend="host")
    view = buf.view(list(range(buf.world_size)))
    fence = ss.Fence(view, timeout_s=budget)
    peers = [view.tensor(0, (2, view.size), torch.int64, index=p) for p in range(view.size)]
    return buf, view, fence, view.local_index, peers


def _stamp_all(peers, me, e):
    # The payload oracle, written with torch through the mapped peer tensors:
    # slot [e % 2][me] of every member holds 1000 e + me.
    for p in peers:
        p[e % 2, me] = 1000 * e + me


def _wrong(mine, e):
    want = torch.arange(mine.shape[1], dtype=torch.int64) + 1000 * e
    return int((mine[e % 2] != want).sum())


# ---------------------------------------------------------------------- a rank killed mid-run
def killed_mid_run(victim, kill_at, n, budget):
    prefix = os.environ["SYMMSYNC_SHM_PREFIX"]
    buf, view, fence, me, peers = _fenced_payload(budget)
    started = time.monotonic()  # after start-up and the buffer: the clock every process shares
    wrong = 0
    for e in range(1, n + 1):
        if buf.rank == victim and e == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        _stamp_all(peers, me, e)
        t0 = time.monotonic()
        try:
            fence.fence()
        except ss.FenceTimeout as err:
            elapsed = time.monotonic() - t0
            # The dead rank's memory stays mapped here: reading it must not crash, and it
            # holds what the dead rank wrote last (its stamp of epoch kill_at - 1).
            dead = buf.tensor(0, (2, view.size), torch.int64, rank=victim)[(e - 1) % 2, victim].item()
            left = _segments(prefix)
            buf.close()
            return {
                "started": started,
                "epoch": e,
                "elapsed": elapsed,
                "late": err.late,
                "type": type(err).__name__,
                "aborted": getattr(err, "aborted", None),
                "err_epoch": err.epoch,
                "msg": str(err),
                "wrong": wrong,
                "dead": dead,
                "left": left,
            }
        wrong += _wrong(peers[me], e)
    return "no timeout"


def test_a_rank_killed_mid_run_makes_every_other_rank_raise_naming_it_at_once():
    seed = secrets.randbits(32)
    world, victim, n, budget = 4, 2, 30, 20.0
    kill_at = random.Random(seed).randint(2, n - 1)
    results = run(killed_mid_run, world, victim, kill_at, n, budget, timeout_s=120, may_die=[victim])
    ctx = f"seed={seed} kill_at={kill_at}"
    assert results[victim] == Died(victim, -signal.SIGKILL), ctx
    for rank, r in enumerate(results):
        if rank == victim:
            continue
        assert isinstance(r, dict), (ctx, r)
        assert r["epoch"] == kill_at, (ctx, r)
        assert r["type"] == "PeerAborted", (ctx, r)
        assert list(r["aborted"]) == [victim] and "died" in r["aborted"][victim], (ctx, r)
        assert f"rank {victim}" in r["msg"] and "died" in r["msg"], (ctx, r["msg"])
        assert r["elapsed"] < 5, (ctx, r["elapsed"])  # not the 20 s budget
        assert r["wrong"] == 0 and r["dead"] == 1000 * (kill_at - 1) + victim, (ctx, r)
        assert r["left"] == [], (ctx, r["left"])
    # Measured from the last survivor's start (after process start-up and the buffer, which
    # take most of the time on 2 cores): the fences, one budget and the clean-up.
    after_start_up = time.monotonic() - max(r["started"] for r in results if isinstance(r, dict))
    assert after_start_up < 60, (ctx, after_start_up)


# ---------------------------------------------------------------------- killed while the buffer is built
def killed_while_building(victim, stage):
    from symmsync.backends import host

    prefix = os.environ["SYMMSYNC_SHM_PREFIX"]
    if dist.get_rank() == victim:
        # Die after allocating: before sending the segment's name, or while mapping the peers.
        commit = host.HostBackend.commit

        def die(*args, **kwargs):
            if stage == "before_exchange":
                commit(*args, **kwargs)  # the segment exists, linked; only this rank knows its name
            os.kill(os.getpid(), signal.SIGKILL)

        setattr(host.HostBackend, {"before_exchange": "commit", "while_mapping": "map_chunk"}[stage], die)
    t0 = time.monotonic()
    try:
        ss.SymmetricBuffer(1 << 14, backend="host")
    except ss.SymmSyncError as e:
        elapsed = time.monotonic() - t0
        mine = f"/dev/shm/{prefix}-{dist.get_rank()}-"
        left = _wait_for_segments(prefix, lambda ls: not any(s.startswith(mine) for s in ls) and len(ls) <= 1)
        return type(e).__name__, str(e), elapsed, left
    return "built"


@pytest.mark.parametrize("stage", ["before_exchange", "while_mapping"])
def test_a_rank_killed_while_the_buffer_is_built(stage):
    """Every other rank raises BackendError at once. What stays in /dev/shm: nothing once
    the names were exchanged (the survivors unlink a dead peer's name); before that only
    the dead rank knew its name, and its segment stays until ``testing.run`` (or whoever
    owns the job's SYMMSYNC_SHM_PREFIX) removes it."""
    prefix = f"symmsync-faults{secrets.token_hex(4)}"
    victim = 1
    results = run(
        killed_while_building,
        3,
        victim,
        stage,
        timeout_s=120,
        may_die=[victim],
        env={"SYMMSYNC_SHM_PREFIX": prefix},
    )
    assert results[victim] == Died(victim, -signal.SIGKILL)
    for rank in (0, 2):
        kind, msg, elapsed, left = results[rank]
        assert kind == "BackendError", msg
        assert f"rank {rank}:" in msg and "died" in msg, msg
        assert elapsed < 30
        if stage == "while_mapping":
            assert left == [], left
        else:
            assert len(left) == 1 and left[0].startswith(f"/dev/shm/{prefix}-{victim}-"), left
    assert _segments(prefix) == []  # testing.run removed the dead rank's leftover


# ---------------------------------------------------------------------- exit before close()
def exits_before_close(leaver, at, how, budget):
    prefix = os.environ["SYMMSYNC_SHM_PREFIX"]
    buf, view, fence, me, peers = _fenced_payload(budget)
    for e in range(1, at + 1):
        _stamp_all(peers, me, e)
        fence.fence()
    if buf.rank == leaver:
        if how == "os._exit":
            os._exit(0)  # no close(), no finalizer, no atexit
        return "left"  # no close(): the process ends with the buffer still open
    t0 = time.monotonic()
    try:
        fence.fence()
    except ss.FenceTimeout as err:
        elapsed = time.monotonic() - t0
        last = buf.tensor(0, (2, view.size), torch.int64, rank=leaver)[at % 2, leaver].item()
        left = _segments(prefix)
        buf.close()
        return {
            "late": err.late,
            "type": type(err).__name__,
            "aborted": getattr(err, "aborted", None),
            "elapsed": elapsed,
            "last": last,
            "left": left,
        }
    return "no timeout"


@pytest.mark.parametrize("how", ["return", "os._exit"])
def test_a_rank_that_exits_before_close_leaves_nothing_and_hangs_nobody(how):
    world, leaver, at, budget = 3, 0, 5, 2.0
    results = run(exits_before_close, world, leaver, at, how, budget, timeout_s=120, may_die=[leaver])
    assert results[leaver] == ("left" if how == "return" else Died(leaver, 0))
    for rank in (1, 2):
        r = results[rank]
        assert isinstance(r, dict), r
        if how == "os._exit" or r["type"] == "PeerAborted":  # its process ended: named when it did
            bound = budget if how == "os._exit" else budget + 5  # (one that returned ends a little later)
            assert r["type"] == "PeerAborted" and r["elapsed"] < bound, r
            assert list(r["aborted"]) == [leaver] and "died" in r["aborted"][leaver], r
        else:  # its process lives on (it returned): it never arrived
            assert r["late"] == {leaver: at} and budget <= r["elapsed"] < budget + 5, r
        assert r["last"] == 1000 * at + leaver and r["left"] == [], r


# ---------------------------------------------------------------------- close() while the others fence
def closes_while_others_fence(closer, at, budget):
    buf, view, fence, me, peers = _fenced_payload(budget)
    for e in range(1, at + 1):
        _stamp_all(peers, me, e)
        fence.fence()
    if buf.rank == closer:
        buf.close()
        closed_at = time.time()
        out = {"closed_at": closed_at}
        for name, call in {
            "fence": fence.fence,
            "arrive": fence.arrive,
            "epoch": lambda: fence.epoch,
            "tensor": lambda: buf.tensor(0, (1,), torch.int64),
        }.items():
            try:
                call()
                out[name] = "no error"
            except ss.SymmSyncError as e:
                out[name] = (type(e).__name__, str(e))
        dist.barrier()  # closed: now the peers read this rank's memory ...
        dist.barrier()  # ... while it is still alive
        return out
    t0 = time.monotonic()
    try:
        fence.fence()
    except ss.FenceTimeout as err:
        elapsed = time.monotonic() - t0
        dist.barrier()  # the closer's close() has returned
        read_at = time.time()
        # The closer unmapped its own memory; this rank's mapping of it stays valid.
        seen = buf.tensor(0, (2, view.size), torch.int64, rank=closer).clone()
        mark = buf.tensor(256 + 16 * buf.rank, (1,), torch.int64, rank=closer)  # and writable
        mark.fill_(-1 - buf.rank)
        again = buf.tensor(256 + 16 * buf.rank, (1,), torch.int64, rank=closer).item()
        buf.close()
        dist.barrier()
        return {
            "type": type(err).__name__,
            "late": err.late,
            "aborted": err.aborted,
            "msg": str(err),
            "elapsed": elapsed,
            "read_at": read_at,
            "seen": seen[at % 2].tolist(),
            "again": again,
        }
    dist.barrier()
    dist.barrier()
    return "no timeout"


def test_close_while_others_fence_fails_them_at_once_saying_closed_and_crashes_nobody(host_ranks):
    world, closer, at, budget = 3, 1, 4, 60.0  # a missed abort would show as a minute
    results = host_ranks(closes_while_others_fence, world, closer, at, budget, timeout_s=120)
    c = results[closer]
    for name in ("fence", "arrive", "epoch", "tensor"):
        assert c[name][0] == "ClosedError" and f"rank {closer}" in c[name][1], (name, c[name])
    for rank in (0, 2):
        r = results[rank]
        assert isinstance(r, dict), r
        assert r["type"] == "PeerAborted" and r["elapsed"] < 1.0, r
        assert r["aborted"] == {closer: "closed"}, r
        assert set(r["late"]) <= {0, 2} - {rank}, r  # the other survivor may be on its way; the closer never

        assert f"rank {closer} closed its buffer (its slot holds epoch {at})" in r["msg"], r["msg"]
        assert r["read_at"] > c["closed_at"]
        assert r["seen"] == [1000 * at + m for m in range(world)] and r["again"] == -1 - rank, r


# ---------------------------------------------------------------------- testing.run(may_die=...)
def _dead(pid):
    """The process ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def dies_or_returns(code, handshake):
    rank = dist.get_rank()
    if rank == 1:
        Path(handshake + ".tmp").write_text(str(os.getpid()))
        os.replace(handshake + ".tmp", handshake)  # whole: rank 0 never reads half a pid
        os._exit(code)
    if rank == 2:
        return "returned anyway"
    # The handshake: rank 0 is still running when rank 1 has died (the run goes on).
    deadline = time.monotonic() + 60
    while not (os.path.exists(handshake) and _dead(int(Path(handshake).read_text()))):
        assert time.monotonic() < deadline, "rank 1 never died"
        time.sleep(0.01)
    return f"rank {rank} done"


def raises_on_rank_1():
    if dist.get_rank() == 1:  # when it raised, after start-up: the test measures from there
        raise ValueError(f"planted failure on a rank that may die at {time.monotonic()!r}")
    time.sleep(60)


def test_may_die_lets_the_others_finish_and_still_fails_on_anything_else(tmp_path):
    results = run(dies_or_returns, 3, 5, str(tmp_path / "rank1_pid"), may_die=[1, 2], timeout_s=90)
    assert results == ["rank 0 done", Died(1, 5), "returned anyway"]
    with pytest.raises(ss.RankFailure, match="planted failure on a rank that may die") as e:
        run(raises_on_rank_1, 2, may_die=[1], timeout_s=90)
    raised_at = float(re.search(r"may die at ([0-9.]+)", str(e.value)).group(1))
    assert time.monotonic() - raised_at < 45  # not the 60 s rank 0 sleeps
    with pytest.raises(ss.ConfigError, match="may_die"):
        run(dies_or_returns, 2, 0, "", may_die=[2])


# ---------------------------------------------------------------------- 10 000 fences with random delays
SOAK_FENCES = 10_000


def soak(n, seed, wait=True):
    """``n`` real fences with the payload oracle, written with torch through the mapped peer
    tensors (the interpreted stamp kernel would double the run time); seeded random delays
    before the payload writes and between them and the fence. ``wait=False``: arrive only."""
    buf, view, fence, me, peers = _fenced_payload(60)
    rng = random.Random(seed * 1009 + buf.rank)
    wrong = delays = 0
    t0 = time.monotonic()
    for e in range(1, n + 1):
        if rng.random() < 0.02:
            time.sleep(rng.uniform(0, 0.004))
            delays += 1
        _stamp_all(peers, me, e)
        if rng.random() < 0.02:
            time.sleep(rng.uniform(0, 0.004))
            delays += 1
        if wait:
            fence.fence()
        else:
            fence.arrive()
        wrong += _wrong(peers[me], e)
    elapsed = time.monotonic() - t0
    epoch = fence.epoch
    dist.barrier()
    buf.close()
    return {"wrong": wrong, "epoch": epoch, "delays": delays, "elapsed": elapsed}


@pytest.mark.parametrize("n", [500, pytest.param(SOAK_FENCES, marks=pytest.mark.soak)])
def test_fences_with_random_delays_read_no_stale_payload(host_ranks, n):
    """500 fences in every run; the 10 000 of the soak (``make test-soak``) check the same oracle longer."""
    seed = secrets.randbits(32)
    t0 = time.monotonic()
    results = host_ranks(soak, 4, n, seed, timeout_s=590)
    wall = time.monotonic() - t0
    print(f"soak: {n} fences x 4 ranks in {wall:.1f} s (seed {seed}): {results}")
    for rank, r in enumerate(results):
        assert r["epoch"] == n, (seed, rank, r)
        assert r["wrong"] == 0, f"seed {seed}: rank {rank} read {r['wrong']} stale payload slots"
        assert r["delays"] > 0, (seed, rank, r)


def test_the_soak_oracle_bites_without_the_wait(host_ranks):
    seed = secrets.randbits(32)
    results = host_ranks(soak, 4, 200, seed, False, timeout_s=120)
    assert sum(r["wrong"] for r in results) > 0, f"seed {seed}: {results}"
