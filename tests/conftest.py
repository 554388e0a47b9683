"""Test configuration: host-backend tests run everywhere; GPU tests need NVIDIA GPUs; soak
tests (long runs of what a shorter test in the suite checks) run only when asked for.

Multi-rank tests go through :func:`symmsync.testing.run`, which starts one process
per rank (with ``TRITON_INTERPRET=1`` for the host backend) and fails fast when a
rank raises or hangs, or through the ``host_ranks`` fixture, host ranks kept alive
across tests for rank functions that leave their processes clean (starting processes
is most of a short multi-rank test's time). Single-process kernel tests run under the
interpreter too.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# A torch op whose returns share a storage (with an input or with each other) is an error wherever
# the environment sets CI, and elsewhere only a warning: every run of the suite holds symmsync's ops
# to the error, the ranks' processes too (they inherit the environment).
os.environ.setdefault("TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def _gpu_count() -> int:
    try:
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no driver: no GPUs
        return 0


def _soak_asked(config) -> bool:
    """``SYMMSYNC_SOAK=1`` in the environment, or a ``-m`` expression that names ``soak``."""
    return os.environ.get("SYMMSYNC_SOAK", "0") not in ("", "0") or "soak" in (config.getoption("markexpr") or "")


def pytest_collection_modifyitems(config, items):
    if not _soak_asked(config):
        soak = pytest.mark.skip(
            reason="a soak (a long run; a shorter test in this suite checks the same behaviour): "
            "run `make test-soak` (pytest -m soak), or set SYMMSYNC_SOAK=1 to run it with the rest"
        )
        for item in items:
            if "soak" in item.keywords:
                item.add_marker(soak)
    n = _gpu_count()
    if n >= 1:
        _skip_traps_under_mps(items)
    if n >= 2 or (n >= 1 and os.environ.get("SYMMSYNC_SHARE_GPUS", "0") not in ("", "0")):
        return  # with SYMMSYNC_SHARE_GPUS=1 the ranks of a GPU test share one GPU (a smoke run)
    reason = (
        f"needs 2 NVIDIA GPUs, found {n}: run `make test-gpu` on a multi-GPU machine (docs/gpu.md). "
        "The host backend in this suite runs the same protocols (buffers, views, fences, signals, collectives, "
        "the PCP writer, aborts and timeouts) with symmsync's kernels in Triton's interpreter, one program after "
        "another, on POSIX shared memory. It does not run what needs a GPU: the compiled kernels' instructions "
        "and memory ordering (tests/tooling/test_sm90_compile.py reads their PTX), the cuLaunchKernel fast path "
        "(tests/core/test_fence.py packs for it against a stub), CUDA-graph capture and replay, a trap's error "
        "at synchronize(), grid_sync over more than one program, overlap() on a side stream (on the host: "
        "arrive(), the body, wait()), and device memory (cuMem handles, peer access, runtime-allocated memory)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


def _skip_traps_under_mps(items) -> None:
    """Under a running MPS daemon, skip the GPU tests marked ``traps``: the server hands a trap in
    one client's kernel to every client of that GPU, so the peers that should report it die of it."""
    from symmsync.backends import mps

    if not mps.running():
        return
    skip = pytest.mark.skip(
        reason="a rank's kernel traps by design, and under MPS the server hands that trap to every client of the "
        "GPU (the peers that should report it fail with 'unspecified launch failure'): run it without an MPS "
        "daemon; `make test-gpu-shared` does so after stopping the daemon (pytest -m 'gpu and traps')"
    )
    for item in items:
        if "traps" in item.keywords and "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    """Each test that takes it runs on the host backend everywhere, and on the CUDA
    backend where 2 GPUs are present (marked ``gpu``: skipped with the reason elsewhere)."""
    return request.param


@pytest.fixture(scope="session")
def host_ranks():
    """``host_ranks(fn, world, *args, timeout_s=..., env=None)``: ``fn(*args)`` on ``world`` host-backend
    ranks that stay alive across the tests taking this fixture (one :class:`symmsync.testing.RankPool`
    per world and environment ``env``, e.g. the simulated nodes' ``SYMMSYNC_NODE_SIZE``, started on
    first use and again after a failure closed it), so that those tests do not each pay for starting
    processes (most of a short multi-rank test's time on a 2-core machine).

    For rank functions that leave their process as they found it: they close every buffer they
    make, and plant no failure they do not take back, set no environment and kill no rank (those
    take :func:`symmsync.testing.run`, a fresh process per rank)."""
    from symmsync.testing import RankFailure, RankPool

    pools = {}

    def call(fn, world, *args, timeout_s=300, env=None, **kwargs):
        key = (world, tuple(sorted((env or {}).items())))
        if key not in pools:
            pools[key] = RankPool(world, timeout_s=timeout_s, env=env)
        try:
            return pools[key].call(fn, *args, timeout_s=timeout_s, **kwargs)
        except RankFailure:
            pools.pop(key).close(kill=True)  # a failed pool stays closed: the next call starts a fresh one
            raise

    yield call
    for pool in pools.values():
        pool.close()


class SharedPool:
    """One of :func:`host_ranks`' pools behind a :class:`symmsync.testing.RankPool`'s ``call``, for a
    module whose tests share ranks (``pool.call(fn, *args, timeout_s=...)``)."""

    def __init__(self, host_ranks, world, env, timeout_s):
        self._host_ranks, self.world_size, self._env, self._timeout_s = host_ranks, world, env, timeout_s

    def call(self, fn, *args, timeout_s=None, **kwargs):
        return self._host_ranks(
            fn, self.world_size, *args, timeout_s=timeout_s or self._timeout_s, env=self._env, **kwargs
        )


@pytest.fixture(scope="session")
def shared_pool(host_ranks):
    """``shared_pool(world, env=None, timeout_s=300)``: :func:`host_ranks`' pool of that world and
    environment as an object with :meth:`symmsync.testing.RankPool.call`, for a module's ``pool``."""

    def make(world, env=None, timeout_s=300):
        return SharedPool(host_ranks, world, env, timeout_s)

    return make
