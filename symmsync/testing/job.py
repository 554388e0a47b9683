""":func:`~symmsync.testing.run` inside a torchrun job: the ranks exist already, so ``fn`` runs in
this process, and the group :func:`~symmsync.testing.run` initialized is left together at exit."""

from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .env import _environ, sharing_env, sharing_gpus


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
        from ..backends.mode import kernels_interpreted

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
