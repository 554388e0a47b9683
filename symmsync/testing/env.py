"""What :mod:`symmsync.testing` reads from the environment and sets there: torchrun's variables,
ranks that share GPUs, and the MPS daemon that lets ranks sharing a GPU run at the same time."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
"""The environment torchrun (torch.distributed.run) gives every process it starts."""


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
    from ..backends.mps import daemon

    with daemon(pipe_dir, log_dir) as d, _environ(d.env):
        yield d


_said_time_sliced = []


def sharing_env(world_size: int, gpus: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables :func:`run` adds for ``world_size`` ranks sharing ``gpus`` GPUs: under a
    running MPS daemon (the one ``env``, then this process's environment, names), each rank's SM
    share ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = 100 // ranks per GPU, unless ``env`` or this
    process sets it already (an override); without a daemon, none, and a ``RuntimeWarning``,
    once per process, that the GPU time-slices the ranks."""
    from ..backends import mps as _mps

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
