"""Run a function on N ranks (one process each) and collect every rank's result.

This is how symmsync's own tests run, and how users test their kernels on a machine
without GPUs::

    import symmsync as ss
    from symmsync.testing import run

    def exchange(n):
        buf = ss.SymmetricBuffer(n, backend="host")
        ...
        return buf.rank

    assert run(exchange, 4, 1024) == [0, 1, 2, 3]

Each rank is a fresh process (``spawn``) with torch.distributed initialized (gloo
for the host backend, NCCL with one GPU per rank for CUDA) and, for the host
backend, ``TRITON_INTERPRET=1`` set before anything imports Triton. The first rank
that raises stops the run: the others are killed and :class:`~symmsync.RankFailure`
carries that rank's traceback. A run that outlives ``timeout_s`` is killed and
names the ranks that never finished, so a deadlock fails fast instead of hanging.
Fault tests name the ranks that are meant to die (``may_die``): those may exit
without a result while the others run on and report.

Inside a ``torchrun`` job the ranks already exist: there :func:`run` starts no
process, calls ``fn`` in this one (initializing torch.distributed from torchrun's
environment first, where nothing did) and returns every rank's result, so the same
script runs as ``python script.py`` and as ``torchrun --nproc-per-node N script.py``.
Print from :func:`is_main_process` only, so that such a script prints once::

    results = run(exchange, 2, 1024)
    if is_main_process():
        print(results)
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import glob
import os
import pickle
import queue
import secrets
import shutil
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

from .checks import positive_int_problem
from .errors import ConfigError, RankFailure

DEFAULT_TIMEOUT_S = 180.0
"""Default time budget of a whole :func:`run`, in seconds."""

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
"""The environment torchrun (torch.distributed.run) gives every process it starts."""

_env_lock = threading.Lock()


@dataclass(frozen=True)
class Died:
    """The entry :func:`run` returns for a rank of ``may_die`` that exited without a result.

    Attributes:
        rank: the rank.
        exitcode: its process's exit code (negative: killed by that signal, e.g. -9).
    """

    rank: int
    exitcode: int


def under_torchrun() -> bool:
    """True in a process that torchrun (``torch.distributed.run``) started as one of its ranks.

    Read from the environment torchrun sets for every rank (:data:`TORCHRUN_ENV`).
    """
    return all(k in os.environ for k in TORCHRUN_ENV)


def is_main_process() -> bool:
    """True where a script should print its results: outside torchrun, or on torchrun's rank 0.

    The processes :func:`run` spawns are not torchrun ranks; the script that called
    :func:`run` prints what it returned.
    """
    return not under_torchrun() or os.environ["RANK"] == "0"


def sharing_gpus() -> bool:
    """True when ``SYMMSYNC_SHARE_GPUS=1``: :func:`run` puts ranks on the GPUs there are,
    several per GPU (a smoke run on one GPU; docs/gpu.md)."""
    return os.environ.get("SYMMSYNC_SHARE_GPUS", "0") not in ("", "0")


@contextlib.contextmanager
def mps(pipe_dir: str | None = None, log_dir: str | None = None) -> Iterator[Any]:
    """An MPS daemon for the block, so that ranks sharing a GPU run at the same time
    (:func:`symmsync.backends.mps.daemon`: the one answering, or a new one it stops at the end,
    also after a failure), named in ``os.environ`` inside the block (restored after it), so that
    the ranks :func:`run` starts there are its clients::

        os.environ["SYMMSYNC_SHARE_GPUS"] = "1"
        with mps():
            run(fn, 8, backend="cuda")  # 8 ranks on one GPU, each on 100 // 8 percent of its SMs
    """
    from .backends.mps import daemon

    with daemon(pipe_dir, log_dir) as d, _environ(d.env):
        yield d


_said_time_sliced = []


def sharing_env(world_size: int, gpus: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables :func:`run` adds for ``world_size`` ranks sharing ``gpus`` GPUs: under a
    running MPS daemon (the one ``env``, then this process's environment, names), each rank's SM
    share ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = 100 // ranks per GPU, unless ``env`` or this
    process sets it already (an override); without a daemon, none, and a ``RuntimeWarning``,
    once per process, that the GPU time-slices the ranks."""
    from .backends import mps as _mps

    merged = {**os.environ, **(env or {})}
    if not _mps.running(merged):
        if not _said_time_sliced:
            _said_time_sliced.append(True)
            warnings.warn(
                "symmsync.testing: ranks share a GPU without an MPS daemon, so the GPU time-slices them and no "
                "two ranks' kernels run at once; start one to run them concurrently (symmsync.testing.mps(), "
                "`python -m symmsync mps start`; docs/gpu.md)",
                RuntimeWarning,
                stacklevel=3,
            )
        return {}
    if _mps.SHARE_ENV in merged:
        return {}
    per_gpu = -(-world_size // max(1, gpus))
    return {_mps.SHARE_ENV: str(_mps.thread_percentage(per_gpu))}


def run(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "host",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
    dist_backend: str | None = None,
    may_die: Collection[int] = (),
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results.

    Args:
        fn: a module-level (picklable) function. Inside it, ``torch.distributed`` is
            initialized; ``torch.distributed.get_rank()`` gives the rank.
        world_size: number of ranks (processes).
        backend: ``"host"`` (gloo, CPU, Triton interpreter) or ``"cuda"`` (NCCL,
            GPU ``rank`` per process; needs ``world_size`` GPUs). With
            ``SYMMSYNC_SHARE_GPUS=1`` in the environment, ranks share the GPUs there are
            (rank ``r`` on GPU ``r % count``, gloo by default, since NCCL refuses two
            ranks on one GPU): multi-rank code on one GPU, without NVLink. Under a
            running MPS daemon (:func:`mps`) their kernels run at the same time, and each
            rank gets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = 100 // ranks per GPU unless
            ``env`` or this process sets it; without one the GPU time-slices the ranks
            (said once, as a ``RuntimeWarning``).
        timeout_s: budget for the whole run, start-up included.
        env: extra environment variables for the ranks.
        dist_backend: torch.distributed backend (default: gloo for host, NCCL for cuda;
            gloo with cuda keeps collectives on the CPU, e.g. for tests that stop a GPU).
        may_die: ranks that may exit without a result (fault tests: a rank that kills
            itself). The run goes on while the other ranks work; such a rank's entry in
            the result is a :class:`Died` with its exit code. A rank of ``may_die`` that
            raises still stops the run, and so does any other rank that dies.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        RankFailure: a rank raised (its traceback is in the message), died (and was
            not in ``may_die``), or the run timed out (the message names the ranks
            that had not finished).
        ConfigError: a bad argument; under torchrun, also a job whose ``WORLD_SIZE``
            is not ``world_size``, or ``may_die``.

    When the run ends, any shared-memory segment of the run's name prefix still in
    ``/dev/shm`` (a rank killed while it allocated had no chance to unlink it) is removed.

    Under torchrun (:func:`under_torchrun`), this process is one of the ranks: ``fn``
    runs here and the results of every rank come back on every rank (through
    ``all_gather_object``). torch.distributed is initialized from torchrun's
    environment if nothing initialized it (``dist_backend``, default gloo for host
    and NCCL for cuda, where the CUDA device is set to ``LOCAL_RANK``) and stays
    initialized for later calls. ``timeout_s`` bounds each collective; an exception
    in ``fn`` propagates as is, and torchrun stops the other ranks. ``env`` is set in
    this process for the call; a variable read at import (``TRITON_INTERPRET``) must
    be set before Python starts instead.
    """
    if backend not in ("host", "cuda"):
        raise ConfigError(f"testing.run: backend must be 'host' or 'cuda', got {backend!r}")
    dist_backend = dist_backend or ("gloo" if backend == "host" or sharing_gpus() else "nccl")
    problem = positive_int_problem("world_size", world_size)
    if problem is not None:
        raise ConfigError(f"testing.run: {problem}")
    dying = set(may_die)
    if not dying <= set(range(world_size)):
        raise ConfigError(f"testing.run: may_die={sorted(dying)!r} names ranks outside 0..{world_size - 1}")
    if under_torchrun():
        if dying:
            raise ConfigError("testing.run: may_die needs ranks that run() starts itself; not under torchrun")
        return _run_in_job(fn, world_size, args, kwargs, backend, dist_backend, timeout_s, env or {})
    name = getattr(fn, "__qualname__", "")
    if "<locals>" in name or "<lambda>" in name:
        raise ConfigError(
            f"testing.run: fn {name!r} is a lambda or is defined inside a function; each rank is a new "
            "process that imports fn by name, so define it at module level"
        )
    ctx = mp.get_context("spawn")
    results: queue.Queue = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="symmsync-run-")
    prefix = f"symmsync-t{secrets.token_hex(4)}"
    child_env = {
        "SYMMSYNC_SHM_PREFIX": prefix,
        "TRITON_INTERPRET": "1" if backend == "host" else "0",
        **(env or {}),
    }
    prefix = child_env["SYMMSYNC_SHM_PREFIX"]  # env may set it
    if backend == "cuda" and sharing_gpus():
        import torch

        child_env.update(sharing_env(world_size, torch.cuda.device_count(), env or {}))
    procs = []
    deadline = time.monotonic() + timeout_s
    try:
        with _env_lock, _environ(child_env):  # spawn copies os.environ at start: for the children only
            for rank in range(world_size):
                p = ctx.Process(
                    target=_rank_main,
                    args=(
                        fn,
                        rank,
                        world_size,
                        backend,
                        dist_backend,
                        os.path.join(tmp, "store"),
                        timeout_s,
                        results,
                        args,
                        kwargs,
                    ),
                    name=f"symmsync-rank{rank}",
                    daemon=True,
                )
                p.start()
                procs.append(p)
        return _collect(procs, results, world_size, deadline, timeout_s, dying)
    except BaseException:
        _kill(procs)
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
        _kill(procs)
        _remove_segments(prefix)
        shutil.rmtree(tmp, ignore_errors=True)


def _run_in_job(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    kwargs: dict,
    backend: str,
    dist_backend: str,
    timeout_s: float,
    env: dict[str, str],
) -> list[Any]:
    """:func:`run` inside a torchrun job: this process is rank ``RANK`` of ``WORLD_SIZE``."""
    import torch
    import torch.distributed as dist

    rank, job_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if job_world != world_size:
        raise ConfigError(
            f"testing.run: rank {rank}: asked for {world_size} ranks, but torchrun started {job_world} "
            f"(WORLD_SIZE={job_world}); run with `torchrun --nproc-per-node {world_size}` or pass "
            f"world_size={job_world}"
        )
    if backend == "host":
        from .backends.mode import kernels_interpreted

        if not kernels_interpreted():
            raise ConfigError(
                f"testing.run: rank {rank}: backend='host' needs Triton's interpreter, which is off in this "
                "process (a GPU is visible, or TRITON_INTERPRET=0): start the job as "
                "`TRITON_INTERPRET=1 torchrun ...`, or use backend='cuda'"
            )
    if not dist.is_initialized():
        extra = {}
        if backend == "cuda":
            local = int(os.environ["LOCAL_RANK"])
            if sharing_gpus():
                gpus = torch.cuda.device_count()
                if not torch.cuda.is_initialized():  # the share is read when the CUDA context is made
                    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
                    os.environ.update(sharing_env(local_world, gpus, env))
                local %= gpus
            torch.cuda.set_device(local)
            if dist_backend == "nccl":
                extra["device_id"] = torch.device("cuda", local)
        dist.init_process_group(
            dist_backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s), **extra
        )
        atexit.register(_leave_job)
        dist.barrier()  # every rank's group is up before any rank runs fn (as in the ranks run() starts)
    try:
        with _environ(env):
            value = fn(*args, **kwargs)
    except BaseException:
        _job_state["failed"] = True  # the peers may be stuck: leave without a last barrier
        raise
    out: list[Any] = [None] * job_world
    dist.all_gather_object(out, value)
    return out


_job_state = {"failed": False}


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``env`` inside the block, restored after it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _leave_job() -> None:
    """At exit of a torchrun rank whose group run() created: meet every rank, then destroy it.

    The barrier keeps a rank that finished first from tearing down its connections (rank 0
    also the job's store) while a peer still uses them. Not after ``fn`` raised: its peers
    may never come, and torchrun stops them anyway.
    """
    import gc

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    # Buffers, views and fences that only a reference cycle keeps hold the group; collect
    # them now, so that the group really goes here, not in the interpreter's teardown
    # (where, in about one torchrun job in five, its teardown aborted the process with
    # "terminate called without an active exception" after the job's work was done).
    gc.collect()
    if not _job_state["failed"]:
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - at exit, a peer already gone must not raise
            pass
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class RankPool:
    """``world_size`` ranks kept alive across calls: :meth:`call` runs a function on all.

    For many short multi-rank checks (property tests), where starting processes
    for each would cost more than the check. The same failure rules as :func:`run`
    apply per call; after a failure the pool is closed and further calls raise.

    Example::

        with RankPool(2) as pool:
            for n in (0, 1, 100):
                assert pool.call(exchange, n) == [...]
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "host",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        env: dict[str, str] | None = None,
        dist_backend: str | None = None,
    ):
        if under_torchrun():
            raise ConfigError("testing.RankPool starts its own ranks; inside a torchrun job call run() instead")
        self.world_size = world_size
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._closed = False
        # The pool's ranks run _pool_main through run(), in a background thread, so that
        # start-up, environment and cleanup are exactly run()'s.
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run,
            daemon=True,
            args=(world_size, backend, env, dist_backend),
        )
        self._thread.start()

    def _run(self, world_size, backend, env, dist_backend) -> None:
        try:
            run(
                _pool_main,
                world_size,
                self._tasks,
                self._results,
                backend=backend,
                timeout_s=7 * 24 * 3600.0,
                env=env,
                dist_backend=dist_backend,
            )
        except BaseException as e:  # noqa: BLE001 - reported by the next call
            self._error = e
            self._results.put((-1, "pool", None))

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; the results in rank order."""
        if self._closed:
            raise RankFailure("testing.RankPool: the pool is closed (a rank failed earlier, or close() was called)")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        out: dict[int, Any] = {}
        while len(out) < self.world_size:
            remaining = deadline - time.monotonic()
            try:
                rank, status, payload = self._results.get(timeout=max(0.01, min(0.5, remaining)))
            except queue.Empty:
                if not self._thread.is_alive() and self._error is not None:
                    # the ranks' run failed: its message to the queue may not have been delivered yet
                    self._raise_failure()
                if remaining <= 0 or not self._thread.is_alive():
                    missing = [r for r in range(self.world_size) if r not in out]
                    self.close(kill=True)
                    raise RankFailure(
                        f"testing.RankPool: ranks {missing} did not finish the call within "
                        f"{timeout_s or self.timeout_s:.0f} s",
                        rank=missing[0],
                    ) from self._error
                continue
            if status == "ok":
                out[rank] = pickle.loads(payload)
                continue
            self._raise_failure()
        return [out[r] for r in range(self.world_size)]

    def _raise_failure(self) -> None:
        """The ranks' run failed (a rank raised or died): stop the pool, raise what the run raised."""
        self.close(kill=True)
        self._thread.join(timeout=30)
        if isinstance(self._error, RankFailure):
            raise self._error
        raise RankFailure("testing.RankPool: a rank failed") from self._error

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for q in self._tasks:
            q.put(None)
        if not kill:
            self._thread.join(timeout=60)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _pool_main(tasks, results) -> None:  # pragma: no cover - runs in children
    import torch.distributed as dist

    rank = dist.get_rank()
    while True:
        task = tasks[rank].get()
        if task is None:
            return
        fn, args, kwargs = task
        value = fn(*args, **kwargs)  # an exception ends the rank; run() reports it
        results.put((rank, "ok", pickle.dumps(value)))


def _collect(
    procs: list, results: queue.Queue, world_size: int, deadline: float, timeout_s: float, dying: set[int]
) -> list[Any]:
    out: dict[int, Any] = {}
    exited: set[int] = set()  # ranks seen exited without a result at an earlier empty poll
    while len(out) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = [r for r in range(world_size) if r not in out]
            raise RankFailure(
                f"testing.run: ranks {missing} did not finish within {timeout_s:.0f} s "
                "(a hang: a collective or a wait that some rank never joined?)",
                rank=missing[0],
            )
        try:
            rank, status, payload = results.get(timeout=min(0.2, remaining))
        except queue.Empty:
            for r, p in enumerate(procs):
                if r not in out and p.exitcode is not None:
                    # A rank flushes its result into the queue before it exits (_rank_main joins the
                    # queue's feeder), but it may have exited between this poll and the check: its
                    # result is missing once a whole poll after the exit was seen found nothing.
                    if r in exited:
                        if r in dying:
                            out[r] = Died(r, p.exitcode)
                            continue
                        raise RankFailure(
                            f"testing.run: rank {r} exited with code {p.exitcode} without a result "
                            '(killed or crashed in native code? If its stderr shows "Can\'t get attribute", '
                            "define fn at module level, outside `if __name__ == '__main__':`)",
                            rank=r,
                        ) from None
                    exited.add(r)
            continue
        if status == "ok":
            out[rank] = pickle.loads(payload)
            continue
        kind, message, tb, exc_bytes = payload
        cause = None
        if exc_bytes is not None:
            try:
                cause = pickle.loads(exc_bytes)
            except Exception:  # noqa: BLE001 - the text below still says everything
                cause = None
        raise RankFailure(
            f"testing.run: rank {rank} raised {kind}: {message}\n--- rank {rank} traceback ---\n{tb}",
            rank=rank,
            remote_traceback=tb,
        ) from cause
    return [out[r] for r in range(world_size)]


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _remove_segments(prefix: str) -> None:
    """Unlink shared-memory segments that killed ranks had no chance to unlink."""
    for path in glob.glob(f"/dev/shm/{prefix}-*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def _rank_main(
    fn, rank, world_size, backend, dist_backend, store, timeout_s, results, args, kwargs
) -> None:  # pragma: no cover - runs in children
    import torch
    import torch.distributed as dist

    # Whole lines, at once: ranks share the parent's stdout and stderr, and an unbuffered
    # stream (PYTHONUNBUFFERED) writes a print's text and its newline apart, so lines interleave.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=False)
    try:
        extra = {}
        if backend == "cuda":
            gpu = rank % torch.cuda.device_count() if sharing_gpus() else rank
            torch.cuda.set_device(gpu)
            if dist_backend == "nccl":
                extra["device_id"] = torch.device("cuda", gpu)
        dist.init_process_group(
            dist_backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **extra,
        )
        # Every rank's group is up before any rank runs fn: a rank that leaves early (one of
        # may_die that kills itself, one that raises) would otherwise close its connections
        # while a peer still connects to it (gloo's connectFullMesh failing on that peer).
        dist.barrier()
        value = fn(*args, **kwargs)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        try:
            exc_bytes = pickle.dumps(e)
        except Exception:  # noqa: BLE001
            exc_bytes = None
        results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc(), exc_bytes)))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer already gone must not mask the result
            pass
        results.close()
        results.join_thread()
