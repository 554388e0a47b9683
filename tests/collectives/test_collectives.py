"""symmsync.collectives on the host backend: results against an independent oracle.

The oracle gathers every member's input with torch.distributed (gloo) and sums in
plain torch, in member order, in float32 (``acc = x_0; acc += x_1; ...``, then one
rounding to the dtype); the all-gather is ``torch.cat`` of the inputs, the
reduce-scatter chunk ``i`` of that sum. Results must be bit-identical on every member.

* every operation, algorithm and dtype at sizes 1, 777, 4096 + 3 and ``max_numel``
  (world 2; a smaller set at worlds 3 and 4), copied in and through the symmetric input;
* 50 back-to-back calls (operations, algorithms, sizes and input kinds drawn at
  random, fresh inputs each call) with a random delay on one member before each call
  and inside its kernel, between its wait and its reads; results compared after the
  loop, so the reference cannot act as a barrier; and the same loop with the epoch
  parity of the input slots removed, which the oracle must catch;
* a two-shot all-reduce whose reading member does not wait (``protocol.wait`` removed
  there) while the other stalls before it reduces its chunk, which the oracle must catch;
* collectives made over bytes a dropped all-reduce used (its inputs in their counters'
  place), at worlds 2 and 3, with budgets of seconds;
* ``close()``: every dtype and operation made, called and closed in turn at one offset; a
  member that closes and overwrites the bytes while another still reads them (the barrier in
  ``close()`` is what keeps the slow reader's sum right).
"""

import contextlib
import gc
import random
import secrets
import time

import collective_variants as variants
import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives as C
from symmsync.collectives import operations as collective_ops
from symmsync.collectives import protocol, tuning

MAX_NUMEL = 4104  # a multiple of 2, 3 and 4: the largest reduce-scatter input too
SIZES = (1, 777, 4096 + 3, MAX_NUMEL)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPS = ("one_shot", "two_shot", "auto", "all_gather", "reduce_scatter")


# ---------------------------------------------------------------------- the oracle
def member_order_sum(inputs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    acc = inputs[0].to(torch.float32)
    for x in inputs[1:]:
        acc = acc + x.to(torch.float32)
    return acc.to(dtype)


def expected(op: str, inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    dtype, size = inputs[0].dtype, len(inputs)
    if op == "all_gather":
        return torch.cat(inputs)
    total = member_order_sum(inputs, dtype)
    if op == "reduce_scatter":
        k = inputs[0].numel() // size
        return total[rank * k : (rank + 1) * k]
    return total


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def gathered(x: torch.Tensor) -> list[torch.Tensor]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


# ---------------------------------------------------------------------- set-up on every rank
def _objects(timeout_s=None):
    world = dist.get_world_size()
    per = C.workspace_bytes(MAX_NUMEL, torch.float32, world)
    buf = ss.SymmetricBuffer(3 * per, backend="host")
    view = buf.view(list(range(world)))
    kw = dict(timeout_s=timeout_s)
    ops = {
        "all_reduce": C.AllReduce(view, MAX_NUMEL, torch.float32, "auto", offset=0, channel=0, **kw),
        "all_gather": C.AllGather(view, MAX_NUMEL, torch.float32, offset=per, channel=1, **kw),
        "reduce_scatter": C.ReduceScatter(view, MAX_NUMEL, torch.float32, offset=2 * per, channel=2, **kw),
    }
    return buf, view, ops


def _call(ops, op, x, symmetric):
    target = ops["all_reduce"] if op in ("one_shot", "two_shot", "auto") else ops[op]
    if symmetric:
        t = target.input(x.numel(), x.dtype)
        t.copy_(x)
        x = t
    if target is ops["all_reduce"]:
        return target(x, algorithm=op).clone()
    return target(x).clone()


def _numel(op, n, size):
    return max(size, n // size * size) if op == "reduce_scatter" else n


def every_case(cases, seed):
    """Rank function: each (op, dtype, numel, symmetric) case once; per case, equal to the oracle?"""
    buf, view, ops = _objects()
    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed * 100 + rank)
    got = []
    for op, dtype, n, sym in cases:
        x = torch.randn(_numel(op, n, size), generator=g).to(dtype)
        got.append((x, _call(ops, op, x, sym)))
    wrong = []
    for (op, dtype, n, sym), (x, y) in zip(cases, got):
        if not same_bits(y, expected(op, gathered(x), rank)):
            wrong.append((op, str(dtype), n, sym))
    buf.close()
    return wrong


def test_every_operation_algorithm_dtype_and_size_matches_the_member_order_float32_oracle_at_world_2(host_ranks):
    seed = secrets.randbits(16)
    cases = [(op, dt, n, False) for op in OPS for dt in DTYPES for n in SIZES]
    cases += [(op, torch.bfloat16, n, True) for op in OPS for n in (777, MAX_NUMEL)]
    wrong = host_ranks(every_case, 2, cases, seed)
    assert wrong == [[], []], f"seed {seed}: cases that differ from the oracle: {wrong}"


@pytest.mark.parametrize("world", [3, 4])
def test_every_operation_and_dtype_matches_the_oracle_at_world(world, host_ranks):
    seed = secrets.randbits(16)
    cases = [(op, dt, 4096 + 3, False) for op in OPS for dt in DTYPES]
    cases += [(op, torch.bfloat16, 1, op == "two_shot") for op in OPS]
    wrong = host_ranks(every_case, world, cases, seed)
    assert wrong == [[]] * world, f"seed {seed}: cases that differ from the oracle: {wrong}"


def auto_epochs(threshold, sizes):
    """Rank function: the fence epochs each ``auto`` call takes, with one-shot up to ``threshold`` bytes."""
    buf, view, ops = _objects()
    ar = ops["all_reduce"]
    # The threshold of this view size, made small enough for the interpreter (the pool's
    # process is shared by later tests: put the table's entry back).
    table = tuning.ONE_SHOT_MAX_BYTES
    kept = table.get(view.size)
    table[view.size] = threshold
    steps = []
    try:
        for n in sizes:
            before = ar.fence.epoch
            ar(torch.ones(n))
            steps.append(ar.fence.epoch - before)
    finally:
        if kept is None:
            del table[view.size]
        else:
            table[view.size] = kept
        buf.close()
    return steps


def test_auto_runs_one_shot_up_to_its_threshold_and_two_shot_above_it(host_ranks):
    # One-shot publishes once per call, two-shot twice: the fence's epoch tells them apart.
    sizes = (1, 512, 513, 4096)  # float32: 4, 2048, 2052 and 16384 bytes
    assert host_ranks(auto_epochs, 2, 2048, sizes) == [[1, 1, 2, 2]] * 2
    assert C.choose(4 << 20, 2) == "one_shot" and C.choose((4 << 20) + 2, 2) == "two_shot"


# ---------------------------------------------------------------------- back to back
STALLS_NS = (0, 0, 0, 1_000_000, 40_000_000, 120_000_000)


@contextlib.contextmanager
def launching(kernel, stall_ns=0, input_slots=2):
    """Operations launch ``kernel`` in this (rank) process inside the block, through the seam
    :data:`symmsync.collectives.operations.KERNEL`; the pool's process is left as it was found."""
    shipped = collective_ops.KERNEL
    collective_ops.KERNEL = kernel
    variants.CONTROL[:] = torch.tensor([stall_ns, input_slots])
    try:
        yield
    finally:
        collective_ops.KERNEL = shipped
        variants.CONTROL[:] = torch.tensor([0, 2])


def back_to_back(calls, seed, slow, parity=True, ops_drawn=OPS, symmetric_share=0.3):
    """Rank function: ``calls`` calls with no host barrier; rank ``slow`` sleeps before each
    call and stalls inside its kernel. Returns the calls whose result differs from the oracle."""
    with launching(variants.stalling_kernel, input_slots=2 if parity else 1):
        return _back_to_back(calls, seed, slow, ops_drawn, symmetric_share)


def _back_to_back(calls, seed, slow, ops_drawn, symmetric_share):
    buf, view, ops = _objects()
    rank, size = dist.get_rank(), dist.get_world_size()
    draw = random.Random(seed)  # the same draws on every rank: the members make the same calls
    delay = random.Random(seed * 7 + rank)
    g = torch.Generator().manual_seed(seed + rank)
    plan, results = [], []
    for _ in range(calls):
        op = draw.choice(ops_drawn)
        dtype = draw.choice(DTYPES)
        n = _numel(op, draw.choice((1, 777, 4096 + 3)), size)
        sym = draw.random() < symmetric_share
        x = torch.randn(n, generator=g).to(dtype)
        if rank == slow:
            time.sleep(delay.uniform(0, 0.01))
            variants.CONTROL[0] = delay.choice(STALLS_NS)
        plan.append((op, x))
        results.append(_call(ops, op, x, sym))
    wrong = [
        i for i, ((op, x), y) in enumerate(zip(plan, results)) if not same_bits(y, expected(op, gathered(x), rank))
    ]
    buf.close()
    return wrong


def test_fifty_back_to_back_calls_with_random_delays_all_match_the_oracle(host_ranks):
    seed = secrets.randbits(16)
    wrong = host_ranks(back_to_back, 3, 50, seed, 2)
    assert wrong == [[], [], []], f"seed {seed}: calls that differ from the oracle, per rank: {wrong}"


def test_the_back_to_back_oracle_bites_without_the_parity_of_the_input_slots(host_ranks):
    # One-shot all-reduces only (a two-shot call's second fence protects its slots by itself),
    # copied in, no symmetric input: a fast member's next copy-in lands in the slot the slow
    # member is still reading.
    seed = secrets.randbits(16)
    wrong = host_ranks(back_to_back, 2, 50, seed, 1, False, ("one_shot",), 0.0)
    assert wrong[1], f"seed {seed}: without the parity the slow member read no overwritten slot: {wrong}"


# ---------------------------------------------------------------------- the wait
READER_LATE_S, WRITER_STALL_NS = 0.3, 600_000_000


@contextlib.contextmanager
def waiting(waits):
    """Inside the block this (rank) process's collectives wait as shipped, or (``waits`` false)
    not at all: :func:`collective_variants.no_wait` in ``protocol.wait``'s place."""
    shipped = protocol.wait
    if not waits:
        protocol.wait = variants.no_wait
    try:
        yield
    finally:
        protocol.wait = shipped


def reader_and_stalled_writer(seed):
    """Rank function: a two-shot all-reduce to warm up, then two more, the first as shipped, the
    second with rank 0's waits removed. Rank 0 (the reader) calls each READER_LATE_S late, so
    that rank 1 (the writer) published its input and header and waits for it; rank 1 then
    stalls inside its kernel, after its verdict and before it reduces its chunk. Returns per
    call (shipped, no wait on rank 0): equal to the oracle? (no host barrier before the check)."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed + rank)
    with launching(variants.stalling_kernel):
        buf, view, ops = _objects()
        _call(ops, "two_shot", torch.randn(777, generator=g), False)  # both members bound and in step
        plan = []
        for waits in (True, False):
            x = torch.randn(777, generator=g)
            if rank == 0:
                time.sleep(READER_LATE_S)
            else:
                variants.CONTROL[0] = WRITER_STALL_NS
            with waiting(waits or rank != 0):
                plan.append((x, _call(ops, "two_shot", x, False)))
    verdict = [same_bits(y, expected("two_shot", gathered(x), rank)) for x, y in plan]
    buf.close()
    return verdict


def test_the_all_reduce_oracle_bites_when_a_member_reads_without_its_wait(host_ranks):
    # Without its wait the reader takes the writer's reduced chunk before the writer stored
    # it (the previous call's chunk). (A one-shot call has one wait, before it reads the
    # headers: on the host backend the header check turns a read without it into a
    # CollectiveMismatch, since a member's header lands after its input.)
    seed = secrets.randbits(16)
    (shipped, unwaited), writer = host_ranks(reader_and_stalled_writer, 2, seed)
    assert shipped and writer == [True, True], f"seed {seed}: as shipped, a member's result differs from the oracle"
    assert not unwaited, f"seed {seed}: the reader that did not wait got the oracle's result: the oracle cannot see it"


# ---------------------------------------------------------------------- the fused epilogue
def fused_epilogue(shapes, seed):
    """Rank function: ``ar(x, residual=r, norm_weight=w)`` per (dtype, tokens, hidden); per case,
    (the new residual equals the oracle's bits, the largest difference of the normed output,
    every member got the same bits of both)."""
    world = dist.get_world_size()
    buf = ss.SymmetricBuffer(C.workspace_bytes(MAX_NUMEL, torch.float32, world), backend="host")
    ar = C.AllReduce(buf.view(list(range(world))), MAX_NUMEL, torch.float32)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed + rank)
    shared = torch.Generator().manual_seed(seed)  # the residual and the weight: the same on every member
    got = []
    for dtype, tokens, hidden in shapes:
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        r = torch.randn(tokens, hidden, generator=shared).to(dtype)
        w = (1 + 0.1 * torch.randn(hidden, generator=shared)).to(dtype)
        y, new_r = ar(x, residual=r, norm_weight=w, eps=1e-5)
        total = member_order_sum(gathered(x), dtype)
        want_r = (total.float() + r.float()).to(dtype)  # torch's `total + r`
        h = want_r.float()
        want_y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(dtype)
        everyone = gathered(torch.cat([y.view(torch.uint8).flatten(), new_r.view(torch.uint8).flatten()]))
        got.append(
            (
                same_bits(new_r, want_r),
                float((y.float() - want_y.float()).abs().max()),
                all(torch.equal(e, everyone[0]) for e in everyone),
            )
        )
    buf.close()
    return got


def test_the_fused_residual_and_rms_norm_epilogue_matches_torch_and_is_the_same_on_every_member(host_ranks):
    seed = secrets.randbits(16)
    shapes = [(dt, 3, 1000) for dt in DTYPES] + [(torch.bfloat16, 1, 1), (torch.bfloat16, 4, 1024)]
    for rank, cases in enumerate(host_ranks(fused_epilogue, 3, shapes, seed)):
        for (dt, _, _), (residual_ok, diff, same) in zip(shapes, cases):
            assert residual_ok, (seed, rank, dt, "the new residual differs from the oracle")
            # The normed output's float32 mean is a tree sum in the kernel, a torch reduction
            # in the oracle: one rounding step of the dtype at most.
            assert diff <= {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dt] * 8, (seed, dt, diff)
            assert same, (seed, rank, dt, "members got different bits")


# ---------------------------------------------------------------------- bytes used before
def made_over_used_bytes(calls):
    """On one buffer: a one-shot all-reduce called ``calls`` times at offset 0, then dropped; an
    all-gather at offset 0 (channel 0) and a reduce-scatter at the next line after it (channel 1),
    over bytes the all-reduce's inputs filled; one call of each. Returns their outputs (or the
    error a call raised). Budgets of seconds: a call that cannot complete fails fast."""
    world, rank = dist.get_world_size(), dist.get_rank()
    buf = ss.SymmetricBuffer(1 << 21, backend="host")
    view = buf.view(list(range(world)))
    try:
        ar = C.AllReduce(view, max_numel=4099, dtype=torch.float32, algorithm="one_shot", timeout_s=5)
        for i in range(calls):
            ar(torch.ones((1, 777, 4099)[i % 3]))
        ar = None
        gc.collect()  # the all-reduce's bytes are free again
        ag = C.AllGather(view, max_numel=1000, dtype=torch.float32, timeout_s=5)
        off = (C.workspace_bytes(1000, torch.float32, world, op="all_gather") + 127) // 128 * 128
        rs = C.ReduceScatter(view, max_numel=999 * world, dtype=torch.float32, offset=off, channel=1, timeout_s=5)
        try:
            return ag(torch.full((333,), float(rank + 1))).tolist(), rs(torch.ones(world * 100) * (rank + 1)).tolist()
        except ss.SymmSyncError as e:
            return f"{type(e).__name__}: {e}"
    finally:
        buf.close()


@pytest.mark.parametrize("world", [2, 3])
def test_a_collective_made_over_bytes_another_used_starts_from_its_own_words(world, host_ranks):
    gathered_want = [float(r + 1) for r in range(world) for _ in range(333)]
    summed = float(sum(range(1, world + 1)))
    for rank, got in enumerate(host_ranks(made_over_used_bytes, world, 36, timeout_s=240)):
        assert not isinstance(got, str), (rank, got)
        ag_out, rs_out = got
        assert ag_out == gathered_want, (rank, "all-gather", ag_out[:4], ag_out[-4:])
        assert rs_out == [summed] * 100, (rank, "reduce-scatter", rs_out[:8])


# ---------------------------------------------------------------------- close()
def closed_and_made_again():
    """At offset 0 of one buffer, in turn: an all-reduce of each dtype, an all-gather and a
    reduce-scatter, each made, called once, closed (the last in a ``with`` block), the next made
    at once over the same bytes. Per object: its result against the oracle, then what a call
    after close() raised."""
    world, rank = dist.get_world_size(), dist.get_rank()
    buf = ss.SymmetricBuffer(C.workspace_bytes(MAX_NUMEL, torch.float32, world), backend="host")
    view = buf.view(list(range(world)))
    n = 2 * 3 * 4 * 5  # splits into one chunk per member at worlds 2 and 3
    g = torch.Generator().manual_seed(rank)
    made = [(C.AllReduce, "one_shot", dt) for dt in DTYPES] + [
        (C.AllReduce, "two_shot", torch.float32),
        (C.AllGather, "all_gather", torch.float16),
        (C.ReduceScatter, "reduce_scatter", torch.bfloat16),
    ]
    out = []
    try:
        for i, (cls, op, dtype) in enumerate(made):
            kw = {"algorithm": op} if cls is C.AllReduce else {}
            obj = cls(view, n, dtype, timeout_s=10, **kw)
            x = torch.randn(n, generator=g).to(dtype)
            if i == len(made) - 1:
                with obj:
                    y = obj(x)
            else:
                y = obj(x)
                obj.close()
            obj.close()  # idempotent
            try:
                obj(x)
                after = "returned"
            except ss.ClosedError as e:
                after = str(e)
            out.append((op, str(dtype), same_bits(y, expected(op, gathered(x), rank)), after))
    finally:
        buf.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_closed_collective_frees_its_bytes_for_any_layout_at_once(world, host_ranks):
    for rank, results in enumerate(host_ranks(closed_and_made_again, world, timeout_s=240)):
        assert len(results) == 6, results
        for op, dtype, right, after in results:
            assert right, (rank, op, dtype, "the result differs from the oracle")
            assert "used after close()" in after, (rank, op, dtype, after)


CLOSE_STALL_NS = 500_000_000


def closing_under_a_slow_reader():
    """Rank 1 stalls in its kernel between its wait and its reads of rank 0's slot; rank 0, once
    its call returned, closes the all-reduce and fills the bytes it held with NaN (a new owner's
    stores). Returns whether this rank's sum is the oracle's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    with launching(variants.stalling_kernel, stall_ns=CLOSE_STALL_NS if rank == 1 else 0):
        buf = ss.SymmetricBuffer(C.workspace_bytes(MAX_NUMEL, torch.float32, world), backend="host")
        ar = C.AllReduce(buf.view(list(range(world))), MAX_NUMEL, torch.float32, "one_shot", timeout_s=10)
        x = torch.full((777,), float(rank + 1))
        y = ar(x)
        ar.close()  # returns once every member's call is over
        buf.local_memory().view(torch.float32).fill_(float("nan"))
        right = same_bits(y, expected("one_shot", gathered(x), rank))
        buf.close()
    return right


def test_close_returns_only_when_every_member_is_done_with_the_bytes(host_ranks):
    assert host_ranks(closing_under_a_slow_reader, 2, timeout_s=240) == [True, True]
