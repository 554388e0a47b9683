"""Real jobs: plain torchrun programs on the host backend, and testing.run inside torchrun.

Each job here is started as users start theirs, ``python -m torch.distributed.run
--nproc-per-node 2 ...`` (torchrun), on a free port, with Triton's interpreter left
for ``import symmsync`` to turn on (``TRITON_INTERPRET`` is removed from the
environment), and checked by its exit status and what it printed.
"""

import re
import subprocess

import pytest
from jobs import ROOT, python, torchrun

PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_the_runtime_cache_example_runs_under_torchrun():
    # A runtime's registered, growable cache in a plain torchrun job (examples/05_runtime_cache.py).
    proc = torchrun("examples/05_runtime_cache.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in (0, 1):  # one pipe for both ranks: look for each line, in any order
        assert f"rank {r}: 2 layers x 2 batches, in blocks from before and after the grow: OK" in proc.stdout
        assert f"rank {r}: the cache grew from 3 to 16 blocks" in proc.stdout


def test_the_compiled_decode_example_runs_under_torchrun():
    # torch.compile(fullgraph=True) of the symmsync ops in a plain torchrun job (examples/08_compiled_decode.py).
    proc = torchrun("examples/08_compiled_decode.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in (0, 1):
        line = f"rank {r}: 6 compiled decode steps of 2 layers (4/6 tokens), one graph: outputs and caches bit for bit"
        assert proc.stdout.count(line) == 1, proc.stdout


@pytest.mark.parametrize(
    "example, line",
    [
        ("12_llama_tp.py", "plain all-reduce: logits bit for bit the member-order simulation's"),
        ("13_mixtral_ep.py", "the next layer: bit for bit again"),
    ],
)
def test_the_model_examples_run_under_torchrun(example, line):
    # transformers' Llama (tensor-parallel) and Mixtral block (expert-parallel) in a plain torchrun job.
    pytest.importorskip("transformers", reason="the models extra: pip install 'symmsync[models]' (make test has it)")
    proc = torchrun(f"examples/{example}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in (0, 1):
        assert proc.stdout.count(f"rank {r}: {line}") == 1, proc.stdout


def test_the_new_consumer_tutorial_runs_under_torchrun():
    # A consumer built in the tutorial (examples/11_all_to_all.py): made, compiled, a refused call then a right one.
    proc = torchrun("examples/11_all_to_all.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in (
        "rank 0: block 0 of every member, eagerly and compiled",
        "rank 1: block 1 of every member, eagerly and compiled",
        "rank 0: PeerRefused: rank 1 refused: x must be torch.float32, got torch.float64",
        "rank 1: InputError: x must be torch.float32, got torch.float64",
        "rank 0: the next call is right",
        "rank 1: the next call is right",
    ):
        assert proc.stdout.count(line) == 1, (line, proc.stdout)


def test_the_tp_mlp_tutorial_runs_under_torchrun():
    # symmsync.gemm's two consumers in a plain torchrun job (examples/14_tp_mlp.py): compiled, a refused call.
    proc = torchrun("examples/14_tp_mlp.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in (
        "rank 0: 2 x 16 tokens through the MLP: bit for bit, eagerly and compiled",
        "rank 1: 2 x 16 tokens through the MLP: bit for bit, eagerly and compiled",
        "rank 0: PeerRefused: rank 1 refused: a must be torch.bfloat16, got torch.float32",
        "rank 1: InputError: a must be torch.bfloat16, got torch.float32",
    ):
        assert proc.stdout.count(line) == 1, (line, proc.stdout)


def _job_section() -> str:
    text = (ROOT / "examples" / "torchrun_job.py").read_text()
    return text.split("# --8<-- [start:job]\n")[1].split("# --8<-- [end:job]")[0]


def test_a_numbered_example_runs_under_torchrun_and_prints_every_line_once():
    proc = torchrun("examples/01_buffer.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = proc.stdout.splitlines()
    expected = [
        "rank 0: host backend, 1024 bytes on cpu",
        "rank 0: my memory holds [0, 10]",
        "rank 0: rank 1's memory holds [1, 11]",
        "rank 1: host backend, 1024 bytes on cpu",
        "rank 1: my memory holds [1, 11]",
        "rank 1: rank 0's memory holds [0, 10]",
    ]
    assert [line for line in printed if line.startswith("rank ")] == expected, proc.stdout


def test_the_readme_program_is_the_example_the_landing_page_includes():
    readme = (ROOT / "README.md").read_text()
    blocks = PYTHON_BLOCK.findall(readme)
    assert blocks and blocks[0] == _job_section(), "README's first python block must be examples/torchrun_job.py's job"
    assert "<!-- from examples/torchrun_job.py:job " in (ROOT / "docs" / "index.md").read_text()


def test_the_readme_program_runs_as_a_plain_torchrun_script(tmp_path):
    script = tmp_path / "my_script.py"
    script.write_text(PYTHON_BLOCK.findall((ROOT / "README.md").read_text())[0])
    proc = torchrun(script)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank, left in ((0, 1), (1, 0)):
        # Both ranks print to one pipe: their lines may interleave, so look for each text.
        assert proc.stdout.count(f"rank {rank}: host backend: rank {left}'s 256 values arrived") == 1, proc.stdout


def test_with_the_interpreter_turned_off_every_rank_raises_saying_what_to_set():
    proc = torchrun("examples/torchrun_job.py", TRITON_INTERPRET="0", timeout=120)
    assert proc.returncode != 0
    for rank in (0, 1):  # both ranks write into one pipe: look for each rank's text (tests/jobs.py)
        said = re.search(rf"\[rank{rank}\]: symmsync\.errors\.ConfigError: [^\n]*Set TRITON_INTERPRET=1", proc.stderr)
        assert said, proc.stderr[-3000:]


WRONG_WORLD = """
from symmsync.testing import run

def rank():
    return 0

run(rank, 3)
"""


def test_run_inside_torchrun_refuses_a_world_size_torchrun_did_not_start(tmp_path):
    script = tmp_path / "wrong_world.py"
    script.write_text(WRONG_WORLD)
    proc = torchrun(script)
    assert proc.returncode != 0
    assert "ConfigError" in proc.stderr and "asked for 3 ranks, but torchrun started 2" in proc.stderr


@pytest.mark.parametrize(
    "env, main",
    [
        ({}, True),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, True),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, False),
    ],
    ids=["plain process", "torchrun rank 0", "torchrun rank 1"],
)
def test_is_main_process_is_true_outside_torchrun_and_on_its_rank_0(monkeypatch, env, main):
    from symmsync.testing import TORCHRUN_ENV, is_main_process, under_torchrun

    for k in TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    if env:
        for k, v in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"}.items():
            monkeypatch.setenv(k, v)
    assert under_torchrun() == bool(env)
    assert is_main_process() == main


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return python("-c", code, timeout=120, **env)


def test_import_turns_on_the_interpreter_where_no_gpu_is_visible():
    proc = _python("import os, symmsync.language as l; print(os.environ['TRITON_INTERPRET'], l.INTERPRETED)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "True"]


def test_an_explicit_triton_interpret_0_wins_and_the_host_backend_says_what_to_set():
    code = (
        "import os, symmsync.language as l\n"
        "from symmsync import backends, ConfigError\n"
        "print(os.environ['TRITON_INTERPRET'], l.INTERPRETED)\n"
        "try:\n"
        "    backends.resolve('host', None)\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
    )
    proc = _python(code, TRITON_INTERPRET="0")
    assert proc.returncode == 0, proc.stderr
    first, message = proc.stdout.split("\n", 1)
    assert first.split() == ["0", "False"]
    assert "TRITON_INTERPRET=0 is set" in message and "Set TRITON_INTERPRET=1" in message


KERNEL_BEFORE_SYMMSYNC = """
import torch
import triton
import triton.language as tl

@triton.jit
def before(x, N: tl.constexpr):  # defined while the interpreter was still off
    tl.store(x + tl.arange(0, N), tl.load(x + tl.arange(0, N)) + 1)

import symmsync  # noqa: E402

@triton.jit
def after(x, out, N: tl.constexpr):  # Triton's own tl.sum, tl.max and x.sum() were defined before too
    v = tl.load(x + tl.arange(0, N))
    tl.store(out, tl.sum(v) + tl.max(v) + v.sum())

x = torch.arange(4, dtype=torch.float32)
out = torch.zeros(1)
before[(1,)](x, 4)
after[(1,)](x, out, 4)
print(x.tolist(), out.item())
"""


def test_kernels_and_triton_functions_defined_before_import_symmsync_run_interpreted(tmp_path):
    script = tmp_path / "kernels.py"  # Triton reads a kernel's source from its file
    script.write_text(KERNEL_BEFORE_SYMMSYNC)
    proc = python(script, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[0] == "[1.0, 2.0, 3.0, 4.0] 24.0"  # 10 + 4 + 10
