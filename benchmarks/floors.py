"""Floor kernels: the bytes an operation moves, through the same peer pointers, with no synchronization.

Under MPS every rank of a run shares one GPU, so a peer's memory is the same HBM as a rank's
own: a figure measured there says nothing about NVLink. What it can say is how far an
operation is from the traffic it must do anyway, on the same SM share in the same run. Each
kernel here is that traffic alone: it loads and stores the bytes its operation loads and
stores, at the same offsets of a symmetric buffer of the same layout, through the view's
pointer table (``view.ptrs``), in 16-byte accesses, and never publishes, waits or checks a
header. A floor's results are not meant to be read (a peer may not have written yet); only
its time is. ``benchmarks/shared.py`` times each beside its operation (docs/performance.md).

    fence            publish_floor: one int64 store into the slot this rank has at every other
                     member (the publish without its wait); empty_kernel: the launch alone.
    all-reduce       collective_floor ONE_SHOT: copy the input into this rank's slot, then
                     read every member's slot and write the float32 sum (member order).
                     TWO_SHOT: copy in; sum this rank's chunk of every member's slot into its
                     reduced chunk and the output; copy every other member's reduced chunk out.
    all-gather       GATHER: copy in, then copy every member's slot into the output.
    reduce-scatter   SCATTER: copy in, then sum this rank's chunk of every member's slot.
    MoE dispatch     moe_send_floor: each token's row (fp8: its codes and scales) and its source
                     index into the receiving member's rows at the dispatcher's row;
                     moe_read_floor: this rank's rows copied out to their packed places (each
                     source's from its offset), the routed rows only, as the dispatcher's read.
    MoE combine      moe_return_floor: each received row back into its source member's combine
                     rows at the slot the handle names; moe_sum_floor: each token's top-k rows
                     summed with their weights, as the combine does.
    PCP direct KV    kv_store_floor: the writer's loads and its 656 + 132 cache bytes per token
                     into every replica, with the bytes taken from the inputs' bits instead of
                     quantized, and no fence.

``python benchmarks/floors.py`` checks, on the CPU under Triton's interpreter (one process,
pointer tables of local tensors standing in for the members), that each floor writes
what it should: the sums equal torch's, the rows land where the dispatcher puts them.
"""

from __future__ import annotations

import os
import sys

import triton
import triton.language as tl

import symmsync.language as ssl

#: collective_floor modes.
ONE_SHOT, TWO_SHOT, GATHER, SCATTER = 0, 1, 2, 3
#: Elements per block and warps per program of the collectives' kernel (symmsync.collectives.operations).
COLLECTIVE_BLOCK, COLLECTIVE_WARPS = 1024, 4
#: Chunk rounding of the two-shot all-reduce (symmsync.collectives.layout.CHUNK_ALIGN).
CHUNK_ALIGN = 64


@triton.jit
def empty_kernel(x):
    pass


@triton.jit
def publish_floor(cells, cell, me, value, SIZE: tl.constexpr):
    """One plain int64 store into ``mem[p].cell.slot[me]`` for every member ``p != me``: the
    publish of a fence without the release order, the epoch update or the wait."""
    for p in tl.static_range(SIZE):
        if p != me:
            tl.store(ssl.peer_ptr(cells, p, cell + ssl.SLOTS, tl.int64) + me, value)


@triton.jit
def _copy(dst, src, n, pid, G, BLOCK: tl.constexpr):
    # dst[i] = src[i], i < n: this program's blocks pid, pid + G, ...
    lanes = tl.arange(0, BLOCK)
    b = pid
    while b * BLOCK < n:
        idx = b * BLOCK + lanes
        m = idx < n
        tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)
        b += G


@triton.jit
def _sum(ptrs, src, first, n, dst, dst2, pid, G, ELEM: tl.constexpr, SIZE: tl.constexpr, BLOCK: tl.constexpr,
         TWO: tl.constexpr):  # fmt: skip
    # dst[i] (and dst2[i]) = sum over members p, in member order, of element first + i of p's slot.
    lanes = tl.arange(0, BLOCK)
    b = pid
    while b * BLOCK < n:
        idx = b * BLOCK + lanes
        m = idx < n
        acc = tl.load(tl.multiple_of(ssl.peer_ptr(ptrs, 0, src, ELEM), 16) + first + idx, mask=m).to(tl.float32)
        for p in tl.static_range(1, SIZE):
            theirs = tl.multiple_of(ssl.peer_ptr(ptrs, p, src, ELEM), 16) + first
            acc += tl.load(theirs + idx, mask=m).to(tl.float32)
        v = acc.to(ELEM)
        tl.store(dst + idx, v, mask=m)
        if TWO:
            tl.store(dst2 + idx, v, mask=m)
        b += G


@triton.jit
def collective_floor(x, out, ptrs, me, src, reduced, n, chunk, SIZE: tl.constexpr, MODE: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    """The loads and stores of one collective call, without its headers, publishes or waits.

    ``src``/``reduced``: byte offsets of the input slot and the two-shot reduced chunk (the
    collective's workspace); ``n``: elements of ``x``; ``chunk``: elements of this rank's chunk
    (two-shot, reduce-scatter).
    """
    ELEM: tl.constexpr = x.dtype.element_ty
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    mine = tl.multiple_of(ssl.peer_ptr(ptrs, me, src, ELEM), 16)
    _copy(mine, x, n, pid, G, BLOCK)  # copy in
    if MODE == 0:  # one-shot all-reduce
        _sum(ptrs, src, 0, n, out, out, pid, G, ELEM, SIZE, BLOCK, False)
    elif MODE == 1:  # two-shot all-reduce
        lo = me * chunk
        cnt = tl.maximum(tl.minimum(n, lo + chunk) - lo, 0)
        red = tl.multiple_of(ssl.peer_ptr(ptrs, me, reduced, ELEM), 16)
        _sum(ptrs, src, lo, cnt, red, out + lo, pid, G, ELEM, SIZE, BLOCK, True)
        for p in tl.static_range(SIZE):
            if p != me:
                plo = p * chunk
                pcnt = tl.maximum(tl.minimum(n, plo + chunk) - plo, 0)
                theirs = tl.multiple_of(ssl.peer_ptr(ptrs, p, reduced, ELEM), 16)
                _copy(out + plo, theirs, pcnt, pid, G, BLOCK)
    elif MODE == 2:  # all-gather
        for p in tl.static_range(SIZE):
            theirs = tl.multiple_of(ssl.peer_ptr(ptrs, p, src, ELEM), 16)
            _copy(out + p * n, theirs, n, pid, G, BLOCK)
    else:  # reduce-scatter
        _sum(ptrs, src, me * chunk, chunk, out, out, pid, G, ELEM, SIZE, BLOCK, False)


def two_shot_chunk(numel: int, size: int) -> int:
    """A member's chunk of a two-shot all-reduce: cdiv(numel, size) rounded up to CHUNK_ALIGN."""
    return (-(-numel // size) + CHUNK_ALIGN - 1) // CHUNK_ALIGN * CHUNK_ALIGN


def launch_collective(x, out, ptrs, me: int, src: int, reduced: int, size: int, mode: int, sms: int,
                      chunk: int = 0) -> None:  # fmt: skip
    """One floor call, on the collectives' grid (one program per block, at most one per SM)."""
    n = x.numel()
    grid = (min(sms, max(1, triton.cdiv(n, COLLECTIVE_BLOCK))),)
    collective_floor[grid](
        x, out, ptrs, me, src, reduced, n, chunk, SIZE=size, MODE=mode, BLOCK=COLLECTIVE_BLOCK,
        num_warps=COLLECTIVE_WARPS,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- MoE
@triton.jit
def _codes(v):
    # A byte per value from its bits (the high byte of a 16-bit value): fp8's size, no math.
    return (v.to(tl.int16, bitcast=True) >> 8).to(tl.uint8)


@triton.jit
def moe_send_floor(x, dst_member, dst_row, ptrs, rows_off, scales_off, src_off,
                   TOPK: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, FP8: tl.constexpr,
                   G: tl.constexpr, GP: tl.constexpr):  # fmt: skip
    """Program ``t``: token ``t``'s row (fp8: a byte per value and ``G`` float32 scales) and its
    source index ``t * TOPK + k`` into member ``dst_member[t, k]``'s rows at row ``dst_row[t, k]``
    (-1: not sent), for every entry ``k``: the dispatcher's send, without its quantization."""
    t = tl.program_id(0)
    cols = tl.arange(0, HP)
    v = tl.load(x + t * H + cols, mask=cols < H)
    if FP8:
        codes = _codes(v)
        gs = tl.arange(0, GP)
        scale = tl.zeros([GP], dtype=tl.float32) + 1.0
    for k in tl.static_range(TOPK):
        m = tl.load(dst_member + t * TOPK + k)
        row = tl.load(dst_row + t * TOPK + k)
        if m >= 0:
            if FP8:
                dst = tl.multiple_of(ssl.peer_ptr(ptrs, m, rows_off, tl.uint8), 16)
                tl.store(dst + row * H + cols, codes, mask=cols < H)
                sdst = tl.multiple_of(ssl.peer_ptr(ptrs, m, scales_off, tl.float32), 16)
                tl.store(sdst + row * G + gs, scale, mask=gs < G)
            else:
                dst = tl.multiple_of(ssl.peer_ptr(ptrs, m, rows_off, x.dtype.element_ty), 16)
                tl.store(dst + row * H + cols, v, mask=cols < H)
            tl.store(ssl.peer_ptr(ptrs, m, src_off, tl.int64) + row, t * TOPK + k)


@triton.jit
def moe_read_floor(recv, scales, src, per_source, offsets, ptrs, me, rows_off, scales_off, src_off,
                   SIZE: tl.constexpr, M: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, FP8: tl.constexpr,
                   G: tl.constexpr, GP: tl.constexpr):  # fmt: skip
    """Program ``(e, s)``: the rows member ``s`` sent local expert ``e`` copied out of this rank's
    rows (their count from ``per_source``) to their packed places, from ``offsets[e][s]``: the
    dispatcher's read."""
    pid = tl.program_id(0)
    el = pid // SIZE
    s = pid % SIZE
    n = tl.load(per_source + el * SIZE + s)
    to = el * SIZE * M + tl.load(offsets + el * SIZE + s)
    first = (el * SIZE + s) * M
    cols = tl.arange(0, HP)
    gs = tl.arange(0, GP)
    rows = tl.multiple_of(ssl.peer_ptr(ptrs, me, rows_off, recv.dtype.element_ty), 16) + first * H
    srcs = ssl.peer_ptr(ptrs, me, src_off, tl.int64) + first
    scl = tl.multiple_of(ssl.peer_ptr(ptrs, me, scales_off, tl.float32), 16) + first * G
    for j in range(n):
        tl.store(recv + (to + j) * H + cols, tl.load(rows + j * H + cols, mask=cols < H), mask=cols < H)
        if FP8:
            tl.store(scales + (to + j) * G + gs, tl.load(scl + j * G + gs, mask=gs < G), mask=gs < G)
        tl.store(src + to + j, tl.load(srcs + j))


@triton.jit
def moe_return_floor(out, src, per_source, offsets, ptrs, comb_off, SIZE: tl.constexpr, M: tl.constexpr,
                     H: tl.constexpr, HP: tl.constexpr):  # fmt: skip
    """Program ``(e, s)``: each row member ``s`` sent local expert ``e`` (``per_source`` rows, packed
    from ``offsets[e][s]``) back into ``s``'s combine rows at the slot ``src`` names: the combine's send."""
    pid = tl.program_id(0)
    el = pid // SIZE
    s = pid % SIZE
    n = tl.load(per_source + el * SIZE + s)
    start = el * SIZE * M + tl.load(offsets + el * SIZE + s)
    cols = tl.arange(0, HP)
    dst = tl.multiple_of(ssl.peer_ptr(ptrs, s, comb_off, out.dtype.element_ty), 16)
    for j in range(n):
        row = start + j
        slot = tl.load(src + row)
        tl.store(dst + slot * H + cols, tl.load(out + row * H + cols, mask=cols < H), mask=cols < H)


@triton.jit
def moe_sum_floor(y, weights, ptrs, me, comb_off, TOPK: tl.constexpr, H: tl.constexpr, HP: tl.constexpr):
    """Program ``t``: ``y[t] = sum_k weights[t, k] * row t * TOPK + k`` of this rank's combine rows,
    in float32 in the order ``k = 0 .. TOPK - 1``: the combine's sum (every entry sent)."""
    t = tl.program_id(0)
    cols = tl.arange(0, HP)
    own = tl.multiple_of(ssl.peer_ptr(ptrs, me, comb_off, y.dtype.element_ty), 16)
    acc = tl.zeros([HP], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        w = tl.load(weights + t * TOPK + k)
        acc = acc + w * tl.load(own + (t * TOPK + k) * H + cols, mask=cols < H, other=0).to(tl.float32)
    tl.store(y + t * H + cols, acc.to(y.dtype.element_ty), mask=cols < H)


def moe_placement(topk_idx, experts_per_member: int, size: int, me: int, max_tokens: int):
    """``(member, row)`` int64 ``[tokens, top_k]``: where the dispatcher stores each entry (the rule of
    symmsync.moe.kernels: token ``t`` routed to expert ``e`` lands in row ``(e % EL * W + me) * M + p``
    of member ``e // EL``, ``p`` the tokens before ``t`` routed to ``e``); member -1 where the entry
    is not sent (a negative id, or an expert an earlier entry of the token names)."""
    import torch

    T, K = topk_idx.shape
    E = experts_per_member * size
    ids = topk_idx.clamp(min=0)
    valid = topk_idx >= 0
    for k in range(1, K):  # an expert an earlier entry names is sent once
        valid[:, k] &= (topk_idx[:, :k] != topk_idx[:, k : k + 1]).all(dim=1)
    hit = torch.zeros(T, E, dtype=torch.int64, device=topk_idx.device)
    hit.scatter_(1, ids, valid.to(torch.int64))
    before = hit.cumsum(0) - hit  # tokens before t routed to e
    pos = before.gather(1, ids)
    member = torch.where(valid, ids // experts_per_member, -1)
    row = ((ids % experts_per_member) * size + me) * max_tokens + pos
    return member.contiguous(), row.contiguous()


# --------------------------------------------------------------------------------------------- PCP
_NOPE, _ROPE, _IDX = tl.constexpr(512), tl.constexpr(64), tl.constexpr(128)
_MAIN_TOKEN, _MAIN_SCALES, _ROPE_AT = tl.constexpr(656), tl.constexpr(512), tl.constexpr(528)


@triton.jit
def kv_store_floor(kv_c, k_pe, idx_k, slots, n_rows, dst, main_off, idx_off, main_bstride, idx_bstride,
                   NDST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """The direct-KV writer's loads and stores (symmsync.pcp.kernels) without its quantization and
    fence: rows of bf16 ``kv_c`` [512], ``k_pe`` [64], ``idx_k`` [128]; a token's 656 main-KV bytes
    (a byte per kv_c value, 16 bytes of scale words, its k_pe bits) and 132 indexer bytes (a byte
    per value and a 4-byte field) into each of the ``NDST`` destinations of ``dst``, at its slot."""
    n_items = tl.cdiv(n_rows, BLOCK_T)
    item = tl.program_id(0)
    step = tl.num_programs(0)
    c_nope = tl.arange(0, _NOPE)
    c_idx = tl.arange(0, _IDX)
    c_pe = tl.arange(0, _ROPE)
    c4 = tl.arange(0, 4)
    while item < n_items:
        rows = item * BLOCK_T + tl.arange(0, BLOCK_T)
        in_range = rows < n_rows
        slot = tl.load(slots + rows, mask=in_range, other=-1)
        x = tl.load(kv_c + rows[:, None] * _NOPE + c_nope[None, :], mask=in_range[:, None], other=0)
        xi = tl.load(idx_k + rows[:, None] * _IDX + c_idx[None, :], mask=in_range[:, None], other=0)
        pe = tl.load(k_pe + rows[:, None] * _ROPE + c_pe[None, :], mask=in_range[:, None], other=0)
        codes = _codes(x)
        qi = _codes(xi)
        live = in_range & (slot >= 0)
        slot = tl.where(live, slot, 0)
        words = slot.to(tl.int32)[:, None] + c4[None, :]
        block = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        main_row = main_off + block * main_bstride + off * _MAIN_TOKEN
        block_start = idx_off + block * idx_bstride
        idx_val = block_start + off * _IDX
        idx_scale = block_start + BLOCK_SIZE * _IDX + off * 4
        m_row = live[:, None]
        for d in tl.static_range(NDST):
            base = tl.load(dst + d)
            cache = tl.multiple_of(base.to(tl.pointer_type(tl.uint8)), 16)
            words_at = tl.multiple_of(base.to(tl.pointer_type(tl.int32)), 16)
            values_at = tl.multiple_of(base.to(tl.pointer_type(k_pe.dtype.element_ty)), 16)
            tl.store(cache + main_row[:, None] + c_nope[None, :], codes, mask=m_row)
            tl.store(words_at + ((main_row + _MAIN_SCALES) // 4)[:, None] + c4[None, :], words, mask=m_row)
            tl.store(values_at + ((main_row + _ROPE_AT) // 2)[:, None] + c_pe[None, :], pe, mask=m_row)
            tl.store(cache + idx_val[:, None] + c_idx[None, :], qi, mask=m_row)
            tl.store(words_at + idx_scale // 4, slot.to(tl.int32), mask=live)
        item += step


# ------------------------------------------------------------------------- the interpreter's check
def check() -> list[str]:
    """Run every floor once under Triton's interpreter on local tensors standing in for the members
    (a pointer table of their addresses) and compare with torch: the list of failures (empty: all
    good). Needs ``TRITON_INTERPRET=1`` before Triton is imported."""
    import torch

    failures: list[str] = []

    def expect(name: str, ok: bool) -> None:
        print(f"  {name:58s} {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            failures.append(name)

    size, me, g = 3, 1, torch.Generator().manual_seed(0)
    region = 1 << 16  # bytes of each member's stand-in memory
    mems = [torch.zeros(region, dtype=torch.uint8) for _ in range(size)]
    ptrs = torch.tensor([m.data_ptr() for m in mems], dtype=torch.int64)

    def slot(p: int, off: int, n: int, dtype) -> torch.Tensor:
        return mems[p][off : off + n * dtype.itemsize].view(dtype)

    # fence: a store into every other member's slot for me
    cell = 256
    publish_floor[(1,)](ptrs, cell, me, 7, SIZE=size, num_warps=1)
    got = [int(slot(p, cell + ssl.SLOTS, size, torch.int64)[me]) for p in range(size)]
    expect("publish_floor stores into every other member's slot", got == [7 if p != me else 0 for p in range(size)])
    empty_kernel[(1,)](ptrs)

    # collectives: each member's input left in its slot by an earlier call, as in a run of ranks
    src, red, n = 1024, 32768, 3000
    xs = [torch.randn(n, generator=g) for _ in range(size)]
    for p in range(size):
        slot(p, src, n, torch.float32).copy_(xs[p])
    total = xs[0].clone()
    for v in xs[1:]:
        total += v
    out = torch.zeros(n)
    launch_collective(xs[me], out, ptrs, me, src, red, size, ONE_SHOT, sms=4)
    expect("ONE_SHOT: out is the members' sum", torch.equal(out, total))
    expect(
        "ONE_SHOT: the input was copied into this member's slot", torch.equal(slot(me, src, n, torch.float32), xs[me])
    )
    chunk = two_shot_chunk(n, size)
    for p in range(size):  # the other members' reduced chunks, as their floor calls leave them
        lo = p * chunk
        cnt = max(0, min(n, lo + chunk) - lo)
        slot(p, red, cnt, torch.float32).copy_(total[lo : lo + cnt])
    slot(me, red, chunk, torch.float32).zero_()
    out = torch.zeros(n)
    launch_collective(xs[me], out, ptrs, me, src, red, size, TWO_SHOT, sms=4, chunk=chunk)
    expect("TWO_SHOT: out is the members' sum", torch.equal(out, total))
    lo = me * chunk
    expect("TWO_SHOT: this member's reduced chunk holds its part of the sum",
           torch.equal(slot(me, red, chunk, torch.float32), total[lo : lo + chunk]))  # fmt: skip
    out = torch.zeros(size * n)
    launch_collective(xs[me], out, ptrs, me, src, red, size, GATHER, sms=4)
    expect("GATHER: out is every member's input in order", torch.equal(out, torch.cat(xs)))
    c = n // size
    out = torch.zeros(c)
    launch_collective(xs[me][: size * c], out, ptrs, me, src, red, size, SCATTER, sms=4, chunk=c)
    expect("SCATTER: out is this member's chunk of the sum", torch.equal(out, total[me * c : me * c + c]))

    # MoE: 2 experts a member, 5 tokens, top-2, hidden 256 (fp16 stands in for bf16: numpy has none)
    EL, T, K, H, M = 2, 5, 2, 256, 8
    E = EL * size
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[3, 1] = ids[3, 0]  # a repeated expert is sent once
    ids[4, 0] = -1  # a masked entry is not sent
    member, row = moe_placement(ids, EL, size, me, M)
    x = torch.randn(T, H, generator=g).to(torch.float16)
    rows_off = 0
    for fp8 in (False, True):
        big = [torch.zeros(EL * size * M * H * 2 + EL * size * M * (H // 128) * 4 + 4096, dtype=torch.uint8)
               for _ in range(size)]  # fmt: skip
        bptrs = torch.tensor([b.data_ptr() for b in big], dtype=torch.int64)
        rows_b = EL * size * M * (H if fp8 else 2 * H)
        scales_off = rows_b
        src_off = rows_b + EL * size * M * (H // 128) * 4
        src_off = (src_off + 127) // 128 * 128
        G = H // 128
        moe_send_floor[(T,)](x, member, row, bptrs, rows_off, scales_off, src_off,
                             TOPK=K, H=H, HP=H, FP8=fp8, G=G, GP=triton.next_power_of_2(G))  # fmt: skip
        ok = True
        for t in range(T):
            for k in range(K):
                m, r = int(member[t, k]), int(row[t, k])
                if m < 0:
                    continue
                e = int(ids[t, k])
                ok &= m == e // EL and r // M == (e % EL) * size + me
                if fp8:
                    got = big[m][r * H : (r + 1) * H]
                    want = (x[t].view(torch.int16) >> 8).to(torch.uint8)
                else:
                    got = big[m][r * 2 * H : (r + 1) * 2 * H].view(torch.float16)
                    want = x[t]
                ok &= torch.equal(got, want)
                ok &= int(big[m][src_off + 8 * r : src_off + 8 * r + 8].view(torch.int64)) == t * K + k
        sent = int((member >= 0).sum())
        expect(f"moe_send_floor ({'fp8' if fp8 else 'bf16'}): {sent} rows at the dispatcher's rows", ok)
        # read on member `me`, as rank me would (its per-source counts: what each member sent it)
        per_source = torch.zeros(EL, size, dtype=torch.int64)
        for e in range(EL):
            per_source[e, me] = int(((ids == me * EL + e) & (member >= 0)).sum())
        offsets = per_source.cumsum(1) - per_source
        recv = torch.full((EL, size * M, H), 5, dtype=torch.uint8 if fp8 else torch.float16)
        scales = torch.full((EL, size * M, G), 5.0)
        srcs = torch.full((EL, size * M), 9, dtype=torch.int64)
        moe_read_floor[(EL * size,)](recv, scales, srcs, per_source, offsets, bptrs, me, rows_off, scales_off,
                                     src_off, SIZE=size, M=M, H=H, HP=H, FP8=fp8, G=G,
                                     GP=triton.next_power_of_2(G))  # fmt: skip
        ok = True
        for e in range(EL):
            n_in = int(per_source[e, me])
            at = int(offsets[e, me])
            for j in range(M):
                r = (e * size + me) * M + j
                if j < n_in:
                    if fp8:
                        ok &= torch.equal(recv[e, at + j], big[me][r * H : (r + 1) * H])
                    else:
                        ok &= torch.equal(recv[e, at + j], big[me][r * 2 * H : (r + 1) * 2 * H].view(torch.float16))
                    ok &= int(srcs[e, at + j]) == int(big[me][src_off + 8 * r : src_off + 8 * r + 8].view(torch.int64))
            ok &= bool((recv[e, int(per_source[e].sum()) :] == 5).all())  # nothing past the count
        expect(f"moe_read_floor ({'fp8' if fp8 else 'bf16'}): the received rows at their packed places", ok)

    # combine: rows received by `me` go back to their sources' combine rows, then a weighted sum
    comb = [torch.zeros(T * K * H * 2, dtype=torch.uint8) for _ in range(size)]
    cptrs = torch.tensor([b.data_ptr() for b in comb], dtype=torch.int64)
    out_rows = torch.randn(EL, size * M, H, generator=g).to(torch.float16)
    per_source = torch.tensor([[2, 0, 1], [1, 1, 0]], dtype=torch.int64)
    offsets = per_source.cumsum(1) - per_source
    srcs = torch.full((EL, size * M), -1, dtype=torch.int64)
    srcs[0, 0], srcs[0, 1], srcs[0, 2] = 3, 6, 1  # expert 0: member 0's two rows, then member 2's
    srcs[1, 0], srcs[1, 1] = 4, 9  # expert 1: member 0's row, then member 1's
    moe_return_floor[(EL * size,)](out_rows, srcs, per_source, offsets, cptrs, 0, SIZE=size, M=M, H=H, HP=H)
    ok = True
    for e, s, r, t in ((0, 0, 0, 3), (0, 0, 1, 6), (0, 2, 2, 1), (1, 0, 0, 4), (1, 1, 1, 9)):
        ok &= torch.equal(comb[s][t * H * 2 : (t + 1) * H * 2].view(torch.float16), out_rows[e, r])
    expect("moe_return_floor: each row at its source's slot", ok)
    w = torch.rand(T, K, generator=g)
    y = torch.zeros(T, H, dtype=torch.float16)
    moe_sum_floor[(T,)](y, w, cptrs, me, 0, TOPK=K, H=H, HP=H)
    rows_me = comb[me].view(torch.float16).view(T, K, H).float()
    want = torch.zeros(T, H)
    for k in range(K):
        want = want + w[:, k : k + 1] * rows_me[:, k]
    expect("moe_sum_floor: the weighted sum of each token's rows", torch.equal(y, want.to(torch.float16)))

    # PCP: 3 replicas, 2 blocks of 4 slots, 6 rows (one padding)
    bs, nblocks, rows_n = 4, 3, 6
    main_b, idx_b = bs * 656, bs * 132
    main_off, idx_off = 128, 128 + ((nblocks * main_b + 127) // 128) * 128
    reps = [torch.zeros(idx_off + nblocks * idx_b + 256, dtype=torch.uint8) for _ in range(size)]
    dst = torch.tensor([r.data_ptr() for r in reps], dtype=torch.int64)
    kv = torch.randint(-30000, 30000, (rows_n, 512), generator=g, dtype=torch.int16)
    pe = torch.randint(-30000, 30000, (rows_n, 64), generator=g, dtype=torch.int16)
    ix = torch.randint(-30000, 30000, (rows_n, 128), generator=g, dtype=torch.int16)
    slots = torch.tensor([0, 5, 6, -1, 9, 2], dtype=torch.int64)
    kv_store_floor[(2,)](kv, pe, ix, slots, rows_n, dst, main_off, idx_off, main_b, idx_b,
                         NDST=size, BLOCK_T=4, BLOCK_SIZE=bs, num_warps=1)  # fmt: skip
    ok = True
    written = torch.zeros_like(reps[0], dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, bs)
        mrow = main_off + b * main_b + o * 656
        ib = idx_off + b * idx_b
        for r in reps:
            ok &= torch.equal(r[mrow : mrow + 512], (kv[i] >> 8).to(torch.uint8))
            ok &= torch.equal(r[mrow + 528 : mrow + 656].view(torch.int16), pe[i])
            ok &= torch.equal(r[mrow + 512 : mrow + 528].view(torch.int32), torch.arange(4, dtype=torch.int32) + s)
            ok &= torch.equal(r[ib + o * 128 : ib + o * 128 + 128], (ix[i] >> 8).to(torch.uint8))
            ok &= int(r[ib + bs * 128 + o * 4 : ib + bs * 128 + o * 4 + 4].view(torch.int32)) == s
        written[mrow : mrow + 656] = True
        written[ib + o * 128 : ib + o * 128 + 128] = True
        written[ib + bs * 128 + o * 4 : ib + bs * 128 + o * 4 + 4] = True
    untouched = all(int(r[~written].count_nonzero()) == 0 for r in reps)
    expect("kv_store_floor: 656 + 132 bytes per token at its slot in every replica", ok)
    expect("kv_store_floor: no other byte written (padding row skipped)", untouched)
    return failures


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run the check under Triton's interpreter: TRITON_INTERPRET=1 python benchmarks/floors.py")
    print("floor kernels under Triton's interpreter:")
    bad = check()
    print("all floors write what they should" if not bad else f"FAILED: {bad}")
    sys.exit(1 if bad else 0)
