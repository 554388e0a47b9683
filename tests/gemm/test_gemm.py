"""symmsync.gemm on the host backend: both consumers against plain-torch oracles (tests/gemm_cases.py)
at worlds 2 and 3, bit for bit; a refused call fails on every member with NaN in its outputs and
the next call is right; members whose rows differ raise CallMismatch on every member; compiled."""

import pytest
import torch
from gemm_cases import compiled, exact, mismatch, refused

import symmsync as ss
from symmsync import gemm

# (m, b transposed, out= given): one row, a partial tile, several tiles and signal blocks, max_rows
BAD = "a must be torch.bfloat16, got torch.float64"
SHAPES = [(1, False, False), (5, True, True), (20, False, True), (32, True, False)]


@pytest.mark.parametrize("world", [2, 3])
def test_both_consumers_equal_the_oracles_bit_for_bit_in_bfloat16(host_ranks, world):
    assert host_ranks(exact, world, "host", torch.bfloat16, SHAPES, timeout_s=300) == [[]] * world


def test_groups_that_do_not_divide_the_members_and_several_programs_equal_the_oracles(host_ranks):
    # At 3 members a reduce-scatter tile of 16 rows holds 2 members' 6 or 7 rows (the third member's
    # alone); 3 programs a launch claim the sends among them (the interpreter runs them in turn).
    assert host_ranks(exact, 3, "host", torch.bfloat16, [(6, False, False), (7, True, True)], calls=1,
                      timeout_s=300) == [[]] * 3  # fmt: skip
    assert host_ranks(exact, 2, "host", torch.float32, SHAPES, calls=1, programs=3, timeout_s=300) == [[], []]


def test_float32_and_float16_equal_the_oracles(host_ranks):
    for dtype in (torch.float32, torch.float16):
        assert host_ranks(exact, 2, "host", dtype, SHAPES[1:3], calls=1, timeout_s=300) == [[], []]


@pytest.mark.parametrize("refuser", [0, 1])
def test_a_refused_call_fails_on_every_member_with_nan_and_the_next_is_right(host_ranks, refuser):
    seen = host_ranks(refused, 2, "host", refuser, timeout_s=300)
    for rank, per in enumerate(seen):
        for name, (raised, nan, ok) in per.items():
            assert ok == [True, True], (rank, name, ok)
            if rank == refuser:
                assert raised.startswith("InputError") and BAD in raised, raised
            else:
                assert raised == f"PeerRefused: rank {refuser}: {BAD}", raised
                assert nan, f"rank {rank} {name}: the refused call's out= must hold NaN only"


def test_an_out_that_overlaps_a_is_refused_on_every_member_and_the_refusers_bytes_are_kept(host_ranks):
    words = "out shares memory with a (the call reads a while it writes out): give out memory of its own"
    seen = host_ranks(refused, 2, "host", 1, how="overlap", timeout_s=300)
    for rank, per in enumerate(seen):
        for name, (raised, held, ok) in per.items():
            assert ok == [True, True], (rank, name, ok)
            if rank == 1:
                assert raised.startswith("InputError") and words in raised, raised
                assert held, f"{name}: the refuser's a and out= must keep their bytes"
            else:
                assert raised == f"PeerRefused: rank 1: {words}", raised
                assert held, f"rank 0 {name}: the refused call's out= must hold NaN only"


def test_members_whose_rows_differ_raise_call_mismatch_on_every_member(host_ranks):
    assert host_ranks(mismatch, 2, "host", timeout_s=300) == [("CallMismatch", "CallMismatch")] * 2


def test_both_consumers_run_in_a_compiled_graph_and_refuse_an_out_there(host_ranks):
    assert host_ranks(compiled, 2, "host", timeout_s=300) == [True, True]


def test_the_ops_fakes_size_their_results_from_their_arguments_alone():
    # No object has handle -1: a fake that looked the consumer up would raise (and a graph cache,
    # which keys a graph by its nodes and constants, could hand a graph traced for 2 members to 3).
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        b = torch.empty(32, 48)
        assert gemm.consumers.all_gather_matmul_op(torch.empty(4, 32), b, -1, 3).shape == (12, 48)
        assert gemm.consumers.matmul_reduce_scatter_op(torch.empty(12, 32), b, -1, 3).shape == (4, 48)


def _bad_arguments(case):
    import torch.distributed as dist

    w = dist.get_world_size()
    with ss.SymmetricBuffer(1 << 16, backend="host") as buf:
        view = buf.view(list(range(w)))
        kw = {"max_rows": 8, "k": 32, "dtype": torch.bfloat16}
        if case == "k":
            kw["k"] = 3 if dist.get_rank() == 1 else 32  # 6 bytes: rows would not stay aligned
        if case == "dtype":
            kw["dtype"] = torch.int32
        if case == "fits":
            kw["max_rows"] = 4096
        try:
            gemm.AllGatherMatmul(view, **kw).close()
        except ss.SymmSyncError as e:
            return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("k", "ConfigError", "k=3 torch.bfloat16 elements are not a multiple of 16 bytes"),
        ("dtype", "ConfigError", "dtype must be one of"),
        ("fits", "BoundsError", "allocate symmsync.gemm's *_bytes(...) more"),
    ],
)
def test_a_bad_argument_on_any_member_raises_on_every_member(host_ranks, case, error, words):
    for got in host_ranks(_bad_arguments, 2, case, timeout_s=120):
        assert got is not None and got[0] == error and words in got[1], got
