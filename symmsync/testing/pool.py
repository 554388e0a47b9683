""":class:`RankPool`: ranks kept alive across calls, started (and stopped) through
:func:`~symmsync.testing.run`, for many short multi-rank checks."""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from ..errors import ConfigError, RankFailure
from .env import under_torchrun
from .ranks import DEFAULT_TIMEOUT_S, run


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
