"""symmsync.collectives outside symmsync.testing: the tutorial's example as a plain torchrun job,
and its kernels compiled for Hopper GPUs (sm_90) on any machine.

The torchrun job is started as users start theirs (``python -m torch.distributed.run``),
with Triton's interpreter left for ``import symmsync`` to turn on.
"""

import json
import textwrap

from jobs import python, torchrun


def test_the_all_reduce_example_runs_as_a_plain_torchrun_job():
    proc = torchrun("examples/06_all_reduce.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in (0, 1):  # rank 0 prints every rank's lines, once
        line = f"rank {r}: 11 all-reduces of 4x512 bfloat16: the rank-order float32 sums"
        assert proc.stdout.count(line) == 1, proc.stdout


SM90 = textwrap.dedent(
    """
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import symmsync.language as ssl
    from symmsync.collectives import kernels as K

    assert not ssl.INTERPRETED
    sig = {"x": "*bf16", "out": "*bf16", "count": "i32", "refused": "i32", "calls": "*i64", "ptrs": "*i64",
           "sptrs": "*i64", "cell": "i64", "me": "i32", "timeout_ns": "i64", "record": "i64", "mism": "i64",
           "counter_off": "i32", "inputs": "i32", "input_stride": "i32", "symmetric": "i32",
           "reduced": "i32", "residual": "*bf16", "weight": "*bf16", "res_out": "*bf16", "hidden": "i32",
           "eps": "fp32"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2)}  # what Triton specializes aligned calls to
    out = {}
    cases = [(1, 0, 0, 0), (1, 1, 0, 0), (1, 0, 1, 0), (1, 1, 1, 0), (2, 0, 0, 0), (2, 0, 1, 0), (3, 0, 0, 0),
             (3, 0, 1, 0), (1, 0, 0, 4096)]
    for op, two, sym, row in cases:
        consts = {"SIZE": 4, "OP": op, "TWO_SHOT": bool(two), "SYMMETRIC": bool(sym), "BLOCK": 1024,
                  "TRAP": True, "BF16_BITS": False, "DTYPE_CODE": 2, "ALGORITHM": two if op == 1 else -1,
                  "EPILOGUE": row > 0, "ROW": max(row, 1)}
        src = ASTSource(K.collective_kernel, {**sig, **{k: "constexpr" for k in consts}}, consts, attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        scratch = getattr(k.metadata, "global_scratch_size", 0)
        out[f"{op}{two}{sym}{'e' if row else ''}"] = {"ptx": k.asm["ptx"], "scratch": scratch}
    print(json.dumps(out))
    """
)


def test_the_collective_kernels_compile_for_sm90_with_system_scope_signals_gpu_scope_arrivals_and_vector_copies():
    proc = python("-c", SM90, TRITON_INTERPRET="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, k in kernels.items():
        ptx = k["ptx"]
        phases = 2 if name[1] == "1" or name[2] == "1" else 1
        # a publish per phase: one reduction per member, predicated off for this member itself
        assert ptx.count("red.release.sys.global.add") == 4 * phases, name
        assert "ld.acquire.sys.global" in ptx or "ld.global.acquire.sys" in ptx, name  # the wait's polls
        assert "trap;" in ptx, name  # a failed wait stops the stream
        assert "atom.global.gpu.acq_rel.add" in ptx, name  # the arrivals of the launch's programs (one GPU's)
        assert "atom.global.sys" not in ptx, name  # no system-scope atomic: the records take plain stores
        if not name.endswith("e"):  # the epilogue's rows are masked: its accesses are narrower
            assert "ld.global.v4" in ptx and "st.global.v4" in ptx, name  # whole blocks: 16-byte accesses
        assert k["scratch"] == 0, name  # launchable through the pre-packed path
