"""Diagnose the machine: versions, GPUs, peer access, and which backends work here.

A backend "works" only after the doctor allocated a small buffer on it and fenced on it
(:func:`allocate_and_fence`, one rank); what the checks before that find missing is
reported without trying.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata

from ..backends import mps

#: The size of the buffer the doctor allocates on each backend it tries.
PROBE_BYTES = 4096


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _host_backend() -> tuple[bool, str]:
    try:
        import _posixshmem  # noqa: F401
    except ImportError as e:
        return False, f"no POSIX shared memory in this Python ({e})"
    if os.path.isdir("/dev/shm"):
        free = shutil.disk_usage("/dev/shm").free
        if free < 64 << 20:
            return False, f"/dev/shm has only {free >> 20} MiB free"
    try:
        import numpy  # noqa: F401 - the interpreter needs it
        import triton  # noqa: F401
    except ImportError as e:
        return False, f"Triton's interpreter is unavailable: {e}"
    return True, "POSIX shared memory + Triton interpreter (TRITON_INTERPRET=1)"


def allocate_and_fence(backend: str) -> tuple[bool, str]:
    """Allocate a :data:`PROBE_BYTES` buffer on ``backend`` as a group of one rank, write it,
    fence on it and close it, in this process: ``(True, "")``, or ``(False, what failed)``.

    Makes the one-rank group itself (gloo, an in-process store) when torch.distributed is not
    initialized, and destroys it afterwards; a process that is a rank of a larger group is not
    probed (the allocation is a collective of every rank).
    """
    import torch
    import torch.distributed as dist

    from ..core.buffer import SymmetricBuffer
    from ..core.fence import Fence

    own_group = not dist.is_initialized()
    if not own_group and dist.get_world_size() != 1:
        return False, f"not probed: this process is a rank of a group of {dist.get_world_size()}; run the doctor alone"
    step = "making a one-rank process group"
    try:
        if own_group:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        step = f"allocating a {PROBE_BYTES}-byte buffer"
        buf = SymmetricBuffer(PROBE_BYTES, backend=backend)
        try:
            step = "fencing on it"
            words = buf.tensor(0, (4,), torch.int64)
            words.fill_(7)
            fence = Fence(buf.view([0]))
            fence.fence()
            if fence.epoch != 1 or words.tolist() != [7] * 4:
                return False, f"a fence on one rank left epoch {fence.epoch} and words {words.tolist()}"
        finally:
            buf.close()
    except Exception as e:  # noqa: BLE001 - whatever failed, the report says it
        return False, f"{step} failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()
    return True, ""


def _try(backend: str) -> tuple[bool, str]:
    # symmsync compiles or interprets its kernels once per process (backends/mode.py): the host
    # backend needs them interpreted, the cuda backend compiled. A backend this process
    # cannot run is tried in a child process that can.
    from ..backends import mode

    interpreted = backend == "host"
    if mode.kernels_interpreted() == interpreted:
        return allocate_and_fence(backend)
    env = dict(os.environ, TRITON_INTERPRET="1" if interpreted else "0")
    code = f"import json, symmsync.tools.doctor as d; print(json.dumps(d.allocate_and_fence({backend!r})))"
    where = f"a process with TRITON_INTERPRET={env['TRITON_INTERPRET']}"
    try:
        child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"{where} could not run: {e}"
    try:
        ok, why = json.loads(child.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False, f"{where} failed: {(child.stderr.strip().splitlines() or ['no output'])[-1]}"
    return bool(ok), why


def _backend_line(name: str, ok: bool, why: str) -> tuple[bool, str]:
    """Try ``name`` when its checks passed: ``(works, the report's line)``."""
    if ok:
        ok, failure = _try(name)
        if ok:
            why = f"{why}; a {PROBE_BYTES}-byte buffer allocated and fenced on"
        else:
            why = f"{why}, but {failure}"
    return ok, f"  {name:<5} {'works' if ok else 'unavailable'}: {why}"


def _interpreter_note() -> str:
    from ..backends import mode

    if mode.INTERPRETER_AUTO:
        return " (set by import symmsync: torch sees no CUDA device)"
    return ""


def _cuda_section(lines: list[str]) -> tuple[bool, str]:
    import torch

    from ..backends.driver import check, driver
    from ..errors import BackendError

    try:
        drv = driver()
    except BackendError as e:
        return False, str(e)
    try:
        res = drv.cuInit(0)
    except Exception as e:  # noqa: BLE001 - no driver library at all
        return False, f"no NVIDIA driver: {str(e).splitlines()[0]}"
    try:
        check(res, "cuInit")
    except BackendError as e:
        return False, str(e)
    err, ver = drv.cuDriverGetVersion()
    lines.append(f"CUDA driver API  {ver // 1000}.{ver % 1000 // 10}")
    lines.append(f"torch CUDA       {torch.version.cuda}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    lines.append(f"GPUs             {n}")
    attr = drv.CUdevice_attribute
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        _, dev = drv.cuDeviceGet(i)
        flags = []
        for label, a in (
            ("VMM", attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED),
            ("posix_fd", attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED),
            ("fabric", getattr(attr, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED", None)),
        ):
            if a is None:
                continue
            e, v = drv.cuDeviceGetAttribute(a, dev)
            flags.append(f"{label}={'yes' if e == drv.CUresult.CUDA_SUCCESS and v else 'no'}")
        lines.append(
            f"  cuda:{i}  {props.name}, {props.total_memory >> 30} GiB, sm_{props.major}{props.minor}, "
            + ", ".join(flags)
        )
    if n > 1:
        lines.append("peer access (row can access column):")
        lines.append("        " + " ".join(f"{j:>3}" for j in range(n)))
        for i in range(n):
            row = " ".join(
                "  -" if i == j else ("yes" if torch.cuda.can_device_access_peer(i, j) else " no") for j in range(n)
            )
            lines.append(f"  {i:>4}  {row}")
        if shutil.which("nvidia-smi"):
            try:
                topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
                lines.append("nvidia-smi topo -m:")
                lines.extend("  " + line for line in topo.stdout.rstrip().splitlines())
            except (OSError, subprocess.SubprocessError) as e:
                lines.append(f"nvidia-smi topo -m failed: {e}")
    if n == 0:
        return False, "torch sees no CUDA device"
    if n == 1:
        return True, (
            "one GPU: one rank per GPU works, and so do several ranks sharing it "
            "(SYMMSYNC_SHARE_GPUS=1; at the same time only under MPS: see the MPS line)"
        )
    peers = all(torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j)
    if not peers:
        return False, "some GPU pairs have no peer access: direct peer stores need P2P (NVLink or PCIe P2P)"
    return True, "cuMemCreate + shareable handles, peers mapped with cuMemSetAccess"


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no driver: no GPUs
        return 0


def mps_line(gpus: int, probe=None) -> str:
    """Whether ranks sharing a GPU can run at the same time here, and how.

    With a GPU, an MPS control program and no daemon answering, the doctor starts one in private
    folders and stops it again (``probe``, default :func:`_start_and_stop`): "startable" is said
    only after both worked."""
    run_line = "run them as `SYMMSYNC_SHARE_GPUS=1 python -m symmsync mps run -- python JOB.py` (docs/gpu.md)"
    program = mps.control_program()
    if program is None or gpus == 0 or mps.running():
        return mps.describe()
    try:
        (probe or _start_and_stop)()
    except Exception as e:  # noqa: BLE001 - reported: what failed, the start or the stop
        return f"available ({program}) but {e}; ranks sharing a GPU time-slice it"
    return (
        f"startable (a daemon started and stopped in private folders): {gpus} GPU(s) can each run several ranks at "
        f"the same time; {run_line}"
    )


def _start_and_stop() -> None:
    """Start an MPS daemon in new folders, stop it, remove the folders; what failed, as a ConfigError."""
    import tempfile

    from ..errors import ConfigError

    with tempfile.TemporaryDirectory(prefix="symmsync-doctor-mps-") as folder:
        pipe, log = os.path.join(folder, "pipe"), os.path.join(folder, "log")
        try:
            mps.start(pipe, log)
        except ConfigError as e:
            raise ConfigError(f"a daemon did not start: {e}") from e
        try:
            mps.stop(pipe, log)
        except ConfigError as e:
            raise ConfigError(f"the daemon started but did not stop: {e} (stop it: echo quit | {mps.CONTROL})") from e


def report() -> tuple[str, bool]:
    """The doctor's text and whether at least one backend works here."""
    lines = [
        "symmsync doctor",
        f"python           {platform.python_version()} ({platform.machine()}, {platform.system()})",
        f"symmsync         {_version('symmsync')}",
        f"torch            {_version('torch')}",
        f"triton           {_version('triton')}",
        f"cuda-python      {_version('cuda-python')} (cuda-bindings {_version('cuda-bindings')})",
        f"numpy            {_version('numpy')}",
        f"TRITON_INTERPRET {os.environ.get('TRITON_INTERPRET', '(unset)')}{_interpreter_note()}",
    ]
    host_ok, host_why = _host_backend()
    cuda_ok, cuda_why = _cuda_section(lines)
    lines.append(f"MPS              {mps_line(_gpus())}")
    host_ok, host_line = _backend_line("host", host_ok, host_why)
    cuda_ok, cuda_line = _backend_line("cuda", cuda_ok, cuda_why)
    lines += ["backends:", host_line, cuda_line]
    return "\n".join(lines), host_ok or cuda_ok
