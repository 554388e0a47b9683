"""Debug mode (``SYMMSYNC_DEBUG=1``) on the host backend: a planted publish from several programs
of one launch, and a peer offset outside the user region, each reported naming the rank, the
program and the offset; the same kernels without debug mode raise nothing (the misuse is silent
there, so the check is what catches it), and correct kernels raise nothing in debug mode.
"""

import torch.distributed as dist
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync.testing import run

RUN_S = 240
NBYTES = 1024


@triton.jit
def publish_kernel(ptrs, cell, me, SIZE: tl.constexpr):
    ssl.publish(ptrs, cell, me, SIZE)  # from every program of the launch: the planted misuse


@triton.jit
def publish_twice_kernel(ptrs, cell, me, SIZE: tl.constexpr):
    ssl.publish(ptrs, cell, me, SIZE)  # one program, twice: each call one epoch, allowed
    ssl.publish(ptrs, cell, me, SIZE)


@triton.jit
def tail_kernel(ptrs, cell, me, timeout_ns, record, SIZE: tl.constexpr):
    ssl.grid_fence(ptrs, cell, me, timeout_ns, record, SIZE, False)


@triton.jit
def put_kernel(sig, me, offset, SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    # the last lane is masked off and may point anywhere; the live ones must stay inside
    ssl.put_signal(sig, me, 1 - me, offset + i * 8, (i + 1).to(tl.int64), i < BLOCK - 1, 0, NSLOTS)


@triton.jit
def data_ptr_kernel(sig, me, offset, SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):
    tl.store(ssl.data_ptr(sig, 1 - me, offset, tl.int64), 7)


def _own_cause(e):
    while e is not None and not isinstance(e, ss.SymmSyncError):
        e = e.__cause__
    return e


def _outcome(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the interpreter wraps symmsync's error
        own = _own_cause(e)
        return (type(own).__name__, str(own)) if own is not None else ("foreign", repr(e))
    return ("ok", "")


def misuse():
    buf = ss.SymmetricBuffer(NBYTES, backend="host")
    view = buf.view([0, 1])
    fence = ss.Fence(view, timeout_s=60)
    sigs = ss.Signals(view, slots=1, timeout_s=60)
    ptrs, cell, me = view.cell_ptrs, fence.cell, view.local_index
    out = {"debug": ssl.DEBUG}
    # correct use first: none of it may trip a check
    out["fences"] = _outcome(lambda: [fence.fence() for _ in range(3)])
    out["tail"] = _outcome(lambda: tail_kernel[(4,)](*fence.kernel_args, SIZE=2))
    out["twice"] = _outcome(lambda: publish_twice_kernel[(1,)](ptrs, cell, me, SIZE=2))
    out["put_inside"] = _outcome(
        lambda: put_kernel[(1,)](*sigs.kernel_args[:2], NBYTES - 8 * 7, BLOCK=8, **sigs.constexprs)
    )
    dist.barrier()
    # the planted misuse
    out["multi"] = _outcome(lambda: publish_kernel[(4,)](ptrs, cell, me, SIZE=2))
    out["put_past"] = _outcome(
        lambda: put_kernel[(1,)](*sigs.kernel_args[:2], NBYTES - 8 * 6, BLOCK=8, **sigs.constexprs)
    )
    # (a negative offset is planted in debug mode only: without the check it would store outside the mapping)
    past = -16 if ssl.DEBUG else NBYTES + 16
    out["negative"] = _outcome(lambda: data_ptr_kernel[(1,)](*sigs.kernel_args[:2], past, **sigs.constexprs))
    out["cell"] = cell
    dist.barrier()
    buf.close()
    return out


def test_debug_mode_reports_a_publish_from_several_programs_and_offsets_outside_the_user_region():
    for r, out in enumerate(run(misuse, 2, backend="host", timeout_s=RUN_S, env={"SYMMSYNC_DEBUG": "1"})):
        assert out["debug"]
        for ok in ("fences", "tail", "twice", "put_inside"):
            assert out[ok] == ("ok", ""), (ok, out[ok])
        kind, msg = out["multi"]
        assert kind == "DebugCheckError", out["multi"]
        assert f"rank {r} (view index {r}), program (1, 0, 0)" in msg and f"offset {out['cell']}" in msg, msg
        kind, msg = out["put_past"]
        assert kind == "DebugCheckError" and f"rank {r} " in msg and f"offset {NBYTES}" in msg, out["put_past"]
        kind, msg = out["negative"]
        assert kind == "DebugCheckError" and "offset -16" in msg and "program (0, 0, 0)" in msg, out["negative"]


def test_without_debug_mode_the_same_misuse_passes_silently():
    for out in run(misuse, 2, backend="host", timeout_s=RUN_S):
        assert not out["debug"]
        assert {k: out[k][0] for k in ("multi", "put_past", "negative")} == dict.fromkeys(
            ("multi", "put_past", "negative"), "ok"
        )


SM90 = """
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import symmsync.language as ssl
from symmsync.core import fence as F

@triton.jit
def put_kernel(sig, me, x, NSLOTS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ssl.put_signal(sig, me, 1 - me, 256 + i * 4, tl.load(x + i), i < BLOCK, 0, NSLOTS)

t = GPUTarget("cuda", 90, 32)
sig = {"ptrs": "*i64", "cell": "i64", "me": "i32", "timeout_ns": "i64", "record": "i64", "SIZE": "constexpr",
       "ARRIVE": "constexpr", "WAIT": "constexpr", "TRAP": "constexpr"}
fence = triton.compile(ASTSource(F._fence_kernel, sig, {"SIZE": 4, "ARRIVE": True, "WAIT": True, "TRAP": True}),
                       target=t, options={"num_warps": 1}).asm["ptx"]
src = ASTSource(put_kernel, {"sig": "*i64", "me": "i32", "x": "*fp32", "NSLOTS": "constexpr", "BLOCK": "constexpr"},
                {"NSLOTS": 2, "BLOCK": 256})
put = triton.compile(src, target=t, options={"num_warps": 4}).asm["ptx"]
print(json.dumps({"debug": ssl.DEBUG, "fence": fence, "put": put}))
"""


def _compile_sm90(tmp_path, debug):
    import json

    from jobs import python

    script = tmp_path / f"debug_sm90_{int(debug)}.py"  # @triton.jit needs a source file
    script.write_text(SM90)
    mode = "1" if debug else "0"  # symmsync checks only SYMMSYNC_DEBUG == "1"
    proc = python(script, timeout=300, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", SYMMSYNC_DEBUG=mode)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _reports(text):
    return text.count("vprintf,")  # the call sites of device_print


def test_debug_mode_compiles_its_checks_for_sm90_and_off_leaves_only_the_index_checks(tmp_path):
    on, off = _compile_sm90(tmp_path, True), _compile_sm90(tmp_path, False)
    assert on["debug"] and not off["debug"]
    assert "%gridid" in on["fence"] and "%gridid" not in off["fence"]  # the publish stamp: debug only
    assert "trap;" in on["put"]
    # Off, the reports left are the index checks' (indices are checked on every call), six printf
    # calls each (device_print prints each of its six operands): the fence's member index, once
    # unrecorded (publish) and once recorded (wait_or_trap); put_signal's one report for its
    # three indices. Debug mode adds its own reports to those.
    assert (_reports(off["fence"]), _reports(off["put"])) == (2 * 6, 1 * 6)
    assert _reports(on["fence"]) > _reports(off["fence"]) and _reports(on["put"]) > _reports(off["put"])
