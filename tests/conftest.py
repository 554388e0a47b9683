"""Test configuration: host-backend tests run everywhere; GPU tests need NVIDIA GPUs.

Multi-rank tests go through :func:`symmsync.testing.run`, which starts one process
per rank (with ``TRITON_INTERPRET=1`` for the host backend) and fails fast when a
rank raises or hangs. Single-process kernel tests run under the interpreter too.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def _gpu_count() -> int:
    try:
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no driver: no GPUs
        return 0


def pytest_collection_modifyitems(config, items):
    n = _gpu_count()
    if n >= 2 or (n >= 1 and os.environ.get("SYMMSYNC_SHARE_GPUS", "0") not in ("", "0")):
        return  # with SYMMSYNC_SHARE_GPUS=1 the ranks of a GPU test share one GPU (a smoke run)
    reason = (
        f"needs 2 NVIDIA GPUs, found {n}: run `make test-gpu` on a multi-GPU machine "
        "(docs/gpu.md); the same behaviours run on the host backend in this suite"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    """Each test that takes it runs on the host backend everywhere, and on the CUDA
    backend where 2 GPUs are present (marked ``gpu``: skipped with the reason elsewhere)."""
    return request.param
