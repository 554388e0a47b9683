"""symmsync.testing.run: results in rank order, fail fast with the failing rank's traceback."""

import os
import re
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from jobs import python

import symmsync as ss
from symmsync.testing import run


def rank_and_world(tag):
    return (tag, dist.get_rank(), dist.get_world_size(), os.environ.get("TRITON_INTERPRET"))


def test_results_come_back_in_rank_order_with_the_interpreter_set():
    assert run(rank_and_world, 3, "x") == [("x", r, 3, "1") for r in range(3)]


def environment_seen():
    import sys

    from symmsync.language import core

    return (
        os.environ.get("SYMMSYNC_PROBE_VAR"),
        core.DEBUG,  # read when symmsync.language.core was imported
        "torch" in sys.modules,
        os.getppid() == int(os.environ["PARENT_PID"]),  # a spawned rank is the runner's child
    )


def test_each_run_gives_its_ranks_exactly_its_environment_and_import_time_variables_spawn(monkeypatch):
    monkeypatch.setenv("PARENT_PID", str(os.getpid()))
    # Forked from the server (host backend): this run's variable, and the next run's absence of it.
    assert run(environment_seen, 2, env={"SYMMSYNC_PROBE_VAR": "a"}) == [("a", False, True, False)] * 2
    assert run(environment_seen, 2) == [(None, False, True, False)] * 2
    # A variable read at import reaches the ranks: they are fresh interpreters, children of this process.
    assert run(environment_seen, 2, env={"SYMMSYNC_DEBUG": "1"}) == [(None, True, True, True)] * 2
    monkeypatch.setenv("SYMMSYNC_TESTING_START", "spawn")
    assert run(environment_seen, 2, env={"SYMMSYNC_PROBE_VAR": "b"}) == [("b", False, True, True)] * 2


def one_rank_raises():
    if dist.get_rank() == 1:
        # When it raised, on the monotonic clock every process of this machine shares: the
        # test measures from here, after the ranks' start-up, however long that took.
        raise ValueError(f"planted failure on rank 1 at {time.monotonic()!r}")
    time.sleep(120)  # the others would wait for a long time: run must not


def test_a_failing_rank_stops_the_run_with_its_traceback():
    with pytest.raises(ss.RankFailure) as e:
        run(one_rank_raises, 3, timeout_s=100)
    raised_at = float(re.search(r"planted failure on rank 1 at ([0-9.]+)", str(e.value)).group(1))
    assert time.monotonic() - raised_at < 60  # not the 120 s the other ranks sleep
    assert e.value.rank == 1
    assert "planted failure on rank 1" in str(e.value)
    assert "one_rank_raises" in e.value.remote_traceback
    assert isinstance(e.value.__cause__, ValueError)


def one_rank_hangs(stamps):
    if dist.get_rank() == 0:
        time.sleep(600)
    Path(stamps, "finished").write_text(repr(time.monotonic()))  # rank 1, after its start-up
    return "done"


def test_a_hang_becomes_a_failure_naming_the_ranks_that_did_not_finish(tmp_path):
    # The run's budget counts from before the ranks start (testing.run's contract): 10 s
    # leave rank 1 room to start and finish on a loaded machine (it takes ~2 s on 2 cores).
    budget = 10
    t0 = time.monotonic()
    with pytest.raises(ss.RankFailure, match=rf"ranks \[0\] did not finish within {budget} s"):
        run(one_rank_hangs, 2, str(tmp_path), timeout_s=budget)
    stopped = time.monotonic()
    assert t0 < float((tmp_path / "finished").read_text()) < t0 + budget  # rank 1 finished in time
    assert t0 + budget <= stopped < t0 + budget + 15  # at its deadline: not before, nor long after


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


def test_a_rank_pools_failure_names_the_ranks_error_even_before_the_pools_message_arrives():
    # The pool learns of a failed run from a message its thread puts on a multiprocessing queue,
    # whose feeder may deliver it after the thread has ended: here it never arrives at all.
    from symmsync.testing import RankPool

    pool = RankPool(2, timeout_s=120)
    try:
        assert pool.call(square, 2) == [0, 4]
        results = pool._results

        class Undelivered:
            def put(self, item):
                if item[1] != "pool":
                    results.put(item)

            def get(self, timeout):
                return results.get(timeout=timeout)

        pool._results = Undelivered()
        t0 = time.monotonic()
        with pytest.raises(ss.RankFailure, match="planted failure on rank 1"):
            pool.call(fail_on_rank, 1)
        assert time.monotonic() - t0 < 60  # at once, not at the call's 120 s deadline
    finally:
        pool.close()


def test_a_function_defined_inside_another_is_refused_up_front_with_what_to_do():
    def local_fn():
        return 1

    for fn in (local_fn, lambda: 1):
        with pytest.raises(ss.ConfigError, match="define it at module level"):
            run(fn, 2)


PRINTER = """
import sys

import torch.distributed as dist
from symmsync.testing import run

def lines(n):
    dist.barrier()  # both ranks print at once
    for i in range(n):
        print(f"rank {dist.get_rank()}: line {i}", flush=True)
    dist.barrier()
    print(f"rank {dist.get_rank()}: streams {sys.stdout.line_buffering} {sys.stdout.write_through}", flush=True)

if __name__ == "__main__":
    run(lines, 2, 2000)
"""


def test_ranks_print_whole_lines_into_a_shared_pipe_even_when_python_is_unbuffered(tmp_path):
    # PYTHONUNBUFFERED makes print write the text and the newline apart; ranks sharing the
    # parent's pipe would interleave them ("rank 0: line 7rank 1: line 3\n\n").
    script = tmp_path / "printer.py"  # a file: the ranks import its function
    script.write_text(PRINTER)
    proc = python(script, timeout=120, PYTHONUNBUFFERED="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout.splitlines()
    broken = [line for line in printed if not re.fullmatch(r"rank [01]: (line \d+|streams True False)", line)]
    assert not broken, broken[:5]
    lines = sorted(f"rank {r}: line {i}" for r in (0, 1) for i in range(2000))
    assert sorted(printed) == sorted(lines + [f"rank {r}: streams True False" for r in (0, 1)])
