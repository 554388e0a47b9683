"""symmsync.moe on the host backend: dispatch and combine against a plain-torch oracle.

The oracle (``moe_oracle.py``) is written from the contract of docs/moe.md: the rows every
member receives, bit for bit and in their order, with their source indices and counts, and
the combined output, bit for bit. Each member's inputs reach the oracle through
torch.distributed (gloo), apart from the dispatcher.

* every routing kind (random, a hot expert, unused experts, every entry masked, a member
  with no tokens, an expert named twice by one token, one token a member) at worlds 2, 3 and 4 in bfloat16, and
  at world 2 in float32 and float16;
* rows of several chunks (hidden 4100: the last one partial), every routing kind;
* the fp8 option's codes and scales against torch's conversion of the rule;
* 20 back-to-back layers (dispatch, experts, combine) with fresh routings (every kind, each
  about three times) and a random delay on one member, checked after the loop, so the oracle is no
  barrier between the layers (80 with the soaks, ``make test-soak``);
* 30 back-to-back dispatches with no combine between them (the dispatch's parity alone keeps
  the rows apart);
* steps launched with ``wait=False`` and work launched before their ``wait()``: the plain
  calls' bits, and a call made while a step is pending refused.
"""

import os
import random
import time

import moe_oracle as oracle
import pytest
import routings
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import moe

HIDDEN, MAX_TOKENS, TOP_K = 64, 6, 3


def gathered(x):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def make(num_experts, max_tokens, hidden, dtype, top_k, fp8=False, timeout_s=60, programs=None):
    world = dist.get_world_size()
    buf = ss.SymmetricBuffer(moe.buffer_bytes(num_experts, max_tokens, hidden, dtype, top_k, world, fp8=fp8))
    disp = moe.Dispatcher(buf.view(list(range(world))), num_experts, max_tokens, hidden, dtype, top_k, fp8=fp8,
                          timeout_s=timeout_s, programs=programs)  # fmt: skip
    return buf, disp


def experts(disp, recv):
    """Every local expert's output for its received rows (the oracle's function)."""
    first = disp.view.local_index * disp.local_experts
    return torch.stack([oracle.expert(recv[e], first + e) for e in range(disp.local_experts)])


def compare(disp, layer, got, inputs, me):
    """The differences between one layer's results and the oracle's, as sentences."""
    (recv, counts, handle, y), (xs, ids, ws) = got, inputs
    rows, src, fill = oracle.dispatch(xs, ids, disp.num_experts, disp.max_tokens, me)
    wrong = []
    recv = oracle.received(recv, fill.sum(1))
    if not oracle.same_bits(recv, rows):
        bad = (recv.view(torch.uint8) != rows.view(torch.uint8)).any(-1).nonzero().tolist()
        wrong.append(f"layer {layer}: recv rows differ at [expert, row] {bad[:6]}")
    if not torch.equal(handle.per_source, fill) or not torch.equal(counts, fill.sum(1)):
        wrong.append(f"layer {layer}: counts {handle.per_source.tolist()}, expected {fill.tolist()}")
    got_src = oracle.received(handle.src, fill.sum(1), -1)
    if not torch.equal(got_src, src):
        wrong.append(f"layer {layer}: source indices {got_src.tolist()}, expected {src.tolist()}")
    if not torch.equal(handle.offsets, fill.cumsum(1) - fill):
        wrong.append(f"layer {layer}: offsets {handle.offsets.tolist()}, expected the counts' exclusive sums")
    want = oracle.combine(xs[me], ids[me], ws[me])
    if not oracle.same_bits(y, want):
        wrong.append(f"layer {layer}: combine differs in tokens {(y != want).any(-1).nonzero().flatten().tolist()}")
    return wrong


def layer(disp, x, ids, w):
    recv, counts, handle = disp.dispatch(x, ids)
    y = disp.combine(experts(disp, recv), w, handle)
    return recv, counts, handle, y


def kept(recv, counts, handle, y=None):
    """A layer's results, kept past the dispatch after next: ``recv`` and ``handle.src`` are views
    of the dispatcher's workspace, valid until then (docs/moe.md, "Sizing and memory")."""
    recv = tuple(t.clone() for t in recv) if isinstance(recv, tuple) else recv.clone()
    return recv, counts, handle._replace(src=handle.src.clone()), y


# ---------------------------------------------------------------------- rank functions
def every_routing(num_experts, dtype_name, seed, hidden=HIDDEN, programs=None):
    dtype = getattr(torch, dtype_name)
    world, me = dist.get_world_size(), dist.get_rank()
    buf, disp = make(num_experts, MAX_TOKENS, hidden, dtype, TOP_K, programs=programs)
    if programs is not None and disp.programs != programs:
        buf.close()
        return [f"programs={programs} gave a dispatcher of {disp.programs}"]
    wrong = []
    try:
        for i, kind in enumerate(routings.KINDS):
            x, ids, w = routings.routing(kind, me, world, num_experts, MAX_TOKENS, hidden, TOP_K, dtype, seed + i)
            got = layer(disp, x, ids, w)
            wrong += [f"{kind}: {s}" for s in compare(disp, i, got, (gathered(x), gathered(ids), gathered(w)), me)]
            if disp._tally.any():  # noqa: SLF001 - the send's program 0 reads its counts back as zeros
                wrong.append(f"{kind}: the counts' tally is {disp._tally.tolist()} after the dispatch, not zeros")  # noqa: SLF001
    finally:
        buf.close()
    return wrong


def back_to_back(layers, num_experts, max_tokens, hidden, top_k, slow, seed, combine=True):
    world, me = dist.get_world_size(), dist.get_rank()
    buf, disp = make(num_experts, max_tokens, hidden, torch.bfloat16, top_k)
    rng = random.Random(seed + me)
    results, inputs = [], []
    try:
        for i in range(layers):
            kind = routings.KINDS[i % len(routings.KINDS)]
            x, ids, w = routings.routing(kind, me, world, num_experts, max_tokens, hidden, top_k, torch.bfloat16,
                                         seed + i)  # fmt: skip
            if me == slow:
                time.sleep(rng.uniform(0, 0.004))
            if combine:
                results.append(kept(*layer(disp, x, ids, w)))
            else:
                results.append(kept(*disp.dispatch(x, ids)))
            inputs.append((x, ids, w))
        everyone = gathered(inputs)  # after the loop: no barrier between the layers
        wrong = []
        for i, got in enumerate(results):
            xs, ids, ws = ([everyone[r][i][j] for r in range(world)] for j in range(3))
            if combine:
                wrong += compare(disp, i, got, (xs, ids, ws), me)
            else:
                rows, src, fill = oracle.dispatch(xs, ids, num_experts, max_tokens, me)
                got_rows = oracle.received(got[0], fill.sum(1))
                if not (oracle.same_bits(got_rows, rows) and torch.equal(got[2].per_source, fill)):
                    wrong.append(f"dispatch {i}: recv rows or counts differ from the oracle's")
    finally:
        buf.close()
    return wrong


def fp8_rows(seed):
    world, me = dist.get_world_size(), dist.get_rank()
    hidden, num_experts = 256, 2 * world
    buf, disp = make(num_experts, 4, hidden, torch.bfloat16, 2, fp8=True)
    wrong = []
    try:
        for i in range(3):
            x, ids, _ = routings.routing("random", me, world, num_experts, 4, hidden, 2, torch.bfloat16, seed + i)
            if i == 2:  # a tiny group (the amax floor), a group with zeros, and large values (saturation edge)
                x[:, :128] = (x[:, :128] * 1e-7).to(torch.bfloat16)
                x[:, 128:192] = 0
            (codes, scales), counts, handle = disp.dispatch(x, ids)
            xs, all_ids = gathered(x), gathered(ids)
            q = [oracle.quantize(v) for v in xs]
            rows, src, fill = oracle.dispatch([c for c, _ in q], all_ids, num_experts, 4, me)
            want_s, _, _ = oracle.dispatch([s for _, s in q], all_ids, num_experts, 4, me)
            n = fill.sum(1)
            got_codes = oracle.received(codes.view(torch.uint8), n)
            if codes.dtype != torch.float8_e4m3fn or not torch.equal(got_codes, rows):
                wrong.append(f"call {i}: fp8 codes differ")
            if not oracle.same_bits(oracle.received(scales, n), want_s):
                wrong.append(f"call {i}: fp8 scales differ")
            if not torch.equal(handle.per_source, fill):
                wrong.append(f"call {i}: counts differ")
    finally:
        buf.close()
    return wrong


def two_in_flight(seed):
    """Two dispatches, then their two combines (dispatch A, dispatch B, combine A, combine B): the
    first dispatch's ``recv`` and handle, views of the workspace, hold past the second dispatch."""
    world, me = dist.get_world_size(), dist.get_rank()
    buf, disp = make(2 * world, MAX_TOKENS, HIDDEN, torch.bfloat16, TOP_K)
    wrong = []
    try:
        ins = [routings.routing("random", me, world, 2 * world, MAX_TOKENS, HIDDEN, TOP_K, torch.bfloat16, seed + i)
               for i in range(2)]  # fmt: skip
        got = [disp.dispatch(x, ids) for x, ids, _ in ins]
        ys = [disp.combine(experts(disp, recv), w, handle) for (recv, _, handle), (_, _, w) in zip(got, ins)]
        for i, ((recv, counts, handle), y, (x, ids, w)) in enumerate(zip(got, ys, ins)):
            wrong += compare(disp, i, (recv, counts, handle, y), (gathered(x), gathered(ids), gathered(w)), me)
    finally:
        buf.close()
    return wrong


def stale_handle(seed):
    """Three dispatches, then a combine with the first one's handle (its ``src`` rewritten by the
    third dispatch): what it raised, whether its ``y`` was plausible, and whether the third
    dispatch's combine is then right."""
    world, me = dist.get_world_size(), dist.get_rank()
    buf, disp = make(2 * world, MAX_TOKENS, HIDDEN, torch.bfloat16, TOP_K)
    try:
        ins = [routings.routing("random", me, world, 2 * world, MAX_TOKENS, HIDDEN, TOP_K, torch.bfloat16, seed + i)
               for i in range(3)]  # fmt: skip
        got = [disp.dispatch(x, ids) for x, ids, _ in ins]
        try:
            disp.combine(experts(disp, got[0][0]), ins[0][2], got[0][2])
            raised = None
        except ss.SymmSyncError as e:
            raised = f"{type(e).__name__}: {e}"
        (recv, counts, handle), (x, ids, w) = got[2], ins[2]
        y = disp.combine(experts(disp, recv), w, handle)
        wrong = compare(disp, 2, (recv, counts, handle, y), (gathered(x), gathered(ids), gathered(w)), me)
    finally:
        buf.close()
    return raised, wrong


def phase_stamps(seed):
    """One layer on a dispatcher made with its phase clock on: the oracle's verdict, and whether the
    last dispatch's stamps (``disp.phase_times``) are in the order of its phases."""
    world, me = dist.get_world_size(), dist.get_rank()
    os.environ[moe.dispatcher.PHASE_TIMES_ENV] = "1"
    try:
        buf, disp = make(2 * world, MAX_TOKENS, HIDDEN, torch.bfloat16, TOP_K)
    finally:
        del os.environ[moe.dispatcher.PHASE_TIMES_ENV]
    try:
        x, ids, w = routings.routing("random", me, world, 2 * world, MAX_TOKENS, HIDDEN, TOP_K, torch.bfloat16, seed)
        recv, counts, handle = disp.dispatch(x, ids)
        t = disp.phase_times.tolist()
        y = disp.combine(experts(disp, recv), w, handle)
        wrong = compare(disp, 0, (recv, counts, handle, y), (gathered(x), gathered(ids), gathered(w)), me)
        ordered = 0 < t[0] <= t[1] <= t[2] <= t[3] <= t[4] <= t[5]
    finally:
        buf.close()
    return wrong, ordered, t


def overlapped(seed):
    """Layers made twice on one dispatcher, with the same inputs: plainly, then with each send
    launched alone (``wait=False``), work in between and the receive at ``wait()``; the differences
    between the two, bit for bit, and what a call made while a step is pending raised."""
    world, me = dist.get_world_size(), dist.get_rank()
    buf, disp = make(2 * world, MAX_TOKENS, HIDDEN, torch.bfloat16, TOP_K)
    g = torch.Generator().manual_seed(seed + me)
    wrong, misuse = [], []
    try:
        for i, kind in enumerate(routings.KINDS):
            x, ids, w = routings.routing(
                kind, me, world, 2 * world, MAX_TOKENS, HIDDEN, TOP_K, torch.bfloat16, seed + i
            )
            recv, counts, handle = disp.dispatch(x, ids)
            y = disp.combine(experts(disp, recv), w, handle)
            pending = disp.dispatch(x, ids, wait=False)
            work = torch.randn(64, 64, generator=g) @ torch.randn(64, 64, generator=g)  # launched in between
            if i == 0:
                for call, args in ((disp.dispatch, (x, ids)), (disp.synchronize, ())):
                    try:
                        call(*args)
                        misuse.append("returned")
                    except ss.ConfigError as e:
                        misuse.append(str(e))
            recv2, counts2, handle2 = pending.wait()
            if i == 0:
                try:
                    pending.wait()
                    misuse.append("returned")
                except ss.ConfigError as e:
                    misuse.append(str(e))
            pending = disp.combine(experts(disp, recv2), w, handle2, wait=False)
            work = work @ work
            y2 = pending.wait()
            n = counts
            if not (torch.equal(counts2, counts) and torch.equal(handle2.offsets, handle.offsets)):
                wrong.append(f"{kind}: counts or offsets differ")
            elif not oracle.same_bits(oracle.received(recv2, n), oracle.received(recv, n)):
                wrong.append(f"{kind}: received rows differ")
            if not oracle.same_bits(y2, y):
                wrong.append(f"{kind}: combined output differs")
    finally:
        buf.close()
    return wrong, misuse


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_routing_gives_the_oracles_rows_order_counts_and_combined_output(host_ranks, world):
    results = host_ranks(every_routing, world, 2 * world, "bfloat16", 11 * world, timeout_s=300)
    assert results == [[]] * world, results


def test_rows_of_several_chunks_are_exact_to_their_last_partial_chunk(host_ranks):
    # hidden 4100: three chunks of a row (2048, 2048, 4) for every send and sum program, and more
    # experts than a one-token call has programs (each counts several)
    results = host_ranks(every_routing, 2, 4, "bfloat16", 23, 4100, timeout_s=300)
    assert results == [[]] * 2, results


@pytest.mark.parametrize("programs", [1, 64])
def test_every_routing_is_exact_with_one_program_a_launch_or_more_than_the_work(host_ranks, programs):
    # programs=1: one program of each launch sized by the device loops over every block and
    # (token, chunk); 64: more than a call's work, most programs find nothing after their wait
    results = host_ranks(every_routing, 2, 4, "bfloat16", 31, HIDDEN, programs, timeout_s=300)
    assert results == [[]] * 2, results


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_every_routing_is_exact_in_float32_and_float16_too(host_ranks, dtype):
    results = host_ranks(every_routing, 2, 4, dtype, 5, timeout_s=300)
    assert results == [[]] * 2, results


def test_fp8_dispatch_sends_the_rules_codes_and_scales(host_ranks):
    assert host_ranks(fp8_rows, 2, 3, timeout_s=300) == [[], []]


@pytest.mark.parametrize("layers", [20, pytest.param(80, marks=pytest.mark.soak)])  # 80: make test-soak (CI time)
def test_back_to_back_layers_with_a_slow_member_are_exact(host_ranks, layers):
    results = host_ranks(back_to_back, 2, layers, 4, 3, 32, 2, 1, 7, timeout_s=600)
    assert results == [[], []], [r[:5] for r in results]


@pytest.mark.soak  # world 4 runs every routing back to back above; this longer loop: make test-soak (CI time)
def test_back_to_back_layers_at_world_4_are_exact(host_ranks):
    results = host_ranks(back_to_back, 4, 12, 8, 3, 32, 2, 2, 3, timeout_s=600)
    assert results == [[]] * 4, [r[:5] for r in results]


def test_back_to_back_dispatches_without_combines_are_exact(host_ranks):
    results = host_ranks(back_to_back, 2, 30, 4, 3, 32, 2, 0, 5, False, timeout_s=600)
    assert results == [[], []], [r[:5] for r in results]


@pytest.mark.parametrize("world", [2, 3])
def test_a_step_launched_with_wait_false_gives_the_plain_calls_bits(host_ranks, world):
    for rank, (wrong, misuse) in enumerate(host_ranks(overlapped, world, 5, timeout_s=300)):
        assert wrong == [], f"rank {rank}: {wrong}"
        assert len(misuse) == 3 and all("wait" in m for m in misuse), f"rank {rank}: {misuse}"
        assert "pending" in misuse[0] and "pending" in misuse[1] and "called already" in misuse[2], misuse


def wait_not_a_bool():
    """Both members pass ``wait="no"`` to a dispatch, then make a good layer: what each raised."""
    world, me = dist.get_world_size(), dist.get_rank()
    buf, disp = make(2 * world, MAX_TOKENS, HIDDEN, torch.bfloat16, TOP_K)
    x, ids, w = routings.routing("random", me, world, 2 * world, MAX_TOKENS, HIDDEN, TOP_K, torch.bfloat16, 3)
    try:
        disp.dispatch(x, ids, wait="no")
        raised = "returned"
    except ss.SymmSyncError as e:
        raised = f"{type(e).__name__}: {e}"
    wrong = compare(disp, 0, layer(disp, x, ids, w), (gathered(x), gathered(ids), gathered(w)), me)
    buf.close()
    return raised, wrong


def test_a_dispatchs_outputs_hold_past_the_next_dispatch(host_ranks):
    assert host_ranks(two_in_flight, 2, 13, timeout_s=300) == [[], []]


def test_a_combine_with_a_handle_older_than_the_last_two_dispatches_is_refused(host_ranks):
    # Its src is a view of the rows buffer the dispatch after next reused: refused on every member
    # (each passed such a handle), never summed into plausible rows; the next combine is right.
    for rank, (raised, wrong) in enumerate(host_ranks(stale_handle, 2, 29, timeout_s=300)):
        assert raised and raised.startswith("InputError") and "last two dispatches" in raised, (rank, raised)
        assert wrong == [], (rank, wrong)


def test_the_phase_clock_stamps_a_dispatchs_phases_in_order(host_ranks):
    for wrong, ordered, stamps in host_ranks(phase_stamps, 2, 17, timeout_s=300):
        assert wrong == [] and ordered, (wrong, stamps)


def test_a_wait_that_is_no_bool_is_refused_on_every_member_and_the_next_layer_is_right(host_ranks):
    for rank, (raised, wrong) in enumerate(host_ranks(wait_not_a_bool, 2, timeout_s=300)):
        assert raised.startswith("InputError") and "wait must be True or False, got 'no'" in raised, (rank, raised)
        assert wrong == [], (rank, wrong)
