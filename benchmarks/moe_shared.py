"""``benchmarks/moe.py --shared``: the dispatcher on ranks sharing one GPU under MPS.

What a world measures, in this order (the targets' figures first, so that a world cut short by
its share of the budget keeps them; ``benchmarks/shared.py`` runs it):

* the run's copy bandwidth (a large ``copy_``, every rank at once) and a fence of the same world;
* dispatch and combine, bf16 and fp8 (e4m3 codes and a scale per 128 channels), hidden 7168,
  top-8, 8 experts a rank, ``max_tokens`` 256, at 1, 32, 128 and 256 tokens a rank, in
  CUDA-graph replay and eagerly (``Sizes.plan_first``, then ``plan_last``), each beside
  its floor kernels (``floors.moe_send_floor + moe_read_floor``, ``moe_return_floor +
  moe_sum_floor``) and torch's kernels for the same rows (``index_select`` of the sent rows then
  of the received rows; ``index_select`` of the returned rows then their sum over the top-k, or
  ``index_add_``): the floor rule of ``shared.py`` picks the floor; each row's bytes moved give
  its time at the run's copy bandwidth; each row checked on every rank against the floor's; in
  graph replay also torch's one kernel for the rows the step delivers (``index_select`` of the
  routed rows out of the tokens; their sum into the tokens, ``sum`` or ``index_add_``), what the
  targets hold the steps to;
* the host cost of an eager dispatch and combine against a torch ``index_select`` (wall time of
  back-to-back calls, nothing synchronized in between);
* a Mixtral-like layer with and without the transfer, and with ``wait=False`` overlap
  (``moe_layer.py``);
* the dispatcher's ``programs`` at 1, 2, 4, 8 and 16 a multiprocessor, bf16, 128 tokens, graph
  replay, three rounds (each round in another order), which value is fastest in each.

The floors write into a second buffer of their own layout (:func:`floor_layout`: the regions a
dispatcher of these arguments needs, one parity), with the placement :func:`floors.moe_placement`
gives; their checks compare what they leave with the dispatcher's outputs through its public
API only (the packed rows, ``handle.src``, ``handle.per_source``, ``handle.offsets``).
``moe_targets.py`` reads the rows and notes into the targets.
"""

from __future__ import annotations

import dataclasses

import torch
from moe import HIDDEN, TOP_K, routing
from moe_targets import ROWS_ADD, ROWS_DISPATCH, ROWS_SUM


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a world measures: :data:`GPU` under MPS, :data:`SMOKE` on the host backend (``--smoke``)."""

    hidden: int = HIDDEN
    top_k: int = TOP_K
    max_tokens: int = 256
    experts_per_rank: int = 8
    #: (dtype, tokens a rank, mode) measured first: the targets' figures.
    plan_first: tuple = (
        ("bf16", 128, "graph"), ("fp8", 128, "graph"), ("bf16", 1, "graph"), ("fp8", 1, "graph"),
        ("bf16", 32, "graph"), ("bf16", 32, "eager"), ("bf16", 128, "eager"), ("fp8", 32, "graph"),
        ("fp8", 32, "eager"), ("fp8", 128, "eager"),
    )  # fmt: skip
    #: Measured after the host cost, the layer and the sweep.
    plan_last: tuple = (("bf16", 256, "graph"), ("bf16", 256, "eager"), ("fp8", 256, "graph"), ("fp8", 256, "eager"))
    #: The dispatcher's ``programs`` of the sweep, a multiprocessor (times the SMs the rank's device reports).
    programs_per_sm: tuple = (1, 2, 4, 8, 16)
    sweep_rounds: int = 3
    sweep_tokens: int = 128
    host_tokens: int = 128
    host_calls: int = 50
    target_tokens: int = 128  # the rows the targets against torch's kernels read
    eager_from: int = 32  # the eager rows the "eager <= graph + 15 µs" target reads, from these tokens up
    layer: dict = dataclasses.field(default_factory=dict)  # moe_layer.make's sizes ({}: its defaults)


GPU = Sizes()
SMOKE = Sizes(
    hidden=256, top_k=2, max_tokens=8, experts_per_rank=2,
    plan_first=(("bf16", 4, "graph"), ("fp8", 4, "graph"), ("bf16", 1, "graph"), ("fp8", 1, "graph"),
                ("bf16", 4, "eager")),
    plan_last=(("fp8", 8, "eager"),), programs_per_sm=(1, 2), sweep_tokens=4, host_tokens=4, host_calls=2,
    target_tokens=4, eager_from=4,
    layer={"hidden": 128, "ffn": 64, "experts": 4, "top_k": 2, "shared_ffn": 64, "tokens": 4, "dtype": torch.float32},
)  # fmt: skip

LINE = 128


def _up(n: int) -> int:
    return (n + LINE - 1) // LINE * LINE


def floor_layout(el: int, size: int, max_tokens: int, hidden: int, top_k: int, fp8: bool) -> dict[str, int]:
    """Byte offsets of the floors' regions in their own buffer: ``rows`` (a row per (local expert,
    source, token): ``hidden`` bf16 values, or ``hidden`` codes with fp8), ``scales`` (fp8: a float32
    per 128 channels), ``src`` (an int64 per row), ``combine`` (``max_tokens * top_k`` bf16 rows),
    and ``nbytes``."""
    cap = el * size * max_tokens
    scales = _up(cap * (hidden if fp8 else 2 * hidden))
    src = scales + (_up(cap * (hidden // 128) * 4) if fp8 else 0)
    combine = src + _up(cap * 8)
    return {"rows": 0, "scales": scales, "src": src, "combine": combine,
            "nbytes": combine + _up(max_tokens * top_k * hidden * 2)}  # fmt: skip


class Kind:
    """One kind of row (bf16, or fp8): its dispatcher, the floors' buffer, and what they write."""

    def __init__(self, ctx, z: Sizes, fp8: bool):
        import symmsync as ss
        from symmsync import moe

        w, bf16, dev, H, K = ctx.world, torch.bfloat16, ctx.device, z.hidden, z.top_k
        self.fp8, self.name = fp8, "fp8" if fp8 else "bf16"
        self.E, self.EL, self.M = z.experts_per_rank * w, z.experts_per_rank, z.max_tokens
        self.buf = ss.SymmetricBuffer(moe.buffer_bytes(self.E, self.M, H, bf16, K, w, fp8=fp8), backend=ctx.backend)
        self.lay = floor_layout(self.EL, w, self.M, H, K, fp8)
        self.fbuf = ss.SymmetricBuffer(self.lay["nbytes"], backend=ctx.backend)
        self.view, self.fview = self.buf.view(list(range(w))), self.fbuf.view(list(range(w)))
        self.disp = moe.Dispatcher(self.view, self.E, self.M, H, bf16, K, fp8=fp8, timeout_s=ctx.wait_s)
        self.cap, G = self.EL * w * self.M, H // 128
        self.frecv = torch.empty((self.EL, w * self.M, H), dtype=torch.uint8 if fp8 else bf16, device=dev)
        self.fscales = torch.empty((self.EL, w * self.M, G), dtype=torch.float32, device=dev)
        self.fsrc = torch.empty((self.EL, w * self.M), dtype=torch.int64, device=dev)

    def close(self) -> None:
        self.disp.close()
        self.buf.close()
        self.fbuf.close()


def shared_rank(ctx) -> None:
    """Every figure of a world (the module's docstring), in its order; what cannot start before the
    world's budget is spent is recorded as skipped. A part that raises (the same on every rank: a
    device failure is caught in the timing) is noted in the world's notes and the next part runs."""
    import moe_layer

    z = SMOKE if ctx.backend == "host" else GPU
    w, dev = ctx.world, ctx.device
    ctx.copy_gbps()
    _guard(ctx, "fence", _fence, ctx)
    kinds: dict[str, Kind] = {}
    try:
        for fp8 in (False, True):
            k = Kind(ctx, z, fp8)
            kinds[k.name] = k
        expert_out = torch.randn((z.experts_per_rank, w * z.max_tokens, z.hidden), device=dev).to(torch.bfloat16)
        for kind, tokens, mode in z.plan_first:
            _guard(ctx, f"{kind} {tokens} {mode}", _step_figures, ctx, z, kinds[kind], tokens, mode, expert_out)
        if ctx.time_left():
            _guard(ctx, "host cost", _host_cost, ctx, z, kinds["bf16"], expert_out)
        if ctx.time_left():
            _guard(ctx, "layer", moe_layer.shared_figure, ctx, **z.layer)
        _guard(ctx, "programs sweep", _sweep, ctx, z, kinds["bf16"], expert_out)
        for kind, tokens, mode in z.plan_last:
            _guard(ctx, f"{kind} {tokens} {mode}", _step_figures, ctx, z, kinds[kind], tokens, mode, expert_out)
    finally:
        ctx.barrier()
        for k in kinds.values():
            k.close()


def _guard(ctx, what: str, fn, *args, **kwargs) -> None:
    """``fn(*args, **kwargs)``; what it raised on any rank goes to the notes (``errors``), and the world goes on."""
    import traceback

    try:
        fn(*args, **kwargs)
        local = None
    except Exception:  # noqa: BLE001 - noted; the next part runs
        local = traceback.format_exc()[-800:]
    every = ctx.agree(local)
    bad = [f"rank {r}: {v}" for r, v in enumerate(every) if v]
    if bad:
        ctx.errors = {**getattr(ctx, "errors", {}), what: " | ".join(bad)[:2000]}
        ctx.note("errors", ctx.errors)
        ctx.say(f"{what} failed: {bad[0][-300:]}")


def _fence(ctx) -> None:
    """A fence of the same world (``Fence.fence()``, graph replay): what one token is held against."""
    import floors

    import symmsync as ss

    w = ctx.world
    buf = ss.SymmetricBuffer(1 << 16, backend=ctx.backend, channels=4)
    try:
        view = buf.view(list(range(w)))
        fence = ss.Fence(view, channel=0, timeout_s=ctx.wait_s)
        cells, at, me = view.cell_ptrs, view.cell_offset(3), view.local_index  # channel 3: no fence's
        src = torch.arange(max(1, w - 1), dtype=torch.int64, device=ctx.device)
        dst = torch.empty_like(src)
        ctx.figure(
            "Fence.fence() (one token's yardstick)",
            fence.fence,
            lambda: floors.publish_floor[(1,)](cells, at, me, 7, SIZE=w, num_warps=1),
            "publish_floor (the publish without its wait)",
            f"one int64 store into the slot this rank has at each of the {w - 1} other members, one launch",
            iters=4 * ctx.iters,
            torch_floor={f"copy_ of {w - 1} int64": lambda: dst.copy_(src)},
            check=lambda: _fenced(ctx, fence),
            tags={"what": "fence", "mode": "graph"},
        )
    finally:
        ctx.barrier()
        buf.close()


def _fenced(ctx, fence) -> bool | str:
    """One more fence returns on every rank, the device synchronized after it."""
    fence.fence()
    ctx.sync()
    return True


def _step_figures(ctx, z: Sizes, k: Kind, T: int, mode: str, expert_out: torch.Tensor) -> None:
    """The dispatch and combine figures of ``T`` tokens a rank in ``mode``, each beside its floor
    kernels and torch's kernels for the same rows, each checked on every rank."""
    import floors
    import triton

    w, dev, bf16, fp8, disp = ctx.world, ctx.device, torch.bfloat16, k.fp8, k.disp
    H, K, EL, M = z.hidden, z.top_k, k.EL, k.M
    HP, G = triton.next_power_of_2(H), H // 128
    GP = triton.next_power_of_2(G)
    lay, fptrs, me = k.lay, k.fview.ptrs, k.fview.local_index
    ids, weights, g = routing(T, disp.num_experts, 1000 + 7 * T + ctx.rank, dev, K)
    x = torch.randn(T, H, generator=g).to(bf16).to(dev)
    with torch.no_grad():
        recv, counts, handle = disp.dispatch(x, ids)
    ctx.sync()
    member, row = floors.moe_placement(ids, EL, w, me, M)
    per_source, offsets = handle.per_source, handle.offsets
    frecv, fscales, fsrc = k.frecv, k.fscales, k.fsrc

    def floor_dispatch() -> None:
        floors.moe_send_floor[(T,)](x, member, row, fptrs, lay["rows"], lay["scales"], lay["src"],
                                    TOPK=K, H=H, HP=HP, FP8=fp8, G=G, GP=GP)  # fmt: skip
        floors.moe_read_floor[(EL * w,)](frecv, fscales, fsrc, per_source, offsets, fptrs, me, lay["rows"],
                                         lay["scales"], lay["src"], SIZE=w, M=M, H=H, HP=HP, FP8=fp8,
                                         G=G, GP=GP)  # fmt: skip

    def dispatch_check():
        ctx.barrier()
        for _ in range(2):  # every member's rows in place before the read of the second round
            floor_dispatch()
            ctx.barrier()
        for e, n in enumerate(counts.tolist()):  # the received rows, packed: past the counts, nothing
            if not torch.equal(fsrc[e, :n], handle.src[e, :n]):
                return "source indices differ from the dispatcher's"
            if not fp8 and not torch.equal(frecv[e, :n].view(torch.int16), recv[e, :n].view(torch.int16)):
                return "received rows differ from the dispatcher's"
        return True

    sent, received = int((member >= 0).sum()), int(per_source.sum())
    rb = H + 4 * G if fp8 else 2 * H
    # torch's kernels for the same rows: the sent rows gathered from the tokens, then the received
    # rows gathered out of a region of the dispatcher's size to their packed places.
    src_rows = torch.empty(T, rb, dtype=torch.uint8, device=dev) if fp8 else x
    send_idx = (member >= 0).nonzero()[:, 0].contiguous()
    stage = torch.empty((sent, rb) if fp8 else (sent, H), dtype=src_rows.dtype, device=dev)
    region = expert_out.view(torch.uint8).view(-1)[: k.cap * rb].view(k.cap, rb) if fp8 else expert_out.view(-1, H)
    ps = per_source.tolist()
    at = [(e * w + s) * M + j for e in range(EL) for s in range(w) for j in range(ps[e][s])]
    recv_idx = torch.tensor(at, dtype=torch.int64, device=dev)
    packed = torch.empty((received, region.shape[1]), dtype=region.dtype, device=dev)

    def torch_dispatch() -> None:
        torch.index_select(src_rows, 0, send_idx, out=stage)
        torch.index_select(region, 0, recv_idx, out=packed)

    tags = {"what": "step", "kind": k.name, "tokens": T, "mode": mode, "target_size": T == z.target_tokens,
            "eager_judged": T >= z.eager_from}  # fmt: skip
    what = f"{T} tokens a rank, hidden {H}, top-{K}, {EL} experts a rank, max_tokens {M}, {mode}"
    ctx.figure(
        f"dispatch {k.name} {T} tok {mode}",
        lambda: disp.dispatch(x, ids),
        floor_dispatch,
        "moe_send_floor + moe_read_floor",
        f"{what}: {sent} rows of {rb} B stored into the owners' rows (+ 8 B source index each), then the "
        f"{received} rows this rank received written out to their packed places (as the dispatcher's read)",
        mode=mode,
        iters=max(20, ctx.iters // 4),
        check=dispatch_check,
        torch_floor={"index_select (sent rows) + index_select (received rows)": torch_dispatch},
        more={ROWS_DISPATCH: lambda: torch.index_select(src_rows, 0, send_idx, out=stage)} if mode == "graph" else {},
        bytes_moved=T * 2 * H + (sent + 2 * received) * (rb + 8),
        tags={**tags, "step": "dispatch", "torch_rows": [ROWS_DISPATCH] if mode == "graph" else []},
    )
    fy = torch.empty(T, H, dtype=bf16, device=dev)
    with torch.no_grad():  # the timed dispatches left this handle behind: a combine takes one of the last two
        recv, counts, handle = disp.dispatch(x, ids)

    def floor_combine() -> None:
        floors.moe_return_floor[(EL * w,)](expert_out, handle.src, per_source, offsets, fptrs, lay["combine"],
                                           SIZE=w, M=M, H=H, HP=HP)  # fmt: skip
        floors.moe_sum_floor[(T,)](fy, weights, fptrs, me, lay["combine"], TOPK=K, H=H, HP=HP,
                                   enable_fp_fusion=False)  # fmt: skip

    def combine_check():
        with torch.no_grad():
            want = disp.combine(expert_out, weights, handle)
        ctx.barrier()
        for _ in range(2):
            floor_combine()
            ctx.barrier()
        if torch.equal(fy.view(torch.int16), want.view(torch.int16)):
            return True
        diff = (fy.float() - want.float()).abs()
        if ctx.backend == "host" and bool((diff <= want.float().abs() * 2**-7 + 1e-6).all()):
            return True  # the interpreter's float32 -> bf16 cast is not the GPU's: one rounding apart
        return f"sums differ at {int((diff > 0).sum())} of {diff.numel()} values (largest {diff.max().item():.3g})"

    # torch's: the received rows gathered (as returned), then each token's top-k rows summed.
    flat = expert_out.view(-1, H)
    cs = counts.tolist()
    gather_idx = torch.tensor([e * w * M + j for e in range(EL) for j in range(cs[e])], dtype=torch.int64, device=dev)
    ret = torch.empty(max(received, T * K), H, dtype=bf16, device=dev)
    tsum, tadd = torch.empty(T, H, dtype=bf16, device=dev), torch.zeros(T, H, dtype=bf16, device=dev)
    token_of = torch.arange(T * K, device=dev) // K

    def torch_sum() -> None:
        torch.index_select(flat, 0, gather_idx, out=ret[:received])
        torch.sum(ret[: T * K].view(T, K, H), dim=1, out=tsum)

    def torch_add() -> None:
        torch.index_select(flat, 0, gather_idx, out=ret[:received])
        tadd.index_add_(0, token_of, ret[: T * K])

    ctx.figure(
        f"combine {k.name} {T} tok {mode}",
        lambda: disp.combine(expert_out, weights, handle),
        floor_combine,
        "moe_return_floor + moe_sum_floor",
        f"{what}: the {received} rows this rank received ({2 * H} B each) stored back into their sources' "
        f"combine rows, then {T} x {K} rows read and summed per token",
        mode=mode,
        iters=max(20, ctx.iters // 4),
        check=combine_check,
        torch_floor={"index_select + sum over top-k": torch_sum, "index_select + index_add_": torch_add},
        more={
            ROWS_SUM: lambda: torch.sum(ret[: T * K].view(T, K, H), dim=1, out=tsum),
            ROWS_ADD: lambda: tadd.index_add_(0, token_of, ret[: T * K]),
        }
        if mode == "graph"
        else {},
        bytes_moved=received * (4 * H + 8) + sent * 2 * H + T * 2 * H,
        tags={**tags, "step": "combine", "torch_rows": [ROWS_SUM, ROWS_ADD] if mode == "graph" else []},
    )


def _host_cost(ctx, z: Sizes, k: Kind, expert_out: torch.Tensor) -> None:
    """Host µs per eager dispatch and combine (bf16, ``host_tokens`` tokens) against a torch
    ``index_select`` of the same rows on the same device: wall time of ``host_calls`` back-to-back
    calls, nothing synchronized in between."""
    T, disp, n = z.host_tokens, k.disp, z.host_calls
    ids, weights, g = routing(T, disp.num_experts, 77 + ctx.rank, ctx.device, z.top_k)
    x = torch.randn(T, z.hidden, generator=g).to(torch.bfloat16).to(ctx.device)
    rows = torch.randint(0, T, (T * z.top_k,), device=ctx.device)
    with torch.no_grad():
        _, _, handle = disp.dispatch(x, ids)
        d = ctx.host_us(lambda: disp.dispatch(x, ids), n)
        _, _, handle = disp.dispatch(x, ids)  # a combine takes a handle of the last two dispatches
        c = ctx.host_us(lambda: disp.combine(expert_out, weights, handle), n)
    t = ctx.host_us(lambda: x.index_select(0, rows), n)
    note = {"tokens": T, "calls": n, "dispatch": d, "combine": c, f"torch index_select of {T * z.top_k} rows": t}
    if all(isinstance(v, float) for v in (d, c, t)) and t:
        note.update(dispatch_ratio=round(d / t, 3), combine_ratio=round(c / t, 3))
    ctx.note("host_us", note)
    ctx.say(f"host µs per call: {note}")


def _sweep(ctx, z: Sizes, k: Kind, expert_out: torch.Tensor) -> None:
    """The dispatcher's ``programs`` at each of ``programs_per_sm`` a multiprocessor, bf16,
    ``sweep_tokens`` tokens, graph replay, ``sweep_rounds`` rounds (each in another order), in a
    buffer of its own; each value's combine checked against the main dispatcher's bits."""
    import symmsync as ss
    from symmsync import moe

    w, T, bf16, H, K, per = ctx.world, z.sweep_tokens, torch.bfloat16, z.hidden, z.top_k, z.programs_per_sm
    if not ctx.time_left():
        ctx.note("programs_sweep", {"status": "skipped: budget"})
        return
    ids, weights, g = routing(T, k.E, 500 + ctx.rank, ctx.device, K)
    x = torch.randn(T, H, generator=g).to(bf16).to(ctx.device)
    with torch.no_grad():
        _, _, handle = k.disp.dispatch(x, ids)
        want = k.disp.combine(expert_out, weights, handle).clone()
    buf = ss.SymmetricBuffer(moe.buffer_bytes(k.E, k.M, H, bf16, K, w), backend=ctx.backend)
    view, rounds, n = buf.view(list(range(w))), [], len(per)
    iters = max(20, ctx.iters // 4)
    try:
        for r in range(z.sweep_rounds):
            order = per[r % n :] + per[: r % n]
            us: dict[str, dict] = {}
            for per_sm in order:
                if not ctx.time_left():
                    break
                disp = moe.Dispatcher(view, k.E, k.M, H, bf16, K, timeout_s=ctx.wait_s, programs=per_sm * ctx.sms)
                try:
                    with torch.no_grad():
                        _, _, h = disp.dispatch(x, ids)
                    d = ctx.time(lambda disp=disp: disp.dispatch(x, ids), "graph", iters)
                    with torch.no_grad():  # a combine takes a handle of the last two dispatches
                        _, _, h = disp.dispatch(x, ids)
                    c = ctx.time(lambda disp=disp, h=h: disp.combine(expert_out, weights, h), "graph", iters)
                    ok = ctx.run_check(lambda disp=disp, h=h: True if torch.equal(
                        disp.combine(expert_out, weights, h).view(torch.int16), want.view(torch.int16))
                        else "combine differs from the default dispatcher's")  # fmt: skip
                finally:
                    ctx.barrier()
                    disp.close()
                us[str(per_sm)] = {"dispatch": d, "combine": c, "check": ok}
            timed = {p: v["dispatch"] + v["combine"] for p, v in us.items()
                     if isinstance(v["dispatch"], float) and isinstance(v["combine"], float)}  # fmt: skip
            best = int(min(timed, key=timed.get)) if timed else None
            rounds.append({"order": list(order), "us": us, "best_programs_per_sm": best})
            ctx.say(f"programs sweep round {r + 1}: best {best} a multiprocessor ({timed})")
    finally:
        ctx.barrier()
        buf.close()
    ctx.note("programs_sweep", {"tokens": T, "sms": ctx.sms, "per_sm": list(per), "rounds": rounds,
                                "best": [r["best_programs_per_sm"] for r in rounds]})  # fmt: skip
