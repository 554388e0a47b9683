"""The processes :func:`~symmsync.testing.run` starts, one per rank, and how it collects their
results: the first failure stops the run, a run past its budget names the ranks that never finished."""

from __future__ import annotations

import atexit
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
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

from ..checks import positive_int_problem
from ..errors import ConfigError, RankFailure
from .env import _environ, sharing_env, sharing_gpus, under_torchrun
from .job import _run_in_job

DEFAULT_TIMEOUT_S = 180.0
"""Default time budget of a whole :func:`run`, in seconds."""

_env_lock = threading.Lock()

#: What a host-backend run's ranks find imported when they start (see :func:`_start_context`).
PRELOAD = ("numpy", "torch", "torch.distributed", "triton", "symmsync", "symmsync.collectives", "symmsync.pcp")
#: Variables read when a module is imported (by Triton, torch, symmsync's debug switch): a run
#: whose ``env`` sets one starts its ranks as fresh interpreters, which import under it.
IMPORT_TIME = ("TRITON_", "TORCH_", "PYTORCH_", "OMP_", "MKL_", "CUDA_", "NCCL_", "SYMMSYNC_DEBUG")
#: ``SYMMSYNC_TESTING_START=spawn``: every run's ranks as fresh interpreters (the slower, plainer way).
START_ENV = "SYMMSYNC_TESTING_START"
_server_env: list[dict[str, str]] = []  # the import-time variables the fork server started with


def _import_time(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_TIME)}


def _start_context(backend: str, env: dict[str, str], environ: dict[str, str]) -> tuple[Any, bool]:
    """How this run starts its ranks: ``(context, forked)``.

    A host-backend rank spends most of a short run importing torch, Triton and symmsync. So its
    ranks are forked from one server process that imported :data:`PRELOAD` once, under the
    environment of the run that started it (``TRITON_INTERPRET=1``), each rank then setting its
    run's whole environment before it runs ``fn``. A variable read at import cannot reach a rank
    that way: a run whose ``env`` sets one (:data:`IMPORT_TIME`), or whose import-time variables
    differ from the server's, spawns fresh interpreters instead, as the CUDA backend always does."""
    if backend != "host" or os.environ.get(START_ENV, "") == "spawn" or not hasattr(os, "fork"):
        return mp.get_context("spawn"), False
    if any(k.startswith(IMPORT_TIME) and k != "TRITON_INTERPRET" for k in env):
        return mp.get_context("spawn"), False
    wanted = _import_time(environ)
    if _server_env and _server_env[0] != wanted:
        return mp.get_context("spawn"), False
    ctx = mp.get_context("forkserver")
    if not _server_env:
        ctx.set_forkserver_preload(list(PRELOAD))
        _server_env.append(wanted)  # the server starts with the first rank, under this environment
    return ctx, True


@dataclass(frozen=True)
class Died:
    """The entry :func:`run` returns for a rank of ``may_die`` that exited without a result.

    Attributes:
        rank: the rank.
        exitcode: its process's exit code (negative: killed by that signal, e.g. -9).
    """

    rank: int
    exitcode: int


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
            environ = dict(os.environ)
            ctx, forked = _start_context(backend, env or {}, environ)
            results: queue.Queue = ctx.Queue()
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
                        environ if forked else None,
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
    fn, rank, world_size, backend, dist_backend, store, timeout_s, results, args, kwargs, environ=None
) -> None:  # pragma: no cover - runs in children
    if environ is not None:  # forked from the server: this run's environment, exactly
        os.environ.clear()
        os.environ.update(environ)
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
        if environ is not None:  # a forked process leaves by os._exit: run what a normal exit runs
            atexit._run_exitfuncs()
