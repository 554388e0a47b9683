"""The signals' mechanisms bite: each one patched out in the rank processes, its oracle fails.

Two mechanisms, each shown by one test that runs the same two-rank exchange twice: as
shipped (the oracle holds) and with the mechanism replaced, in the rank processes, by a
variant built here from :mod:`symmsync.language`'s public primitives (the oracle fails). The
test kernels call the primitives through ``symmsync.language``'s attributes, which
Triton's interpreter resolves when the kernel runs, so a variant put in that module's
place before a launch is what the kernel calls; every rank puts the shipped one back
before it returns (the ranks are the ``host_ranks`` pool's, shared with later tests). One
rank is delayed (a spin in its kernel) so that the other is already waiting: the race the
mechanism closes is real, and no barrier stands between the exchange and its check.

* ``put_signal``'s block barrier (``tl.debug_barrier()`` between the tile's stores and the
  release). Under the interpreter a program is one Python thread that stores the whole
  tile (one numpy assignment) before its next statement, so deleting the barrier alone
  changes nothing on the host backend: no thread's store can land after the release. What
  the barrier rules out is exactly that, a store of the tile after the release (a lagging
  warp on a GPU); the variant issues it so: the release, a lag, then the stores.
* ``wait_count``'s device-resident counted base: the variant waits on the absolute count
  (``wait_signal(GE, count)``, no base), so a second round's wait returns on the first
  round's signal and reads a tile not yet written.
"""

import contextlib

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from helpers import spin

import symmsync as ss
import symmsync.language as ssl

TILE = 16
LAG_NS = 300_000_000  # the delayed side's spin: long against a poll's and a launch's time under the interpreter
RUN_S = 120


# ---------------------------------------------------------------------- the variants (mechanism removed)
@triton.jit
def put_signal_release_first(sig, me, peer, offset, values, mask, slot, NSLOTS: tl.constexpr):
    """``put_signal`` without the order its block barrier enforces: the release, then (a
    lagging warp) the tile's stores."""
    ssl.signal(sig, me, peer, slot, 1, ssl.ADD, NSLOTS)
    spin(LAG_NS)
    tl.store(ssl.data_ptr(sig, peer, offset, values.dtype), values, mask=mask)


@triton.jit
def wait_count_without_base(
    sig, me, peer, slot, count, timeout_ns, record, SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr
):
    """``wait_count`` without its counted base: waits until the slot reaches ``count`` itself."""
    return ssl.wait_signal(sig, me, peer, slot, count, ssl.GE, timeout_ns, record, SIZE, NSLOTS, TRAP)


VARIANTS = {"put_signal": put_signal_release_first, "wait_count": wait_count_without_base}
"""Each primitive's variant, by the name the test passes (a rank function's arguments are pickled)."""


@contextlib.contextmanager
def replaced(name):
    """``symmsync.language.<name>`` is its variant in this (rank) process inside the block."""
    shipped = getattr(ssl, name)
    setattr(ssl, name, VARIANTS[name])
    try:
        yield
    finally:
        setattr(ssl, name, shipped)


# ---------------------------------------------------------------------- the exchange
@triton.jit
def exchange_kernel(
    sig,
    me,
    timeout_ns,
    record,
    out,
    ROUNDS: tl.constexpr,
    TILE: tl.constexpr,
    SIZE: tl.constexpr,
    NSLOTS: tl.constexpr,
    TRAP: tl.constexpr,
):
    # Rank 1, the producer, puts tile r (values (r + 1) * 100 + i, never zero) into its own
    # place in rank 0's memory for each round r, late (a spin first). Rank 0, the consumer,
    # waits for one more signal per round (wait_count of 1) and copies the tile out.
    i = tl.arange(0, TILE)
    for r in range(ROUNDS):
        if me == 1:
            spin(LAG_NS)
            ssl.put_signal(sig, me, 0, (r * TILE + i) * 8, (r + 1) * 100 + i.to(tl.int64), i < TILE, 0, NSLOTS)
        else:
            ok = ssl.wait_count(sig, me, 1, 0, 1, timeout_ns, record, SIZE, NSLOTS, TRAP) == 0
            v = tl.load(ssl.data_ptr(sig, me, (r * TILE + i) * 8, tl.int64))
            tl.store(out + r * TILE + i, v, mask=(i < TILE) & (i * 0 + ok.to(tl.int32) != 0))


def reference(rounds):
    """The oracle, from the rule alone: round r's tile holds (r + 1) * 100 + i."""
    return (torch.arange(rounds).view(rounds, 1) + 1) * 100 + torch.arange(TILE).view(1, TILE)


def exchange(rounds, name):
    """Rank function: the exchange as shipped, then with ``symmsync.language.<name>`` replaced by
    its variant; per run, rank 0's tiles equal the oracle? (rank 1: None)."""
    buf = ss.SymmetricBuffer(rounds * TILE * 8, backend="host")
    view = buf.view([0, 1])
    verdicts = []
    for mutated in (False, True):
        sigs = ss.Signals(view, slots=1, timeout_s=60)
        out = torch.zeros(rounds * TILE, dtype=torch.int64)
        buf.local_memory()[: rounds * TILE * 8].zero_()
        dist.barrier()  # the tiles zeroed and the signals made on both ranks before either kernel runs
        with replaced(name) if mutated else contextlib.nullcontext():
            exchange_kernel[(1,)](*sigs.kernel_args, out, ROUNDS=rounds, TILE=TILE, **sigs.constexprs)
        sigs.check()
        verdicts.append(torch.equal(out.view(rounds, TILE), reference(rounds)) if view.local_index == 0 else None)
        dist.barrier()  # both kernels ended before the next run zeroes the tiles
        sigs.close()
    buf.close()
    return verdicts


def test_the_put_signal_oracle_bites_when_the_release_precedes_the_tiles_stores(host_ranks):
    shipped, mutated = host_ranks(exchange, 2, 1, "put_signal", timeout_s=RUN_S)[0]
    assert shipped, "put_signal as shipped: the consumer read a tile other than the one put"
    assert not mutated, "a release before the stores still delivered the tile: the oracle cannot see the order"


def test_the_counted_wait_oracle_bites_without_the_device_resident_base(host_ranks):
    shipped, mutated = host_ranks(exchange, 2, 2, "wait_count", timeout_s=RUN_S)[0]
    assert shipped, "wait_count as shipped: the consumer read a tile other than the one put"
    assert not mutated, "a wait on the absolute count read round 1's tile right: the oracle cannot see the base"
