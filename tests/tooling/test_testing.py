"""symmsync.testing.run: results in rank order, fail fast with the failing rank's traceback."""

import os
import time

import pytest
import torch.distributed as dist

import symmsync as ss
from symmsync.testing import run


def rank_and_world(tag):
    return (tag, dist.get_rank(), dist.get_world_size(), os.environ.get("TRITON_INTERPRET"))


def test_results_come_back_in_rank_order_with_the_interpreter_set():
    assert run(rank_and_world, 3, "x") == [("x", r, 3, "1") for r in range(3)]


def one_rank_raises():
    if dist.get_rank() == 1:
        raise ValueError("planted failure on rank 1")
    time.sleep(120)  # the others would wait for a long time: run must not


def test_a_failing_rank_stops_the_run_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(ss.RankFailure) as e:
        run(one_rank_raises, 3, timeout_s=100)
    assert time.monotonic() - t0 < 60
    assert e.value.rank == 1
    assert "planted failure on rank 1" in str(e.value)
    assert "one_rank_raises" in e.value.remote_traceback
    assert isinstance(e.value.__cause__, ValueError)


def one_rank_hangs():
    if dist.get_rank() == 0:
        time.sleep(600)
    return "done"


def test_a_hang_becomes_a_failure_naming_the_ranks_that_did_not_finish():
    t0 = time.monotonic()
    with pytest.raises(ss.RankFailure, match=r"ranks \[0\] did not finish within 15 s"):
        run(one_rank_hangs, 2, timeout_s=15)
    assert time.monotonic() - t0 < 45


def one_rank_dies():
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(120)


def test_a_rank_that_dies_is_reported_with_its_exit_code():
    with pytest.raises(ss.RankFailure, match="rank 1 exited with code 3"):
        run(one_rank_dies, 2, timeout_s=60)


def square(x):
    return dist.get_rank() * x * x


def fail_on_rank(r):
    if dist.get_rank() == r:
        raise RuntimeError(f"planted failure on rank {r}")
    return "ok"


def test_a_rank_pool_runs_many_calls_and_stops_at_the_first_failure():
    from symmsync.testing import RankPool

    pool = RankPool(2, timeout_s=120)
    try:
        assert pool.call(square, 3) == [0, 9]
        assert pool.call(square, 4) == [0, 16]
        with pytest.raises(ss.RankFailure, match="planted failure on rank 1"):
            pool.call(fail_on_rank, 1)
        with pytest.raises(ss.RankFailure, match="closed"):
            pool.call(square, 1)
    finally:
        pool.close()


def test_a_function_defined_inside_another_is_refused_up_front_with_what_to_do():
    def local_fn():
        return 1

    for fn in (local_fn, lambda: 1):
        with pytest.raises(ss.ConfigError, match="define it at module level"):
            run(fn, 2)
