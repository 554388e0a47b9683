"""GPU twins of the job tests: torchrun jobs on the cuda backend, tensors kept past close().

Run on a machine with 2 NVIDIA GPUs (skipped elsewhere):

    PYTHONPATH=$PWD python3 -m pytest -m gpu tests/gpu/test_gpu_jobs.py -v
"""

import subprocess

import pytest
import torch
from jobs import python, torchrun

import symmsync as ss
from symmsync.testing import run

pytestmark = pytest.mark.gpu
WORLD = 2


def _torchrun(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return torchrun(script, *args, nproc=WORLD, timeout=600, **env)  # GPU jobs compile: no TRITON_INTERPRET


def test_a_numbered_example_runs_under_torchrun_on_2_gpus_and_prints_once():
    proc = _torchrun("examples/01_buffer.py", "--backend", "cuda")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    second = 1 % torch.cuda.device_count()  # ranks sharing one GPU (SYMMSYNC_SHARE_GPUS=1): rank 1 on cuda:0
    assert lines == [
        "rank 0: cuda backend, 1024 bytes on cuda:0",
        "rank 0: my memory holds [0, 10]",
        "rank 0: rank 1's memory holds [1, 11]",
        f"rank 1: cuda backend, 1024 bytes on cuda:{second}",
        "rank 1: my memory holds [1, 11]",
        "rank 1: rank 0's memory holds [0, 10]",
    ], proc.stdout


def test_the_plain_torchrun_program_runs_on_2_gpus():
    if torch.cuda.device_count() < WORLD:
        pytest.skip(
            "examples/torchrun_job.py is a user's plain program: one GPU per rank and NCCL, which refuses two "
            "ranks on one GPU; run it on 2 GPUs (the numbered example above runs through symmsync.testing, "
            "which shares the GPU)"
        )
    proc = _torchrun("examples/torchrun_job.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank, left in ((0, 1), (1, 0)):
        # Both ranks print to one pipe: their lines may interleave, so look for each text.
        assert proc.stdout.count(f"rank {rank}: cuda backend: rank {left}'s 256 values arrived") == 1, proc.stdout


def test_the_host_backend_on_a_gpu_machine_needs_the_interpreter_and_says_so():
    refused = _torchrun("examples/01_buffer.py", "--backend", "host")
    assert refused.returncode != 0
    assert "ConfigError" in refused.stderr and "TRITON_INTERPRET=1 torchrun" in refused.stderr, refused.stderr[-3000:]


def test_the_host_backend_on_a_gpu_machine_runs_with_triton_interpret_1():
    proc = _torchrun("examples/01_buffer.py", TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 1: host backend, 1024 bytes on cpu" in proc.stdout.splitlines()


KEPT_PAST_CLOSE = """
import torch
import symmsync as ss
from symmsync.testing import run

def kept(_):
    buf = ss.SymmetricBuffer(1 << 21, backend="cuda")
    me, peer = buf.rank, 1 - buf.rank
    buf.tensor(0, (4,), torch.float32).copy_(torch.arange(4, device=buf.device) + 10 * me)
    ss.Fence(buf.view([0, 1]), timeout_s=60).fence()
    t = buf.tensor(0, (4,), torch.float32)
    p = buf.tensor(0, (4,), torch.float32, rank=peer)
    buf.close()
    torch.cuda.synchronize()
    print(t, p)  # read on the device after close: as in the report
    s = (t + p).sum().item()  # a kernel reads both mappings
    return t.tolist(), p.tolist(), s

if __name__ == "__main__":
    for rank, (own, theirs, s) in enumerate(run(kept, 2, None, backend="cuda")):
        print(f"rank {rank}: own {own} peer {theirs} sum {s}")
"""


def test_cuda_tensors_kept_past_close_read_their_values_and_the_process_exits_cleanly(tmp_path):
    script = tmp_path / "kept.py"  # a file: the ranks import its functions
    script.write_text(KEPT_PAST_CLOSE)
    proc = python(script)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "rank 0: own [0.0, 1.0, 2.0, 3.0] peer [10.0, 11.0, 12.0, 13.0] sum 52.0" in lines
    assert "rank 1: own [10.0, 11.0, 12.0, 13.0] peer [0.0, 1.0, 2.0, 3.0] sum 52.0" in lines


def held_past_close():
    import gc

    import torch.distributed as dist

    size = 64 << 20
    with ss.SymmetricBuffer(1 << 22, backend="cuda"):  # warm-up: contexts, NCCL buffers
        pass
    torch.cuda.synchronize()
    dist.barrier()
    free0, _ = torch.cuda.mem_get_info()
    buf = ss.SymmetricBuffer(size, backend="cuda")
    t = buf.tensor(size - 1024, (16,), torch.int32)[4:]  # a slice of a view: the same mapping
    buf.close()
    dist.barrier()  # every peer closed: only this rank's held tensor maps this memory now
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    t.fill_(dist.get_rank() + 5)
    value = t.sum().item()
    del t
    gc.collect()
    torch.cuda.synchronize()
    free2, _ = torch.cuda.mem_get_info()
    return free0 - free1, free0 - free2, value


def test_a_held_tensor_keeps_device_memory_until_it_is_dropped():
    for rank, (held, after, value) in enumerate(run(held_past_close, WORLD, backend="cuda", timeout_s=300)):
        assert value == 12 * (rank + 5)
        assert held >= 60 << 20, held  # the 64 MiB stayed allocated while the tensor lived
        assert abs(after) <= 8 << 20, after  # and went with it
