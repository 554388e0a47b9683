"""The same kernel source compiles for Hopper GPUs (sm_90), checked on any machine.

Compiles symmsync's kernels with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``
in a subprocess without the interpreter, and checks that the compile-time switch
picked the GPU instructions: release reductions and acquire loads at system scope, the
global timer for the time budget, and a trap after the timeout record; the abort
flags as release OR reductions, and a wait whose first poll is one acquire load per
member and a mask (the abort flags are read only on the slow path).
"""

import json
import os
import textwrap

import pytest
from jobs import python

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import symmsync.language as ssl
    from symmsync.core import fence as F
    from symmsync.core import failure as A

    assert not ssl.INTERPRETED

    @triton.jit
    def tail_kernel(ptrs, cell, me, timeout_ns, record, SIZE: tl.constexpr):
        ssl.grid_fence(ptrs, cell, me, timeout_ns, record, SIZE, True)

    @triton.jit
    def translate_kernel(ptrs, x, SIZE: tl.constexpr):
        p = ssl.peer_ptr(ptrs, 0, 64, tl.float32)
        q = ssl.translate(p, ptrs, 0, SIZE - 1)
        tl.store(q, tl.load(x))

    @triton.jit
    def signal_kernel(sig, me, timeout_ns, record, SIZE: tl.constexpr, NSLOTS: tl.constexpr, TRAP: tl.constexpr):
        ssl.signal(sig, me, 1 - me, 0, 1, ssl.ADD, NSLOTS)
        ssl.signal(sig, me, 1 - me, 1, 7, ssl.SET, NSLOTS)

    @triton.jit
    def signal_wait_kernel(sig, me, timeout_ns, record, out, SIZE: tl.constexpr, NSLOTS: tl.constexpr,
                           TRAP: tl.constexpr):
        s = ssl.wait_count(sig, me, 1 - me, 0, 1, timeout_ns, record, SIZE, NSLOTS, TRAP)
        s += ssl.wait_signal(sig, me, 1 - me, 1, 7, ssl.EQ, timeout_ns, record, SIZE, NSLOTS, TRAP)
        tl.store(out, s + ssl.read_signal(sig, me, 1 - me, 1, NSLOTS))

    @triton.jit
    def put_signal_kernel(sig, me, x, NSLOTS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        ssl.put_signal(sig, me, 1 - me, 256 + i * 4, tl.load(x + i), i < BLOCK, 2, NSLOTS)

    @triton.jit
    def grid_sync_kernel(ptrs, cell, me, timeout_ns, record, SIZE: tl.constexpr):
        ssl.grid_sync(ptrs, cell, me, timeout_ns, record, SIZE, True)

    target = GPUTarget("cuda", 90, 32)
    out = {}
    ssig = {"sig": "*i64", "me": "i32", "timeout_ns": "i64", "record": "i64"}
    sc = {"SIZE": 4, "NSLOTS": 4, "TRAP": True}
    scs = {k: "constexpr" for k in sc}
    out["signal"] = triton.compile(ASTSource(signal_kernel, {**ssig, **scs}, sc), target=target,
                                   options={"num_warps": 4}).asm["ptx"]
    out["signal_wait"] = triton.compile(ASTSource(signal_wait_kernel, {**ssig, "out": "*i64", **scs}, sc),
                                        target=target, options={"num_warps": 4}).asm["ptx"]
    src = ASTSource(put_signal_kernel, {"sig": "*i64", "me": "i32", "x": "*fp32", "NSLOTS": "constexpr",
                                        "BLOCK": "constexpr"}, {"NSLOTS": 4, "BLOCK": 1024})
    out["put_signal"] = triton.compile(src, target=target, options={"num_warps": 8}).asm["ptx"]
    sig = {"ptrs": "*i64", "cell": "i64", "me": "i32", "timeout_ns": "i64", "record": "i64"}
    for name, (arrive, wait) in {"fence": (True, True), "arrive": (True, False), "wait": (False, True)}.items():
        src = ASTSource(F._fence_kernel, {**sig, "SIZE": "constexpr", "ARRIVE": "constexpr", "WAIT": "constexpr",
                                          "TRAP": "constexpr"},
                        {"SIZE": 8, "ARRIVE": arrive, "WAIT": wait, "TRAP": True})
        k = triton.compile(src, target=target, options={"num_warps": 1})
        out[name] = k.asm["ptx"]
    src = ASTSource(F._refuse_kernel, {**sig, "refused": "i64", "SIZE": "constexpr", "TRAP": "constexpr"},
                    {"SIZE": 8, "TRAP": True})
    out["refuse"] = triton.compile(src, target=target, options={"num_warps": 1}).asm["ptx"]
    k = triton.compile(ASTSource(tail_kernel, {**sig, "SIZE": "constexpr"}, {"SIZE": 4}), target=target,
                       options={"num_warps": 4})
    out["tail"] = k.asm["ptx"]
    k = triton.compile(ASTSource(grid_sync_kernel, {**sig, "SIZE": "constexpr"}, {"SIZE": 4}), target=target,
                       options={"num_warps": 4})
    out["grid_sync"] = k.asm["ptx"]
    k = triton.compile(ASTSource(translate_kernel, {"ptrs": "*i64", "x": "*fp32", "SIZE": "constexpr"}, {"SIZE": 2}),
                       target=target, options={"num_warps": 1})
    out["translate"] = k.asm["ptx"]
    out["cubin"] = len(k.asm["cubin"])
    src = ASTSource(A._abort_kernel, {"ptrs": "*i64", "cell": "i64", "me": "i32", "reason": "*i64",
                                      "SIZE": "constexpr"}, {"SIZE": 8})
    out["abort"] = triton.compile(src, target=target, options={"num_warps": 1}).asm["ptx"]
    from symmsync.pcp import kernels as W
    wsig = {"kv_c": "*i16", "k_pe": "*i16", "idx_k": "*i16", "kv_stride": "i32", "pe_stride": "i32",
            "ix_stride": "i32", "slots": "*i64", "n_rows": "i32", "dst": "*i64", "main_off": "i32", "idx_off": "i32",
            "main_bstride": "i32", "idx_bstride": "i32", "ptrs": "*i64", "cell": "i32", "me": "i32",
            "timeout_ns": "i64", "record": "i64", "calls": "*i64", "layer": "i32", "refused": "i32",
            "per_member": "i32"}
    # The second variant: the other formats, one destination per program, prefetch, gathered rows.
    for split in (False, True):
        for fused in (False, True):
            consts = {"NDST": 2, "BLOCK_T": 32, "BLOCK_SIZE": 64, "FUSED": fused, "TRAP": True,
                      "MAIN_POW2": not split, "IDX_SCALE": 1 if split else 2, "SPREAD": split, "PREFETCH": split,
                      "GATHERED": split, "HEADER": not split}
            src = ASTSource(W._quantize_write_kernel, {**wsig, **{k: "constexpr" for k in consts}}, consts)
            try:  # one kernel that does not compile fails its own test, not every test here
                k = triton.compile(src, target=target, options={"num_warps": 4})
                out[f"writer_split{int(split)}_fused{int(fused)}"] = k.asm["ptx"]
            except Exception as e:
                out[f"writer_split{int(split)}_fused{int(fused)}"] = "COMPILE ERROR: " + repr(e)
    from symmsync.language import records as R
    from symmsync.collectives.kernels import collective_kernel
    csig = {"x": "*bf16", "out": "*bf16", "count": "i32", "refused": "i32", "calls": "*i64", "ptrs": "*i64",
            "sptrs": "*i64", "cell": "i64", "me": "i32", "timeout_ns": "i64", "record": "i64", "mism": "i64",
            "counter_off": "i64", "inputs": "i64", "input_stride": "i64", "symmetric": "i64", "reduced": "i64",
            "residual": "*bf16", "weight": "*bf16", "res_out": "*bf16", "hidden": "i32", "eps": "fp32"}
    cc = dict(SIZE=2, OP=0, TWO_SHOT=True, SYMMETRIC=False, BLOCK=1024, TRAP=True, BF16_BITS=False,
              DTYPE_CODE=1, ALGORITHM=1, EPILOGUE=False, ROW=1)
    src = ASTSource(collective_kernel, {**csig, **{k: "constexpr" for k in cc}}, cc)
    out["collective"] = triton.compile(src, target=target, options={"num_warps": 4}).asm["ptx"]
    out["collective_flags"] = [R.GRID_STALL]
    from symmsync.moe import kernels as MK
    common = {"calls": "*i64", "state": "*i64", "sig": "*i64", "me": "i32", "stride": "i64"}
    regions = {"rows_off": "i64", "scales_off": "i64", "src_off": "i64", "counts_off": "i64", "counts_stride": "i64"}
    waits = {"timeout_ns": "i64", "record": "i64", "times": "*i64"}
    send = {"x": "*bf16", "topk": "*i64", "T": "i32", "refused": "i32", "tally": "*i32", **common, **waits, **regions}
    send_consts = dict(TIMES=False, SIZE=4, SP=4, NSLOTS=1, TRAP=True, E=8, EL=2, M=16, H=512, HB=512, C=1, TOPK=4,
                       BT=16, KP=4, EP=8, FP8=False, GB=4, BITS=False)
    moe = {
        "moe_dispatch_send": (MK.dispatch_send, send, send_consts),
        "moe_dispatch_send_fp8": (MK.dispatch_send, send, {**send_consts, "FP8": True}),
        "moe_dispatch_send_timed": (MK.dispatch_send, send, {**send_consts, "TIMES": True}),
        "moe_dispatch_recv": (MK.dispatch_recv,
                              {"counts_out": "*i64", "per_source": "*i64", "offsets": "*i64", **common, **waits,
                               **regions},
                              dict(TIMES=False, SIZE=4, SP=4, NSLOTS=1, TRAP=True, E=8, EL=2, ELP=2)),
        "moe_combine_send": (MK.combine_send,
                             {"out": "*bf16", "per_source": "*i64", "offsets": "*i64", "src": "*i64",
                              "refused": "i32", "comb_off": "i64", **common},
                             dict(SIZE=4, NSLOTS=1, M=16, H=512, HP=512, RB=4)),
        "moe_combine_reduce": (MK.combine_reduce,
                               {"y": "*bf16", "topk": "*i64", "weights": "*fp32", "T": "i32", "per_source": "*i64",
                                "comb_off": "i64", **common, **waits},
                               dict(SIZE=4, NSLOTS=1, TRAP=True, E=8, H=512, HB=512, C=1, TOPK=4, BITS=False)),
    }
    # Each also with ``me`` = 1, which a launch specializes into a constant (Triton does so for an
    # int argument equal to 1): the member of rank 1 compiles that variant; the kernels whose loops
    # run to the token count ``T`` also with ``T`` = 1 (a call of one token).
    one_token = [(n + "_t1", (k, t, {**c, "T": 1})) for n, (k, t, c) in moe.items() if "T" in t]
    for name, (kernel, types, consts) in [*moe.items(), *((n + "_me1", (k, t, {**c, "me": 1}))
                                                          for n, (k, t, c) in moe.items()), *one_token]:
        order = [n for n in kernel.arg_names if n not in consts]
        sig = {n: types[n] for n in order}
        try:
            src = ASTSource(kernel, {**sig, **{k: "constexpr" for k in consts}}, consts)
            out[name] = triton.compile(src, target=target, options={"num_warps": 4}).asm["ptx"]
        except Exception as e:
            out[name] = "COMPILE ERROR: " + repr(e)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    script = tmp_path_factory.mktemp("sm90") / "compile_sm90.py"  # @triton.jit needs a source file
    script.write_text(SCRIPT)
    fusion = os.environ.get("TRITON_DEFAULT_FP_FUSION", "1")
    # TRITON_INTERPRET explicit: import symmsync would pick the interpreter here
    proc = python(script, timeout=300, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION=fusion)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _lines(text, needle):
    return [line.strip() for line in text.splitlines() if needle in line and not line.strip().startswith(".loc")]


def test_fence_publishes_with_release_reductions_and_waits_with_acquire_loads_on_sm90(ptx):
    fence = ptx["fence"]
    assert _lines(fence, "red.release.sys.global.add.u64")
    assert _lines(fence, "ld.acquire.sys.global.b64")
    assert not _lines(fence, "atom.")  # no exchange round trip in the publish
    assert _lines(fence, "%globaltimer") and _lines(fence, "trap;") and _lines(fence, "fence.sc.sys")
    assert ptx["cubin"] > 0  # ptxas accepted it


def test_publish_issues_each_reduction_once_from_thread_0(ptx):
    # SIZE=8: eight table entries unrolled, each reduction guarded by %tid.x == 0 (and p != me),
    # so a program of any num_warps adds exactly 1 per peer (the 4-warp tail included).
    for name, size in (("fence", 8), ("tail", 4)):
        reds = _lines(ptx[name], "red.release.sys.global.add.u64")
        assert len(reds) == size, reds
        for line in reds:  # the guard and the reduction are one asm statement
            assert "mov.u32 t, %tid.x; setp.eq.u32 q, t, 0;" in line and "@p red.release" in line, line


def test_a_refused_fence_stores_its_marks_then_a_block_barrier_then_publishes_and_waits(ptx):
    # Fence.refuse: the marks are plain stores, ordered before the release reductions of the
    # publish by the block barrier (the publish's contract); then the wait of any fence.
    body = [line.strip() for line in ptx["refuse"].splitlines() if not line.strip().startswith(".loc")]
    stores = [i for i, line in enumerate(body) if line.startswith(("st.global.b64", "@%p")) and "st.global" in line]
    barrier = next(i for i, line in enumerate(body) if line.startswith("bar.sync"))
    reds = [i for i, line in enumerate(body) if "red.release.sys.global.add.u64" in line]
    marks = [i for i in stores if i < barrier]  # the later stores: a failed wait's record
    assert len(marks) == 8 and barrier < min(reds), (stores, barrier, reds)
    assert len(reds) == 8 and _lines(ptx["refuse"], "ld.acquire.sys.global.b64") and _lines(ptx["refuse"], "trap;")


def test_split_phase_kernels_contain_only_their_half(ptx):
    assert _lines(ptx["arrive"], "red.release.sys") and not _lines(ptx["arrive"], "ld.acquire.sys")
    assert _lines(ptx["wait"], "ld.acquire.sys") and not _lines(ptx["wait"], "red.release.sys")


def test_grid_fence_counts_arrivals_with_a_gpu_scope_atomic_and_publishes_at_system_scope(ptx):
    tail = ptx["tail"]
    adds = [line for line in _lines(tail, "atom") if "add" in line]
    assert adds and all("gpu" in line and "acq_rel" in line and "sys" not in line for line in adds)
    assert _lines(tail, "red.release.sys") and _lines(tail, "ld.acquire.sys")


def test_peer_address_translation_loads_two_table_entries_and_stores_at_their_difference(ptx):
    # translate_kernel: p = peer_ptr(ptrs, 0, 64, fp32); q = translate(p, ptrs, 0, SIZE - 1); *q = *x.
    # So: the table's entries 0 and 1 (byte 8) loaded once each, their difference taken,
    # 64 bytes added, and one 4-byte store at that address (from one thread).
    text = ptx["translate"]
    loads = _lines(text, "ld.global.b64")
    assert len(loads) == 2, loads  # ptrs[0] (peer_ptr's and translate's, one load) and ptrs[SIZE - 1]
    assert [line for line in _lines(text, "add.s64") if line.endswith(", 8;")]  # &ptrs[1]
    assert [line for line in _lines(text, "add.s64") if line.endswith(", 64;")]  # peer_ptr's byte offset
    subs = _lines(text, "sub.s64")
    stores = _lines(text, "st.global")
    assert len(subs) == 1 and len(stores) == 1 and "st.global.b32" in stores[0], (subs, stores)
    assert text.index(subs[0]) < text.index(stores[0])  # the store goes to the translated address


def test_the_pcp_writer_compiles_with_exact_division_and_the_hardware_fp8_conversion(ptx):
    for split in (0, 1):
        for fused in (0, 1):
            text = ptx[f"writer_split{split}_fused{fused}"]
            assert not text.startswith("COMPILE ERROR"), text
            assert _lines(text, "div.rn.f32")
            assert not _lines(text, "div.full.f32") and not _lines(text, "div.approx")
            assert _lines(text, "cvt.rn.satfinite.e4m3x2.f32")  # the hardware conversion (exact: GPU suite)
            assert not _lines(text, ".ftz")  # no subnormal flushing
            assert bool(_lines(text, "red.release.sys")) == bool(fused)  # the fused tail publishes


def test_the_first_poll_of_a_wait_is_one_acquire_load_and_a_mask(ptx):
    # Everything before the first clock read is the publish and the first poll of wait():
    # for 8 members, one acquire load (a lane per member), the count mask, no flag logic.
    fence = ptx["fence"]
    first = fence[: fence.index("%globaltimer")]
    assert len(_lines(first, "ld.acquire.sys.global.b64")) == 1
    assert _lines(first, "and.b64") and "9223372036854775807" in first  # slot & COUNT_MASK
    assert not _lines(first, "red.release.sys.global.or") and not _lines(first, "trap;")


def test_a_failed_wait_records_the_abort_reason_before_it_traps(ptx):
    fence = ptx["fence"]
    tail = fence[fence.index("%globaltimer") :]
    # the slow poll, the record's reload of the slots, the aborter's reason words
    assert len(_lines(tail, "ld.acquire.sys.global.b64")) >= 3
    assert tail.index("fence.sc.sys") < tail.index("trap;")


def test_abort_marks_each_member_once_with_a_release_or_after_writing_its_reason(ptx):
    abort = ptx["abort"]
    ors = _lines(abort, "red.release.sys.global.or.b64")
    assert len(ors) == 8, ors
    for line in ors:
        assert "mov.u32 t, %tid.x; setp.eq.u32 q, t, 0;" in line and "@p red.release" in line, line
    assert abort.index("bar.sync") < abort.index("red.release.sys.global.or.b64")  # reason first
    assert not _lines(abort, "red.release.sys.global.add")  # the count is never touched


def test_signal_adds_with_a_release_reduction_and_sets_with_a_release_store_from_thread_0(ptx):
    text = ptx["signal"]
    adds, sets = _lines(text, "red.release.sys.global.add.u64"), _lines(text, "st.release.sys.global.b64")
    assert len(adds) == 1 and len(sets) == 1, (adds, sets)
    for line in adds + sets:  # once per call from a 4-warp program
        assert "mov.u32 t, %tid.x; setp.eq.u32 q, t, 0;" in line and "@q " in line, line
    assert not _lines(text, "atom.")  # no reply awaited


def test_signal_waits_poll_with_acquire_loads_and_trap_after_the_record(ptx):
    text = ptx["signal_wait"]
    assert _lines(text, "ld.acquire.sys.global.b64") and _lines(text, "%globaltimer")
    assert text.index("fence.sc.sys") < text.index("trap;")
    # the first poll of each wait is one acquire load before the clock: the flags only on the slow path
    first = text[: text.index("%globaltimer")]
    assert len(_lines(first, "ld.acquire.sys.global.b64")) == 1


def test_put_signal_stores_the_tile_then_a_block_barrier_then_the_release_add(ptx):
    text = ptx["put_signal"]
    adds = _lines(text, "red.release.sys.global.add.u64")
    assert len(adds) == 1, adds
    store = max(text.find("st.global"), 0)
    assert 0 < store < text.index("bar.sync") < text.index("red.release.sys.global.add.u64")


def test_grid_sync_arrives_with_a_gpu_scope_atomic_and_every_program_waits(ptx):
    text = ptx["grid_sync"]
    adds = [line for line in _lines(text, "atom") if "add" in line]
    assert adds and all("gpu" in line and "acq_rel" in line and "sys" not in line for line in adds)
    assert _lines(text, "red.release.sys") and _lines(text, "ld.acquire.sys") and _lines(text, "trap;")


def test_a_collective_sets_its_record_flag_with_a_plain_store_between_system_fences_before_it_traps(ptx):
    # The record is pinned host memory: plain stores (a GPU atomic there needs PCIe atomics), and
    # the flag performed before the trap that would drop it. Arrivals count at GPU scope.
    lines = [
        line for line in ptx["collective"].splitlines() if line.strip() and not line.strip().startswith((".loc", "//"))
    ]
    assert not [line for line in lines if "atom" in line and ".sys" in line]
    assert [line for line in lines if "atom" in line and ".gpu" in line and "add" in line]
    for flag in ptx["collective_flags"]:
        at = [i for i, line in enumerate(lines) if str(flag) in line]
        assert at, flag
        i = at[0]
        before = [j for j in range(i) if "fence.sc.sys" in lines[j]]
        store = next(j for j in range(i, len(lines)) if "st.global" in lines[j])
        after = next(j for j in range(store, len(lines)) if "fence.sc.sys" in lines[j])
        trap = next(j for j in range(store, len(lines)) if "trap;" in lines[j])
        assert before and before[-1] > i - 40 and store < after < trap, (flag, lines[i - 5 : trap + 1])


MOE_KERNELS = [
    "moe_dispatch_send",
    "moe_dispatch_send_fp8",
    "moe_dispatch_send_timed",
    "moe_dispatch_recv",
    "moe_combine_send",
    "moe_combine_reduce",
]


@pytest.mark.parametrize(
    "name",
    MOE_KERNELS
    + [n + "_me1" for n in MOE_KERNELS]
    + [n + "_t1" for n in ("moe_dispatch_send", "moe_dispatch_send_fp8", "moe_combine_reduce")],
)
def test_the_moe_kernels_compile_and_count_their_programs_at_gpu_scope(ptx, name):
    text = ptx[name]
    assert not text.startswith("COMPILE ERROR"), text[:3000]
    # the arrival counter: a GPU-scope acq_rel add (the last program notifies or finishes the step)
    adds = [line for line in _lines(text, "atom.") if "add" in line]
    assert adds and all("gpu" in line and "acq_rel" in line for line in adds), adds
    if "send" in name:  # the last program's signals: release reductions at system scope
        assert _lines(text, "red.release.sys"), name
    if "send" not in name or "dispatch" in name:  # every program's wait: acquire loads, a trap after the record
        assert _lines(text, "ld.acquire.sys") and _lines(text, "trap;"), name
    if "timed" in name:  # the phase clock: the global timer
        assert _lines(text, "%globaltimer"), name
