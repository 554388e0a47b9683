"""Ranks sharing one GPU under MPS: every figure beside a floor kernel of the same run.

What the lead runs on a machine with one GPU and NVIDIA's MPS (all four benchmarks, worlds 2, 4
and 8, in one process under one MPS daemon, nothing started after the budget is spent)::

    PYTHONPATH=. python benchmarks/shared.py --all --worlds 2,4,8 --budget-s 330 --out benchmarks/results

One benchmark alone: ``python benchmarks/fence.py --shared --worlds 2,4,8`` (``collectives.py``,
``moe.py``, ``pcp_kv.py`` the same). ``--dry-run`` writes the files from made-up numbers without
touching a GPU, and ``--host-smoke`` runs the benchmarks' code on the host backend
(``benchmarks/shared_host.py``): what CI can run.

With ``SYMMSYNC_SHARE_GPUS=1`` and an MPS daemon (``symmsync.testing.mps()``), ``symmsync.testing.run``
puts the ``W`` ranks of a world on the one GPU, each on ``100 // W`` percent of its SMs, their
kernels running at the same time. Each benchmark's ``shared_rank(ctx)`` measures its figures
there, each beside a floor kernel (``benchmarks/floors.py``): the loads and stores the operation
does, through the same peer pointers, without synchronization, timed the same way on the same
ranks in the same run. Timing: CUDA-graph replay of ``--iters`` calls started together on every
rank (after a barrier), ``--reps`` replays, each rank's median, the slower rank's kept.

The floor rule: each floor kernel is timed beside torch's own kernels for the same bytes
(``index_select``, ``index_add_``, ``copy_``, ``sum``, on the same rank and SM share, in the same
run); a floor kernel slower than 1.1x torch's figure is no floor, and torch's figure replaces
it. Both are recorded in the row (``floors``), with which one was used. A large ``copy_`` of
the same run (every rank at once) gives the copy bandwidth (``copy_gbps`` in each world's
``notes``); a row that says what it moves (``bytes_moved``, read + written) also gives its time
at that bandwidth (``copy_us``) and its ratio to it (``copy_ratio``).

The budget (``--budget-s``) is shared among the worlds in proportion to the square root of
their sizes, the first getting 40 s more for the compiles (what a world leaves goes to the
next), so every world measures its first figures; a world stops starting figures at its
share's end and records the rest as skipped.

What such a figure means: the peers' memory is the GPU's own HBM, so nothing here is an NVLink
figure. The ratio to the floor is what it can say: how much the protocol (publishes, waits,
headers, launches) and the kernel's own work cost beyond the bytes the operation must move, on
the same memory and SM share. Writes ``<bench>_<machine>_mps.json`` (``h200x1`` on one H200; the
worlds inside) and ``.png`` (the ratio to the floor per world) into ``--out``, after each world,
and prints a table. A figure that fails records its error and the run goes on; a world whose
processes die (a trapped kernel is handed to every client of the GPU) is started again for the
benchmarks it had not finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from shared_results import Figure, Results, choose_floor, fake_results  # noqa: E402 - after the path above

#: The benchmarks with a ``shared_rank(ctx)``, in the order ``--all`` runs them (module = name).
BENCHES = ("fence", "collectives", "moe", "pcp_kv")

#: Seconds a new world needs at least to be worth starting (process start, compiles).
MIN_START_S = 20.0
#: Seconds past the budget a started world may take to finish its figure and exit.
GRACE_S = 45.0
#: Wait budget of the operations' device-side waits (s): a hang traps soon, compiles still fit.
WAIT_S = 30.0
#: Seconds the first world of a run gets before the budget is shared: it compiles the kernels.
COMPILE_S = 40.0
#: Bytes of the large copy_ that gives a run's copy bandwidth (on each rank, every rank at once).
COPY_BYTES = 256 << 20


# ============================================================================ inside a rank
class Rank:
    """What a benchmark's ``shared_rank(ctx)`` gets on every rank: its world, device, SM share, and
    :meth:`figure`, which times an operation and its floor and records the row (rank 0 writes it
    to the progress file at once, so a world that dies keeps what it measured)."""

    backend = "cuda"  # the symmetric buffers' backend
    copy_bytes = COPY_BYTES  # of copy_gbps()'s copy

    def __init__(self, settings: dict, progress: str, deadline: float):
        import torch
        import torch.distributed as dist

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.sm_share = int(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"))
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.settings = settings
        self.iters, self.reps = settings["iters"], settings["reps"]
        self.wait_s = settings.get("wait_s", WAIT_S)
        self.bench = ""
        self._progress, self._deadline = progress, deadline
        self._copy: float | None = None  # copy_gbps(), once a world
        self._copy_noted: set[str] = set()

    # -- the ranks' agreement (gloo, on the host)
    def sync(self) -> None:
        """Wait for this rank's device."""
        import torch

        torch.cuda.synchronize()

    def barrier(self) -> None:
        import torch.distributed as dist

        self.sync()
        dist.barrier()

    def agree(self, local: Any) -> list:
        """Every rank's ``local``, on every rank."""
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, local)
        return out

    def time_left(self) -> bool:
        """Rank 0's word on whether the budget still allows a new measurement."""
        import torch.distributed as dist

        box = [time.time() < self._deadline]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])

    def emit(self, kind: str, **payload: Any) -> None:
        """Rank 0 appends one event to the progress file (a JSON line, flushed to disk)."""
        if self.rank != 0:
            return
        line = json.dumps({"kind": kind, "bench": self.bench, "world": self.world, **payload}, default=str)
        with open(self._progress, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(f"[{self.bench} w{self.world}] {text}", flush=True)

    # -- timing: every rank makes the same host collectives whatever fails, so they stay in step
    def _graph_local(self, fn: Callable[[], Any], iters: int) -> float | str:
        import torch

        err: str | None = None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - recorded, the ranks go on
            err = f"warm-up: {e!r}"
        self.barrier()
        g = None
        if err is None:
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(iters):
                        fn()
            except Exception as e:  # noqa: BLE001
                err, g = f"capture: {e!r}", None
        # Nobody replays unless every rank captured: a lone replay's waits would run out their budget.
        if not all(ok for ok in self.agree(err is None)):
            err = err or "capture failed on another rank"
        times: list[float] = []
        if err is None:
            g.replay()  # upload, warm up
            torch.cuda.synchronize()
        for _ in range(self.reps):
            self.barrier()
            if err is None:
                try:
                    t0 = time.perf_counter()
                    g.replay()
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) / iters * 1e6)
                except Exception as e:  # noqa: BLE001
                    err = f"replay: {e!r}"
        del g
        return statistics.median(times) if err is None else err

    def _eager_local(self, fn: Callable[[], Any], iters: int) -> float | str:
        import torch

        err: str | None = None
        try:
            for _ in range(10):
                fn()
        except Exception as e:  # noqa: BLE001
            err = f"warm-up: {e!r}"
        times: list[float] = []
        for _ in range(self.reps):
            self.barrier()
            if err is None:
                try:
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) / iters * 1e6)
                except Exception as e:  # noqa: BLE001
                    err = f"eager: {e!r}"
        return statistics.median(times) if err is None else err

    def time(self, fn: Callable[[], Any], mode: str = "graph", iters: int | None = None, calls: int = 1) -> float | str:
        """µs per call of ``fn`` (``calls`` operations per ``fn``: µs per operation): the slower
        rank's median; an error string naming the ranks where it failed."""
        iters = iters or self.iters
        try:
            local = self._graph_local(fn, iters) if mode == "graph" else self._eager_local(fn, iters)
        except Exception as e:  # noqa: BLE001 - a failure outside the guarded steps
            local = f"{e!r}"
        every = self.agree(local)
        bad = [f"rank {r}: {v}" for r, v in enumerate(every) if isinstance(v, str)]
        if bad:
            return "error: " + "; ".join(bad)[:1500]
        return round(max(every) / calls, 3)

    def figure(
        self,
        name: str,
        fn: Callable[[], Any],
        floor_fn: Callable[[], Any],
        floor_kernel: str,
        floor_moves: str,
        *,
        mode: str = "graph",
        iters: int | None = None,
        calls: int = 1,
        more: dict[str, Callable[[], Any]] | None = None,
        check: Callable[[], Any] | None = None,
        units: str = "µs per call",
        torch_floor: dict[str, Callable[[], Any]] | None = None,
        bytes_moved: int | None = None,
        tags: dict[str, Any] | None = None,
    ) -> dict | None:
        """Time ``fn`` and its floor (and each of ``more``: other floors, references) the same way,
        then ``check`` (what the floor computed, against the operation), and record the row.

        ``torch_floor``: torch's own kernels for the same bytes (each a candidate, the fastest is
        torch's figure); the floor rule (:func:`shared_results.choose_floor`) picks the floor the
        ratio is taken to. ``bytes_moved``: the bytes the operation reads and writes on this rank
        (the most of any rank is kept), for its time at the run's copy bandwidth
        (:meth:`copy_gbps`). Returns the row (as recorded)."""
        if not self.time_left():
            row = Figure(name, None, None, None, floor_kernel, floor_moves, units, mode, self.sm_share, {},
                         "skipped: budget", tags=dict(tags or {}))  # fmt: skip
            self.emit("row", row=dataclasses.asdict(row))
            self.say(f"{name}: skipped: budget")
            return None
        value = self.time(fn, mode, iters, calls)
        kernel = self.time(floor_fn, mode, iters, calls)
        floors: dict[str, Any] = {}
        floor: float | str | None = kernel
        if torch_floor:
            cands = {k: self.time(f, mode, iters, calls) for k, f in torch_floor.items()}
            good = {k: v for k, v in cands.items() if not isinstance(v, str)}
            best = min(good, key=good.get) if good else None
            floor, used = choose_floor(kernel, good[best] if best else None)
            floors = {
                "kernel": floor_kernel,
                "kernel_us": kernel,
                "torch": best or "; ".join(cands),
                "torch_us": good[best] if best else None,
                "torch_candidates_us": cands,
                "used": used,
            }
            floor = floor if floor is not None else kernel
        extra: dict[str, Any] = {}
        for key, other in (more or {}).items():
            extra[key] = self.time(other, mode, iters, calls)
        if check is not None:
            extra["check"] = self.run_check(check)
        errors = [f"{what}: {v}" for what, v in (("value", value), ("floor", floor)) if isinstance(v, str)]
        ok = not errors
        num = value if not isinstance(value, str) else None
        copy_us = copy_ratio = None
        if bytes_moved is not None:  # the most any rank moves (the time is the slower rank's)
            bytes_moved = max(self.agree(bytes_moved))
            gbps = self.copy_gbps()
            if gbps:
                copy_us = round(bytes_moved / (gbps * 1e3), 3)
                copy_ratio = round(num / copy_us, 3) if num is not None and copy_us else None
        row = Figure(
            name,
            num,
            floor if not isinstance(floor, str) else None,
            round(value / floor, 3) if ok and floor else None,
            floor_kernel,
            floor_moves,
            units,
            mode,
            self.sm_share,
            extra,
            "; ".join(errors) or None,
            floors,
            bytes_moved,
            copy_us,
            copy_ratio,
            dict(tags or {}),
        )
        self.emit("row", row=dataclasses.asdict(row))
        if ok:
            used = f" ({floors['used']})" if floors else ""
            self.say(f"{name}: {value:.2f} µs, floor {floor:.2f} µs{used}, ratio {value / floor:.2f}  {extra or ''}")
        else:
            self.say(f"{name}: {row.error}")
        return dataclasses.asdict(row)

    def note(self, key: str, value: Any) -> None:
        """A figure of the run that is not a row (a bandwidth, a sweep's winners): in the world's notes."""
        self.emit("note", key=key, value=value)

    def copy_gbps(self) -> float | None:
        """GB/s of a large ``copy_`` (:data:`COPY_BYTES`), every rank at once on its SM share, (read +
        written) / time, in graph replay: measured once a world, noted in each benchmark's world."""
        import torch

        if self._copy is None:
            a = torch.empty(self.copy_bytes, dtype=torch.uint8, device=self.device)
            b = torch.empty_like(a)
            t = self.time(lambda: b.copy_(a), "graph", iters=10)
            self._copy = round(2 * self.copy_bytes / t / 1e3, 1) if not isinstance(t, str) and t else 0.0
            del a, b
        if self.bench not in self._copy_noted:
            self.note("copy_gbps", self._copy)
            self._copy_noted.add(self.bench)
        return self._copy or None

    def host_us(self, fn: Callable[[], Any], calls: int = 50) -> float | str:
        """Host time per call: wall time of ``calls`` back-to-back calls of ``fn`` with nothing
        synchronized in between (the device catches up afterwards), each rank's median of the
        reps, the slower rank's kept. Every rank makes the same calls."""
        err: str | None = None
        times: list[float] = []
        try:
            for _ in range(3):
                fn()
        except Exception as e:  # noqa: BLE001
            err = f"warm-up: {e!r}"
        for _ in range(self.reps):
            self.barrier()
            if err is None:
                try:
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    times.append((time.perf_counter() - t0) / calls * 1e6)
                    self.sync()
                except Exception as e:  # noqa: BLE001
                    err = f"host: {e!r}"
        every = self.agree(statistics.median(times) if err is None else err)
        bad = [f"rank {r}: {v}" for r, v in enumerate(every) if isinstance(v, str)]
        return "error: " + "; ".join(bad)[:1500] if bad else round(max(every), 3)

    def run_check(self, check: Callable[[], Any]) -> str:
        """``check()`` on every rank (it returns True or a short string): "ok on every rank", or what failed."""
        try:
            local = check()
        except Exception as e:  # noqa: BLE001
            local = f"raised {e!r}"[:300]
        every = self.agree(local)
        bad = [f"rank {r}: {v}" for r, v in enumerate(every) if v is not True]
        return "ok on every rank" if not bad else "FAILED " + "; ".join(bad)[:600]


def _rank_main(benches: list[str], settings: dict, progress: str, deadline: float) -> None:
    """One world's rank: each benchmark's ``shared_rank`` in turn, each one's end in the progress file."""
    import torch

    ctx = Rank(settings, progress, deadline)
    if ctx.rank == 0:
        import common

        info = {**common.machine(), "device": torch.cuda.get_device_name(ctx.device)}
        ctx.emit("machine", machine=info, sm_share_percent=ctx.sm_share, sms=ctx.sms)
    for bench in benches:
        ctx.bench = bench
        ctx.emit("start")
        if not ctx.time_left():
            ctx.emit("end", status="skipped: budget")
            continue
        ctx.say(f"start (SM share {ctx.sm_share}%)")
        try:
            importlib.import_module(bench).shared_rank(ctx)
            local = None
        except Exception:  # noqa: BLE001 - recorded; the next benchmark runs
            local = traceback.format_exc()[-1200:]
        every = ctx.agree(local)
        bad = [f"rank {r}: {v}" for r, v in enumerate(every) if v]
        ctx.emit("end", status="ok" if not bad else "error: " + " | ".join(bad)[:3000])
        torch.cuda.empty_cache()
        ctx.barrier()


# ============================================================================ the parent
def _read_events(path: str) -> list[dict]:
    events = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut short by a dying rank
    except OSError:
        pass
    return events


def _machine_name() -> str:
    """``h200x1``-style, from nvidia-smi (the parent never makes a CUDA context: it is no MPS client)."""
    import re
    import subprocess

    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        ).stdout.split("\n")
        names = [n.strip() for n in names if n.strip()]
    except (OSError, subprocess.SubprocessError):
        names = []
    if not names:
        return "gpu"
    return re.sub(r"[^a-z0-9]+", "", names[0].lower().replace("nvidia", "")) + f"x{len(names)}"


def world_deadline(worlds: list[int], deadline: float, now: float | None = None, extra: float = 0.0) -> float:
    """When the first of ``worlds`` (the worlds not yet run) must stop starting figures: ``extra``
    seconds (the first world of a run compiles the kernels), then the budget left shared among them
    in proportion to the square root of their sizes (a larger world starts more processes and runs
    each figure slower), so that the last world gets its share too. What a world leaves unused goes
    to the ones after it."""
    now = time.time() if now is None else now
    left = max(0.0, deadline - now)
    extra = min(extra, left)
    weights = [w**0.5 for w in worlds]
    return min(deadline, now + extra + (left - extra) * weights[0] / sum(weights))


def run_world(world: int, benches: list[str], results: Results, settings: dict, deadline: float, tmp: str) -> None:
    """The benchmarks at one world: one run of ``world`` ranks, started again (for those not yet
    begun) when its processes die; what cannot start before the budget is spent is skipped."""
    from symmsync import testing

    pending, attempt = list(benches), 0
    while pending and attempt < len(benches):
        left = deadline - time.time()
        if left < MIN_START_S:
            for b in pending:
                results.by[b][world].status = "skipped: budget"
            return
        progress = os.path.join(tmp, f"w{world}_{attempt}.jsonl")
        print(f"== world {world}: {', '.join(pending)} ({left:.0f} s of budget left)", flush=True)
        failure = None
        try:
            testing.run(_rank_main, world, pending, settings, progress, deadline, backend="cuda",
                        timeout_s=left + GRACE_S)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a world that died: keep what it measured
            failure = f"{type(e).__name__}: {e}"[:2500]
            print(f"== world {world} died: {failure[:600]}", flush=True)
        pending = results.absorb(world, _read_events(progress), failure, pending)
        attempt += 1
    for b in pending:
        results.by[b][world].status = "error: not started (the world kept dying)"


def parse(argv: list[str] | None, bench: str | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if bench is None:
        p.add_argument("--all", action="store_true", help=f"every benchmark ({', '.join(BENCHES)}) in one run")
        p.add_argument("--bench", choices=BENCHES, action="append", help="one benchmark (may repeat)")
    p.add_argument("--shared", action="store_true", help="(the flag the benchmark scripts take to come here)")
    p.add_argument("--worlds", default="2,4,8", help="ranks on the one GPU, comma separated")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--budget-s", type=float, default=330.0, help="nothing new starts after this many seconds")
    p.add_argument("--iters", type=int, default=200, help="calls per captured graph")
    p.add_argument("--reps", type=int, default=5, help="replays per figure (the median is kept)")
    p.add_argument("--pcp-tokens", type=int, default=8192, help="pcp_kv: tokens per rank")
    p.add_argument("--pcp-layers", type=int, default=8, help="pcp_kv: layers per timed call")
    p.add_argument("--dry-run", action="store_true", help="write the files from made-up numbers; no GPU")
    p.add_argument("--host-smoke", action="store_true",
                   help="run the benchmarks' code on the host backend (2 processes, Triton's interpreter, small "
                        "sizes; benchmarks/shared_host.py): every path of the GPU run, no GPU figure")  # fmt: skip
    args = p.parse_args(argv)
    if bench is not None:
        args.benches = [bench]
    elif args.all:
        args.benches = list(BENCHES)
    elif args.bench:
        args.benches = list(dict.fromkeys(args.bench))
    else:
        p.error("name the benchmarks: --all, or --bench NAME")
    try:
        args.worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    except ValueError:
        p.error(f"--worlds takes comma-separated integers, got {args.worlds!r}")
    if not args.worlds or min(args.worlds) < 2:
        p.error("--worlds: every world needs at least 2 ranks")
    return args


def main(argv: list[str] | None = None, bench: str | None = None) -> int:
    """``benchmarks/shared.py`` (``--all`` or ``--bench``), or a benchmark's ``--shared`` (``bench``)."""
    args = parse(argv, bench)
    settings = {
        "worlds": args.worlds,
        "iters": args.iters,
        "reps": args.reps,
        "budget_s": args.budget_s,
        "wait_s": WAIT_S,
        "pcp_tokens": args.pcp_tokens,
        "pcp_layers": args.pcp_layers,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }
    if args.host_smoke:
        import shared_host

        return shared_host.smoke(args.benches, settings, args.out)
    if args.dry_run:
        res = fake_results(args.benches, args.worlds, settings, args.out)
        for b in args.benches:
            name = res.write(b)
            print(res.table(b), flush=True)
            print(f"wrote {name}.json and .png (dry run: made-up numbers)", flush=True)
        return 0
    import torch

    if torch.cuda.device_count() < 1:  # a count, no CUDA context: this process is no MPS client
        print(
            "benchmarks/shared.py: no GPU here. These figures come from ranks sharing one GPU under MPS; "
            "run on a machine with an NVIDIA GPU and its MPS control daemon (nvidia-cuda-mps-control), "
            "or use --dry-run to write the files from made-up numbers.",
            file=sys.stderr,
        )
        return 2
    from symmsync import testing
    from symmsync.errors import ConfigError

    os.environ["SYMMSYNC_SHARE_GPUS"] = "1"
    deadline = time.time() + args.budget_s
    results = Results(args.benches, args.worlds, settings, args.out, _machine_name())
    code = 0
    with tempfile.TemporaryDirectory(prefix="symmsync-shared-") as tmp:
        try:
            with testing.mps() as daemon:
                print(
                    f"MPS daemon in {daemon.pipe_dir}; worlds {args.worlds}; budget {args.budget_s:.0f} s", flush=True
                )
                for i, world in enumerate(args.worlds):
                    until = world_deadline(args.worlds[i:], deadline, extra=COMPILE_S if i == 0 else 0.0)
                    run_world(world, args.benches, results, settings, until, tmp)
                    results.write_all()  # after every world: a run cut short keeps what it measured
        except ConfigError as e:  # no MPS here: the ranks would time-slice, and the figures mean nothing
            print(f"benchmarks/shared.py: MPS could not be started: {e}", file=sys.stderr)
            for b in args.benches:
                for w in args.worlds:
                    if results.by[b][w].status == "not run":
                        results.by[b][w].status = f"error: no MPS daemon: {e}"[:1000]
            code = 2
        finally:
            results.write_all()
    for b in args.benches:
        print(results.table(b), flush=True)
        print(f"wrote {os.path.join(args.out, f'{b}_{results.machine_name}_mps')}.json and .png", flush=True)
    return code


if __name__ == "__main__":
    import shared  # noqa: F401 - the ranks import _rank_main from `shared`, not from __main__

    sys.exit(shared.main())
