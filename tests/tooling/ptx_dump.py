"""Compile every @triton.jit kernel of symmsync for sm_90 (CPU compile) and write one .ptx per variant.

Usage (from the repository root): TRITON_INTERPRET=0 python tests/tooling/ptx_dump.py OUTDIR

Compare two dumps (before and after a change) with ``diff -r``.

Debug-line noise (.loc, .file, DWARF sections, comments) is stripped so that a diff of two
folders shows only instruction changes. Kernels' signatures are built from their argument
names, so a kernel that loses an argument (stall_ns) still compiles.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.getcwd())  # the tree run from, not an installed copy

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import symmsync.language as ssl  # noqa: E402
from symmsync.core import failure as A  # noqa: E402
from symmsync.core import fence as F  # noqa: E402
from symmsync.core import signals as S  # noqa: E402

assert not ssl.INTERPRETED
print("symmsync from", ssl.__file__, flush=True)
OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
TARGET = GPUTarget("cuda", 90, 32)

TYPES = {
    "ptrs": "*i64",
    "sptrs": "*i64",
    "cell": "i64",
    "me": "i32",
    "timeout_ns": "i64",
    "record": "i64",
    "sig": "*i64",
    "peer": "i32",
    "slot": "i32",
    "value": "i64",
    "reason": "*i64",
    "out": "*i64",
    "x": "*fp32",
}


def strip(ptx):
    keep, skip = [], False
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".section") and "debug" in s:
            skip = True
        if skip:
            if s == "}":
                skip = False
            continue
        if s.startswith((".loc", ".file", "//", "$L__tmp", "$L__func_begin", "$L__func_end")) or not s:
            continue
        keep.append(line.rstrip())
    return "\n".join(keep) + "\n"


def dump(name, kernel, consts, types=None, warps=4, attrs=None):
    types = {**TYPES, **(types or {})}
    sig = {a: ("constexpr" if a in consts else types[a]) for a in kernel.arg_names}
    c = {k: v for k, v in consts.items() if k in kernel.arg_names}
    try:
        k = triton.compile(ASTSource(kernel, sig, c, attrs), target=TARGET, options={"num_warps": warps})
        text = strip(k.asm["ptx"])
    except Exception as e:  # noqa: BLE001
        text = f"COMPILE ERROR: {e!r}\n"
    with open(os.path.join(OUT, name + ".ptx"), "w") as f:
        f.write(text)
    print(name, len(text.splitlines()), flush=True)


@triton.jit
def grid_fence_kernel(ptrs, cell, me, timeout_ns, record, SIZE: tl.constexpr, TRAP: tl.constexpr):
    ssl.grid_fence(ptrs, cell, me, timeout_ns, record, SIZE, TRAP)


@triton.jit
def grid_sync_kernel(ptrs, cell, me, timeout_ns, record, SIZE: tl.constexpr, TRAP: tl.constexpr):
    ssl.grid_sync(ptrs, cell, me, timeout_ns, record, SIZE, TRAP)


@triton.jit
def publish_wait_kernel(ptrs, cell, me, timeout_ns, out, SIZE: tl.constexpr):
    tl.store(out, ssl.publish_and_wait(ptrs, cell, me, timeout_ns, SIZE))


@triton.jit
def pending_kernel(ptrs, cell, me, out, SIZE: tl.constexpr):
    tl.store(out, ssl.pending(ptrs, cell, me, 5, SIZE))


@triton.jit
def translate_kernel(ptrs, x, SIZE: tl.constexpr):
    p = ssl.peer_ptr(ptrs, 0, 64, tl.float32)
    q = ssl.translate(p, ptrs, 0, SIZE - 1)
    tl.store(q, tl.load(x))


@triton.jit
def signal_wait_kernel(sig, me, timeout_ns, record, out, SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):
    s = ssl.wait_count(sig, me, 1 - me, 0, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
    s += ssl.wait_signal(sig, me, 1 - me, 1, 7, ssl.EQ, timeout_ns, record, SIZE, NSLOTS, TRAP)
    tl.store(out, s + ssl.read_signal(sig, me, 1 - me, 1, NSLOTS))


@triton.jit
def put_signal_kernel(sig, me, x, NSLOTS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ssl.put_signal(sig, me, 1 - me, 256 + i * 4, tl.load(x + i), i < BLOCK, 2, NSLOTS)


@triton.jit
def data_ptr_kernel(sig, me, x, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(ssl.data_ptr(sig, 1 - me, i * 4, tl.float32), tl.load(x + i))


only = sys.argv[2:]


def want(prefix):
    return not only or any(prefix.startswith(o) for o in only)


if want("fence"):
    for size in (1, 2, 8, 40):
        for arrive, wait in ((True, True), (True, False), (False, True)):
            for trap in (True, False):
                dump(
                    f"fence_s{size}_a{int(arrive)}w{int(wait)}_t{int(trap)}",
                    F._fence_kernel,
                    {"SIZE": size, "ARRIVE": arrive, "WAIT": wait, "TRAP": trap},
                    warps=1,
                )
if want("grid"):
    for size in (1, 4, 40):
        for trap in (True, False):
            dump(f"grid_fence_s{size}_t{int(trap)}", grid_fence_kernel, {"SIZE": size, "TRAP": trap})
            dump(f"grid_sync_s{size}_t{int(trap)}", grid_sync_kernel, {"SIZE": size, "TRAP": trap})
if want("lang"):
    dump("publish_and_wait_s4", publish_wait_kernel, {"SIZE": 4}, warps=1)
    dump("pending_s40", pending_kernel, {"SIZE": 40}, warps=1)
    dump("translate", translate_kernel, {"SIZE": 2}, warps=1)
if want("abort"):
    for size in (2, 8, 40):
        dump(f"abort_s{size}", A._abort_kernel, {"SIZE": size}, warps=1)
if want("signals"):
    for op in (0, 1):
        dump(f"signal_op{op}", S._signal_kernel, {"OP": op, "NSLOTS": 4}, warps=1)
    for size in (2, 40):
        for counted in (False, True):
            for trap in (True, False):
                dump(
                    f"signal_wait_s{size}_c{int(counted)}_t{int(trap)}",
                    S._wait_kernel,
                    {"CMP": 2, "COUNTED": counted, "SIZE": size, "NSLOTS": 4, "TRAP": trap},
                    warps=1,
                )
    dump("signal_wait_both_s4", signal_wait_kernel, {"SIZE": 4, "NSLOTS": 4, "TRAP": True})
    dump("put_signal", put_signal_kernel, {"NSLOTS": 4, "BLOCK": 1024}, warps=8)
    dump("data_ptr", data_ptr_kernel, {"BLOCK": 256})
if want("pcp"):
    from symmsync.pcp import kernels as W

    wtypes = {
        "kv_c": "*i16",
        "k_pe": "*i16",
        "idx_k": "*i16",
        "kv_stride": "i32",
        "pe_stride": "i32",
        "ix_stride": "i32",
        "slots": "*i64",
        "n_rows": "i32",
        "dst": "*i64",
        "main_off": "i32",
        "idx_off": "i32",
        "main_bstride": "i32",
        "idx_bstride": "i32",
        "ptrs": "*i64",
        "cell": "i32",
        "me": "i32",
    }
    for split in (False, True):
        for fused in (False, True):
            consts = {
                "NDST": 2,
                "BLOCK_T": 32,
                "BLOCK_SIZE": 64,
                "FUSED": fused,
                "TRAP": True,
                "MAIN_POW2": not split,
                "IDX_SCALE": 1 if split else 2,
                "SPREAD": split,
                "PREFETCH": split,
            }
            dump(f"pcp_writer_split{int(split)}_fused{int(fused)}", W._quantize_write_kernel, consts, wtypes)
if want("coll"):
    from symmsync.collectives import kernels as K

    ctypes = {
        "x": "*bf16",
        "out": "*bf16",
        "count": "i32",
        "timeout_ns": "i64",
        "record": "i64",
        "mism": "i64",
        "stall_ns": "i32",
        "headers": "i32",
        "counter_off": "i32",
        "inputs": "i32",
        "input_stride": "i32",
        "symmetric": "i32",
        "reduced": "i32",
        "residual": "*bf16",
        "weight": "*bf16",
        "res_out": "*bf16",
        "hidden": "i32",
        "eps": "fp32",
    }
    cases = [
        (1, 0, 0, 0),
        (1, 1, 0, 0),
        (1, 0, 1, 0),
        (1, 1, 1, 0),
        (2, 0, 0, 0),
        (2, 0, 1, 0),
        (3, 0, 0, 0),
        (3, 0, 1, 0),
        (1, 0, 0, 4096),
    ]
    for op, two, sym, row in cases:
        for trap in (True, False):
            consts = {
                "SIZE": 4,
                "OP": op,
                "TWO_SHOT": bool(two),
                "SYMMETRIC": bool(sym),
                "NBUF": 2,
                "BLOCK": 1024,
                "TRAP": trap,
                "BF16_BITS": False,
                "DTYPE_CODE": 2,
                "ALGORITHM": two if op == 1 else -1,
                "EPILOGUE": row > 0,
                "ROW": max(row, 1),
            }
            # the divisibility hint for x, out, count (as test_collectives_jobs compiles it)
            attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2)}
            dump(
                f"collective_op{op}_two{two}_sym{sym}{'_epi' if row else ''}_t{int(trap)}",
                K.collective_kernel,
                consts,
                ctypes,
                attrs=attrs,
            )
