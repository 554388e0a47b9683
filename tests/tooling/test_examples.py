"""The examples run as documented and print what their pages say they print.

Every numbered example (``examples/NN_*.py``, the tutorials' code, found by a glob so
that a new one cannot be forgotten) runs on the host backend here, and with
``--backend cuda`` in the GPU suite; each must print the lines below. The main demo
runs with its defaults and as TP×PCP. tests/tooling/test_torchrun.py runs them under torchrun,
and the plain torchrun program (``examples/torchrun_job.py``, not numbered: it is no
tutorial step) that the landing page and the README show.

The host backend's runs share one Python process (tests/examples_job.py: each script runs as
``__main__`` with its own ``sys.argv``, and its ranks are the processes it starts), which pays
for starting Python and importing torch once instead of once per run; the demo's ``--help``
runs as a program of its own.
"""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
from jobs import ROOT, python

NUMBERED = sorted(ROOT.glob("examples/[0-9][0-9]_*.py"))

# What each numbered example prints on 2 ranks, on every backend. Each example checks
# its own oracle too (an assertion on a rank fails the run), so these lines are only
# printed when the data that arrived is right.
EXPECTED = {
    "01_buffer.py": [
        "rank 0: my memory holds [0, 10]",
        "rank 0: rank 1's memory holds [1, 11]",
        "rank 1: my memory holds [1, 11]",
        "rank 1: rank 0's memory holds [0, 10]",
    ],
    "02_fences.py": [
        f"rank {r}: step {k}: saw [{100 * k}, {100 * k + 1}], epoch {2 * k}" for r in (0, 1) for k in (1, 2, 3)
    ]
    + [f"rank {r}: split phase: saw [400, 401], epoch 8, local 499545" for r in (0, 1)],
    "03_kernel.py": ["5 rounds on 2 ranks: every block arrived; epochs [10, 10]"],
    "04_pcp_writer.py": [f"rank {r}: 2 layers x 100 tokens of 2 ranks in every replica: OK" for r in (0, 1)],
    "05_runtime_cache.py": [
        f"rank {r}: 2 layers x 2 batches, in blocks from before and after the grow: OK" for r in (0, 1)
    ],
    "06_all_reduce.py": [f"rank {r}: 11 all-reduces of 4x512 bfloat16: the rank-order float32 sums" for r in (0, 1)],
    "07_signals.py": [
        "pipeline: 8 chunks through a ring of 4 tiles to a slow consumer: every chunk exact; "
        "chunk 0 was done before chunk 7 was sent"
    ],
    "08_compiled_decode.py": [
        f"rank {r}: 6 compiled decode steps of 2 layers (4/6 tokens), one graph: "
        "outputs and caches bit for bit the eager loop's"
        for r in (0, 1)
    ],
    "09_nodes.py": [  # 4 ranks as 2 simulated nodes of 2
        line
        for r in range(4)
        for line in (
            f"rank {r}: 2 nodes: [0, 1] [2, 3]; my node is {[r & 2, (r & 2) + 1]}",
            f"rank {r}: node peer {r ^ 1} wrote {10 * (r ^ 1) + r} into my memory",
            f"rank {r}: rank {(r + 2) % 4}'s memory is on node {1 - r // 2}: refused (ViewError): not mapped here",
            f"rank {r}: all_gather across the nodes: [0, 1, 4, 9]",
            f"rank {r}: all_reduce over 2 nodes: [10.0, 10.0, 10.0, 10.0]",
        )
    ],
    "10_moe.py": ["2 ranks: 3 MoE layers, top-2 of 4 experts: bit for bit"],
    "11_all_to_all.py": [
        "rank 0: block 0 of every member, eagerly and compiled",
        "rank 0: PeerRefused: rank 1 refused: x must be torch.float32, got torch.float64",
        "rank 0: the next call is right",
        "rank 1: block 1 of every member, eagerly and compiled",
        "rank 1: InputError: x must be torch.float32, got torch.float64",
        "rank 1: the next call is right",
    ],
    "12_llama_tp.py": [
        line
        for r in (0, 1)
        for line in (
            f"rank {r}: 2-way tensor parallel, 2 layers, hidden 128, float32",
            f"rank {r}: plain all-reduce: logits bit for bit the member-order simulation's",
            f"rank {r}: fused all-reduce + residual + RMS norm: the simulation's tokens and logits (see below)",
        )
    ],
    "13_mixtral_ep.py": [
        line
        for r in (0, 1)
        for line in (
            f"rank {r}: 3 layers, top-2 of 4 experts: bit for bit transformers'",
            f"rank {r}: a bad routing on rank 1: {'InputError' if r == 1 else 'PeerRefused'} naming rank 1; "
            "every member in step",
            f"rank {r}: the next layer: bit for bit again",
        )
    ],
    "14_tp_mlp.py": [
        line
        for r in (0, 1)
        for line in (
            f"rank {r}: 2 x 16 tokens through the MLP: bit for bit, eagerly and compiled",
            "rank 1: InputError: a must be torch.bfloat16, got torch.float32"
            if r == 1
            else "rank 0: PeerRefused: rank 1 refused: a must be torch.bfloat16, got torch.float32",
            f"rank {r}: the next call is right",
        )
    ],
}
HOST_ONLY = {
    "01_buffer.py": [f"rank {r}: host backend, 1024 bytes on cpu" for r in (0, 1)],
    "02_fences.py": ["CUDA graph part not run: it needs GPUs (python examples/02_fences.py --backend cuda)"],
    "05_runtime_cache.py": [f"rank {r}: the cache grew from 3 to 16 blocks" for r in (0, 1)],
    "07_signals.py": [f"ring exchange on {w} ranks: 3 rounds, every block exact" for w in (3, 4)],
    "10_moe.py": ["4 ranks: 3 MoE layers, top-2 of 8 experts: bit for bit"],
}
CUDA_ONLY = {
    "12_llama_tp.py": [f"rank {r}: CUDA graph replay: the eager tokens and logits, bit for bit" for r in (0, 1)],
    "13_mixtral_ep.py": [
        f"rank {r}: the layer in a CUDA graph, 3 replays on new tokens: the eager bits" for r in (0, 1)
    ],
    "01_buffer.py": [f"rank {r}: cuda backend, 1024 bytes on cuda:{r}" for r in (0, 1)],
    "02_fences.py": [f"rank {r}: CUDA graph: 100 replays, epoch +200, 0 wrong" for r in (0, 1)],
    "05_runtime_cache.py": [f"rank {r}: the cache grew from 20 to 128 blocks" for r in (0, 1)],
    "06_all_reduce.py": [f"rank {r}: CUDA graph: 100 replays, 0 wrong" for r in (0, 1)],
}


#: The examples of transformers' models: they need the ``models`` extra (``make test`` installs it).
MODELS = {"12_llama_tp.py", "13_mixtral_ep.py"}
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _needs_models(example: Path) -> None:
    if example.name in MODELS and not HAS_TRANSFORMERS:
        pytest.skip(f"{example.name} needs transformers: pip install 'symmsync[models]' (make test installs it)")


DEMO_ARGS = {
    "defaults": [],
    # TP x PCP and a format of the options in one run (each option its own path through the demo)
    "tp2xpcp2-legacy": ["--tp", "2", "--pcp", "2", "--format", "legacy", "--tokens", "96", "--layers", "2"],
    "mxfp8": ["--format", "pow2,mxfp8", "--tokens", "96", "--layers", "2"],
}
#: Every run of this module on the host backend: its key, and the script with its arguments.
HOST_RUNS = {
    **{
        p.name: [str(p.relative_to(ROOT)), "--backend", "host"]
        for p in NUMBERED
        if p.name not in MODELS or HAS_TRANSFORMERS
    },
    "04 allgather": ["examples/04_pcp_writer.py", "--backend", "host", "--route", "allgather"],
    **{f"demo {k}": ["examples/pcp_kv.py", "--backend", "host", *a] for k, a in DEMO_ARGS.items()},
    **(
        {"12 compiled": ["examples/12_llama_tp.py", "--backend", "host", "--compile", "aot_eager", "--json", "{out}"]}
        if HAS_TRANSFORMERS
        else {}
    ),
}


@pytest.fixture(scope="module")
def host_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each of :data:`HOST_RUNS`, run in one job (tests/examples_job.py), as its completed process."""
    out = tmp_path_factory.mktemp("examples")
    args = [str(out)]
    # "{out}" in a run's arguments: a file of its own in the job's folder
    resolved = {
        key: [a.replace("{out}", str(out / f"{n}.json")) for a in cmd] for n, (key, cmd) in enumerate(HOST_RUNS.items())
    }
    for cmd in resolved.values():
        args += [*cmd, "--"]
    job = python("tests/examples_job.py", *args, timeout=1800)
    runs = {}
    for n, (key, cmd) in enumerate(resolved.items()):
        rc = out / f"{n}.rc"
        if not rc.exists():  # the job ended before this run: what the job said instead
            runs[key] = subprocess.CompletedProcess(
                cmd, -1, job.stdout, f"examples_job ended ({job.returncode}) before this run:\n{job.stderr}"
            )
            continue
        runs[key] = subprocess.CompletedProcess(
            cmd, int(rc.read_text()), (out / f"{n}.out").read_text(), (out / f"{n}.err").read_text()
        )
    return runs


def _check_output(example: Path, backend: str, extra: dict, proc=None) -> None:
    assert example.name in EXPECTED, f"add the lines {example.name} prints to EXPECTED in {__file__}"
    if proc is None:
        proc = python(str(example.relative_to(ROOT)), "--backend", backend)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = proc.stdout.splitlines()
    missing = [line for line in EXPECTED[example.name] + extra.get(example.name, []) if line not in printed]
    assert not missing, f"{example.name} did not print {missing}; it printed:\n{proc.stdout}"


def test_the_tutorial_examples_are_numbered_in_teaching_order():
    assert [p.name for p in NUMBERED] == sorted(EXPECTED), "every numbered example needs its lines in EXPECTED"
    assert [p.name[:2] for p in NUMBERED] == [f"{i:02d}" for i in range(1, len(NUMBERED) + 1)]


@pytest.mark.parametrize("example", NUMBERED, ids=lambda p: p.stem)
def test_each_numbered_example_prints_its_expected_output_on_the_host_backend(host_runs, example):
    _needs_models(example)
    _check_output(example, "host", HOST_ONLY, host_runs[example.name])


@pytest.mark.gpu
@pytest.mark.parametrize("example", NUMBERED, ids=lambda p: p.stem)
def test_each_numbered_example_prints_its_expected_output_on_2_gpus(example):
    _needs_models(example)
    _check_output(example, "cuda", CUDA_ONLY)


def test_the_writer_tutorial_is_correct_on_the_allgather_route_too(host_runs):
    proc = host_runs["04 allgather"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    missing = [line for line in EXPECTED["04_pcp_writer.py"] if line not in proc.stdout.splitlines()]
    assert not missing, proc.stdout


def test_the_llama_example_runs_its_step_compiled_with_the_eager_tokens(host_runs):
    _needs_models(ROOT / "examples" / "12_llama_tp.py")
    proc = host_runs["12 compiled"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in (0, 1):
        line = f"rank {r}: compiled (aot_eager, fullgraph): the eager tokens, logits "
        assert any(printed.startswith(line) for printed in proc.stdout.splitlines()), proc.stdout
    # --json: every rank's step times and lines, the device named
    written = json.loads(Path(proc.args[proc.args.index("--json") + 1]).read_text())
    assert written["device"] == "host backend (CPU)" and written["world"] == 2, written
    for r, rank in enumerate(written["ranks"]):
        times = rank["us_per_token"]["eager"]
        assert set(times) == {"fused", "plain", "none"} and all(t > 0 for t in times.values()), rank
        assert rank["lines"][0] == f"rank {r}: 2-way tensor parallel, 2 layers, hidden 128, float32", rank


@pytest.mark.parametrize("run", list(DEMO_ARGS))
def test_the_pcp_demo_cross_checks_the_routes_and_prints_its_table(host_runs, run):
    proc, args = host_runs[f"demo {run}"], DEMO_ARGS[run]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "route cross-check" in proc.stdout and ": OK" in proc.stdout
    assert "direct ms/layer" in proc.stdout and "speedup" in proc.stdout
    fmt = dict(zip(args[::2], args[1::2])).get("--format", "current")
    assert f"cache format {({'current': 'pow2,ue8m0', 'legacy': 'fp32,fp32'}).get(fmt, fmt)}" in proc.stdout


def test_the_demo_explains_its_options():
    proc = python("examples/pcp_kv.py", "--help")
    assert proc.returncode == 0
    for opt in ("--pcp", "--tp", "--tokens", "--layers", "--backend", "--format"):
        assert opt in proc.stdout
