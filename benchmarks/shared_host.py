"""``--shared --host-smoke``: a benchmark's ``shared_rank`` on the host backend, what CI can run.

The ranks are processes on the CPU (POSIX shared memory, Triton's interpreter; no MPS, no
GPU); each benchmark sizes itself down when ``ctx.backend`` is ``"host"``. :class:`HostRank` is
``benchmarks/shared.py``'s :class:`~shared.Rank` with its device parts replaced: every
"graph replay" is one eager call, timed on the host clock, and nothing waits for a device. So
the whole path of the GPU run runs (the rows, their floors and torch's, the floor rule, the
checks on every rank, the notes, the targets, the JSON and the table), and its times are the
interpreter's: no GPU figure. Writes ``<bench>_hostsmoke_mps.json`` into ``--out``.
"""

from __future__ import annotations

import importlib
import math
import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from shared import Rank, _read_events
from shared_results import Results

#: Ranks of the smoke run.
WORLD = 2


class HostRank(Rank):
    """A :class:`~shared.Rank` on the host backend (the module's docstring)."""

    backend = "host"
    copy_bytes = 1 << 20

    def __init__(self, settings: dict, progress: str, deadline: float = math.inf):  # Rank's, without CUDA
        import torch
        import torch.distributed as dist

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cpu")
        self.sm_share, self.sms = 100, 2  # sms: what the dispatchers' `programs` are counted in
        self.settings = settings
        self.iters, self.reps = 1, 1
        self.wait_s = settings.get("wait_s", 120.0)
        self.bench = ""
        self._progress, self._deadline = progress, deadline
        self._copy: float | None = None
        self._copy_noted: set[str] = set()

    def sync(self) -> None:
        pass  # the interpreter runs every kernel before its launch returns

    def _eager_local(self, fn: Callable[[], Any], iters: int) -> float | str:
        try:
            fn()  # warm-up (compiles nothing: the interpreter)
            times = []
            for _ in range(self.reps):
                self.barrier()
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        except Exception as e:  # noqa: BLE001 - recorded, the ranks go on
            return f"host: {e!r}"

    def _graph_local(self, fn: Callable[[], Any], iters: int) -> float | str:
        return self._eager_local(fn, iters)


def _rank_main(bench: str, settings: dict, progress: str) -> None:
    import torch.distributed as dist

    ctx = HostRank(settings, progress)
    ctx.bench = bench
    ctx.emit("start")
    try:
        importlib.import_module(bench).shared_rank(ctx)
        local = None
    except Exception:  # noqa: BLE001 - recorded below
        local = traceback.format_exc()[-1500:]
    every: list = [None] * ctx.world
    dist.all_gather_object(every, local)
    bad = [f"rank {r}: {v}" for r, v in enumerate(every) if v]
    ctx.emit("end", status="ok" if not bad else "error: " + " | ".join(bad)[:3000])


def smoke(benches: list[str], settings: dict, out: str) -> int:
    """Each benchmark's ``shared_rank`` on :data:`WORLD` host-backend ranks; its JSON and table.
    0 when every benchmark ended ok and every row has a value and passed its check."""
    from symmsync.testing import run

    code = 0
    for bench in benches:
        res = Results([bench], [WORLD], {**settings, "host_smoke": True}, out, "hostsmoke")
        res.machine = {"gpus": [], "gpu_count": 0, "device": "host backend (Triton's interpreter): no GPU figure"}
        with tempfile.TemporaryDirectory(prefix="symmsync-smoke-") as tmp:
            progress = os.path.join(tmp, "progress.jsonl")
            failure = None
            try:
                run(_rank_main, WORLD, bench, settings, progress, backend="host", timeout_s=900)
            except Exception as e:  # noqa: BLE001 - in the status
                failure = f"{type(e).__name__}: {e}"[:2500]
            res.absorb(WORLD, _read_events(progress), failure, [bench])
        res.by[bench][WORLD].sm_share_percent, res.by[bench][WORLD].sms = 100, 2
        name = res.write(bench)
        print(res.table(bench), flush=True)
        print(f"wrote {name}.json (host backend, Triton's interpreter: no GPU figure)", flush=True)
        wr = res.by[bench][WORLD]
        bad = [r["figure"] for r in wr.rows if r["value"] is None or r["more"].get("check", "ok").startswith("FAILED")]
        if wr.status != "ok" or bad or not wr.rows:
            print(f"{bench}: host smoke FAILED: status {wr.status!r}; rows without a value or check: {bad}", flush=True)
            code = 1
    return code
