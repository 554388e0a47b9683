"""The all-or-nothing collective (symmsync.core.agreement.Transaction), alone and under every
way a buffer maps memory.

Oracles: the error each rank raised (the same on every rank, naming the rank that
failed), the order in which each rank's undo actions ran (written down by the actions
themselves), and what the process still has mapped: its mapping table
(``/proc/self/maps``) and the job's segments in ``/dev/shm``.
"""

import glob
import os

import pytest
import torch.distributed as dist

import symmsync as ss
from symmsync.core.agreement import Transaction
from symmsync.testing import run
from symmsync.tools.runtime_alloc import HostCacheAllocator

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux's /dev/shm and /proc/self/maps")

STEPS = 3


def transaction_with_a_planted_failure(failing_step, failing_rank):
    me = dist.get_rank()
    undone = []
    seen = []
    try:
        with Transaction(dist.group.WORLD, "Planted.call", kept="nothing is left") as tx:
            for k in range(STEPS):

                def local(k=k):
                    if (k, me) == (failing_step, failing_rank):
                        raise OSError("planted failure")
                    tx.on_failure(lambda k=k: undone.append(("step", k)))
                    return 10 * k + me

                got = tx.step(f"do step {k} on", local, undo=lambda values, k=k: undone.append(("values", k, values)))
                seen.append(got)
        return None, undone, seen
    except ss.BackendError as e:
        return str(e), undone, seen


@pytest.mark.parametrize("failing_step", range(STEPS))
def test_a_step_that_fails_on_one_rank_raises_everywhere_and_each_rank_undoes_in_reverse(failing_step):
    failing_rank, world = 2, 3
    results = run(transaction_with_a_planted_failure, world, failing_step, failing_rank)
    want_msg = f"Planted.call: could not do step {failing_step} on rank 2: OSError: planted failure; nothing is left"
    for rank, (msg, undone, seen) in enumerate(results):
        assert msg == want_msg, (rank, msg)
        # every step before the failing one exchanged every rank's value
        assert seen == [[10 * k + r for r in range(world)] for k in range(failing_step)], (rank, seen)
        want = []
        for k in range(failing_step + 1):  # in the order registered; they ran the latest first
            if k < failing_step or rank != failing_rank:
                want.append(("step", k))
            values = [10 * k + r for r in range(world)]
            if k == failing_step:
                values[failing_rank] = None
            want.append(("values", k, values))
        assert undone == list(reversed(want)), (rank, undone)


def transaction_that_succeeds():
    undone = []
    with Transaction(dist.group.WORLD, "Planted.call", kept="nothing is left") as tx:
        got = tx.step("do it on", dist.get_rank)
        tx.on_failure(lambda: undone.append("undone"))
    return got, undone


def test_a_transaction_that_succeeds_everywhere_returns_every_value_and_undoes_nothing(host_ranks):
    for got, undone in host_ranks(transaction_that_succeeds, 3):
        assert got == [0, 1, 2] and undone == []


# ---------------------------------------------------------------------- every step of a buffer
#: (how the buffer is made, the host backend's method that fails on one rank, the call named)
CASES = [
    ("allocated", "reserve", "SymmetricBuffer: could not reserve address space on rank 1"),
    ("allocated", "commit", "SymmetricBuffer: could not commit memory on rank 1"),
    ("allocated", "map_chunk", "SymmetricBuffer: could not map on rank 1"),
    ("growable", "reserve", "SymmetricBuffer: could not reserve address space on rank 1"),
    ("growable", "commit", "SymmetricBuffer: could not commit memory on rank 1"),
    ("growable", "map_chunk", "SymmetricBuffer: could not map on rank 1"),
    ("registered", "reserve", "SymmetricBuffer.register: could not reserve address space on rank 1"),
    ("registered", "export_local", "SymmetricBuffer.register: could not share the registered memory of rank 1"),
    ("registered", "import_local", "SymmetricBuffer.register: could not map the registered memory of rank 1"),
    ("adopted", "commit", "SymmetricBuffer.from_peer_addresses: could not commit memory on rank 1"),
]


def _mapped() -> tuple[int, list[str]]:
    with open("/proc/self/maps") as f:
        lines = len(f.readlines())
    return lines, sorted(glob.glob(f"/dev/shm/{os.environ['SYMMSYNC_SHM_PREFIX']}-*"))


def _make(how, rt):
    if how == "allocated":
        return ss.SymmetricBuffer(64 * 1024, backend="host")
    if how == "growable":
        return ss.SymmetricBuffer(64 * 1024, backend="host", max_nbytes=1 << 20)
    if how == "registered":
        return ss.SymmetricBuffer.register(rt.base, 64 * 1024, max_nbytes=1 << 20, device="cpu")
    return ss.SymmetricBuffer.from_peer_addresses([rt.base] * dist.get_world_size(), 64 * 1024, device="cpu")


def every_construction_step_fails_on_rank_1():
    from symmsync.backends import host

    rt = HostCacheAllocator(1 << 20, chunk=64 * 1024)
    rt.commit(1)
    for how in ("allocated", "growable", "registered", "adopted"):  # what the first of each maps for good
        _make(how, rt).close()
    dist.barrier()
    out = []
    for how, step, _ in CASES:
        real = getattr(host.HostBackend, step)

        def fail(*a, **k):
            raise OSError("planted failure")

        before = _mapped()
        if dist.get_rank() == 1:
            setattr(host.HostBackend, step, fail)
        try:
            _make(how, rt)
            msg = None
        except ss.BackendError as e:
            msg = str(e)
        finally:
            setattr(host.HostBackend, step, real)
        dist.barrier()  # every rank undid its part before any looks at /dev/shm
        out.append((msg, before, _mapped()))
        dist.barrier()
    rt.free()
    return out


def test_a_buffer_whose_construction_fails_at_any_step_on_one_rank_raises_everywhere_and_maps_nothing():
    for rank, out in enumerate(run(every_construction_step_fails_on_rank_1, 2, timeout_s=300)):
        for (how, step, want), (msg, before, after) in zip(CASES, out):
            ctx = (rank, how, step, msg)
            assert msg is not None and msg.startswith(want) and "planted failure" in msg, ctx
            assert after[0] <= before[0], ctx  # no mapping of the failed construction is left
            assert after[1] == before[1], ctx  # nor a segment name
            assert [n for n in after[1] if "-rt-" not in n] == [], ctx  # (the runtime's own objects aside)
