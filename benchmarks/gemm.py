"""symmsync.gemm against the unfused pair built from symmsync's own collectives, and the compute floor.

Ranks sharing one GPU under MPS (``benchmarks/shared.py``: each rank on ``100 // W`` percent of
the SMs, CUDA-graph replay, the slower rank's median)::

    PYTHONPATH=. python benchmarks/gemm.py --shared --worlds 2,4,8 --budget-s 360

A Llama-70B-like tensor-parallel MLP (hidden 8192, intermediate 28672 split over the ``W``
members), ``m`` local rows from 16 up (``ROWS``; the largest that fits ``MEMORY_GB`` on the
GPU, the members' buffers together):

* ``AllGatherMatmul m=...``: ``ag_mm(a, w1)``, ``a`` this member's ``m x 8192`` rows, ``w1``
  its ``8192 x 28672/W`` columns; beside ``all_gather`` (symmsync.collectives.AllGather) then
  ``torch.matmul`` (``unfused``), and ``torch.matmul`` of the whole gathered input alone (the
  compute floor: the figure's ``floor``);
* ``MatmulReduceScatter m=...``: ``mm_rs(h, w2)``, ``h`` this member's ``W*m x 28672/W``, ``w2``
  its ``28672/W x 8192``; beside ``torch.matmul`` then ``reduce_scatter``
  (symmsync.collectives.ReduceScatter), and ``torch.matmul`` alone.

Every row is checked on every rank: integer-valued inputs make the fused and the unfused results
equal bit for bit (their float32 sums are exact). ``targets()`` reads a run's JSON and says, per
world, whether the fused call is never slower than the unfused pair, at least 1.2x faster from
m = 2048, and within 1.15x of the compute floor at the largest m; it writes them into the JSON
(``gemm_targets``) and prints them. Writes ``gemm_<machine>_mps.json`` and ``.png``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HIDDEN, INTERMEDIATE = 8192, 28672
ROWS = (16, 128, 512, 2048, 4096, 8192)
#: GiB of GPU memory the members' buffers and tensors may take together (the largest m is chosen by it).
MEMORY_GB = 60
#: Calls per captured graph, by the call's size (fewer for the large ones: a figure's time stays short).
ITERS = {16: 50, 128: 50, 512: 20, 2048: 5, 4096: 3, 8192: 2}


def _gb_per_rank(w: int, m: int) -> float:
    """GiB one rank takes at ``m`` rows: both consumers' regions, the collectives' workspaces, the
    inputs, weights and outputs of the fused and unfused calls."""
    n = INTERMEDIATE // w
    e = 2  # bfloat16
    regions = 2 * w * m * HIDDEN * e * 2
    workspaces = 2 * (2 * w * m * HIDDEN * e) + 2 * (2 * w * m * HIDDEN * e)
    tensors = (m * HIDDEN + 4 * w * m * HIDDEN + 2 * w * m * n + 2 * HIDDEN * n + 2 * m * HIDDEN) * e
    return (regions + workspaces + tensors) / 2**30


def rows_for(w: int) -> list[int]:
    """The row counts measured at world ``w``: those whose memory fits :data:`MEMORY_GB`."""
    return [m for m in ROWS if w * _gb_per_rank(w, m) <= MEMORY_GB]


def shared_rank(ctx) -> None:
    """Every figure of one world, on one rank (``benchmarks/shared.py``)."""
    import symmsync as ss
    from symmsync import collectives as C
    from symmsync import gemm

    w, me, dev, bf16 = ctx.world, ctx.rank, ctx.device, torch.bfloat16
    n = INTERMEDIATE // w
    rows = rows_for(w)
    top = max(rows)
    ctx.note("gemm_rows", rows)
    sizes = {
        "ag_mm": gemm.all_gather_matmul_bytes(w, top, HIDDEN, bf16),
        "mm_rs": gemm.matmul_reduce_scatter_bytes(w, top, HIDDEN, bf16),
        "ag": C.workspace_bytes(top * HIDDEN, bf16, w, op="all_gather"),
        "rs": C.workspace_bytes(w * top * HIDDEN, bf16, w, op="reduce_scatter"),
    }
    plan = ss.carve(**sizes)
    buf = ss.SymmetricBuffer(plan.nbytes, backend="cuda")
    try:
        view = buf.view(list(range(w)))
        ag_mm = gemm.AllGatherMatmul(view, top, HIDDEN, bf16, offset=plan["ag_mm"], timeout_s=ctx.wait_s)
        mm_rs = gemm.MatmulReduceScatter(view, top, HIDDEN, bf16, offset=plan["mm_rs"], timeout_s=ctx.wait_s)
        ag = C.AllGather(view, top * HIDDEN, bf16, offset=plan["ag"], channel=0, timeout_s=ctx.wait_s)
        rs = C.ReduceScatter(view, w * top * HIDDEN, bf16, offset=plan["rs"], channel=1, timeout_s=ctx.wait_s)
        g = torch.Generator(dev).manual_seed(100 + me)

        def ints(*shape):
            return torch.randint(-2, 3, shape, generator=g, device=dev).to(bf16)

        w1, w2 = ints(HIDDEN, n), ints(n, HIDDEN)
        for m in rows:
            iters = ITERS[m]
            a, h = ints(m, HIDDEN), ints(w * m, n)
            fused, gathered, unfused = (torch.empty(w * m, n, dtype=bf16, device=dev) for _ in range(3))
            whole = torch.empty(w * m, HIDDEN, dtype=bf16, device=dev)
            ag(a, out=whole.view(-1))
            partial = torch.empty(w * m, HIDDEN, dtype=bf16, device=dev)
            rfused, runfused = (torch.empty(m, HIDDEN, dtype=bf16, device=dev) for _ in range(2))

            def same(x, y):
                def check():
                    return True if torch.equal(x(), y()) else "fused and unfused results differ"

                return check

            def unfused_ag(a=a, whole=whole, unfused=unfused):
                ag(a, out=whole.view(-1))
                return torch.matmul(whole, w1, out=unfused)

            def unfused_rs(h=h, partial=partial, runfused=runfused, m=m):
                torch.matmul(h, w2, out=partial)
                return rs(partial.view(-1), out=runfused.view(-1)).view(m, HIDDEN)

            ctx.figure(
                f"AllGatherMatmul m={m}",
                lambda a=a, fused=fused: ag_mm(a, w1, out=fused),
                lambda whole=whole, gathered=gathered: torch.matmul(whole, w1, out=gathered),
                "torch.matmul of the gathered rows",
                f"{w * m} x {HIDDEN} @ {HIDDEN} x {n} (the compute floor)",
                iters=iters,
                more={"unfused": unfused_ag},
                check=same(lambda a=a, fused=fused: ag_mm(a, w1, out=fused), unfused_ag),
                tags={"op": "all_gather_matmul", "m": m},
            )
            ctx.figure(
                f"MatmulReduceScatter m={m}",
                lambda h=h, rfused=rfused: mm_rs(h, w2, out=rfused),
                lambda h=h, partial=partial: torch.matmul(h, w2, out=partial),
                "torch.matmul of this member's rows",
                f"{w * m} x {n} @ {n} x {HIDDEN} (the compute floor)",
                iters=iters,
                more={"unfused": unfused_rs},
                check=same(lambda h=h, rfused=rfused: mm_rs(h, w2, out=rfused), unfused_rs),
                tags={"op": "matmul_reduce_scatter", "m": m},
            )
            del a, h, fused, gathered, unfused, whole, partial, rfused, runfused
        for c in (ag_mm, mm_rs, ag, rs):
            c.synchronize()
            c.close()
    finally:
        buf.close()


def targets(path: str) -> dict:
    """The issue's targets from a run's JSON, per world: written back into it and returned."""
    with open(path) as f:
        res = json.load(f)
    out = {}
    for world, wres in res.get("worlds", {}).items():
        rows = [r for r in wres.get("rows", []) if r.get("tags", {}).get("op") and r.get("value")]
        per = {}
        for r in rows:
            unf = (r.get("more") or {}).get("unfused")
            if not isinstance(unf, (int, float)):
                continue
            per.setdefault(r["tags"]["op"], []).append((r["tags"]["m"], r["value"], unf, r.get("floor")))
        verdict = {}
        for op, pts in per.items():
            pts.sort()
            speed = {m: round(u / v, 3) for m, v, u, _ in pts}
            big = [s for m, s in speed.items() if m >= 2048]
            m_top, v_top, _, f_top = pts[-1]
            verdict[op] = {
                "speedup_over_unfused": speed,
                "never_slower": all(s >= 1.0 for s in speed.values()),
                "at_least_1.2x_from_2048": bool(big) and all(s >= 1.2 for s in big),
                "largest_m": m_top,
                "to_compute_floor_at_largest_m": round(v_top / f_top, 3) if f_top else None,
                "within_1.15x_of_floor": bool(f_top) and v_top / f_top <= 1.15,
            }
        out[world] = verdict
    res["gemm_targets"] = out
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(out, indent=1))
    return out


def main() -> None:
    if "--targets" in sys.argv[1:]:
        targets(sys.argv[sys.argv.index("--targets") + 1])
        return
    import shared

    sys.exit(shared.main([a for a in sys.argv[1:] if a != "--shared"] + ["--shared"], bench="gemm"))


if __name__ == "__main__":
    main()
