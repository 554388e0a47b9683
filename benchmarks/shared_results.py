"""What ``benchmarks/shared.py`` keeps of a run: every benchmark's worlds, their rows and status,
written after each world to ``<bench>_<machine>_mps.json`` and ``.png`` (the ratio to the floor
per world), and the table it prints; the floor rule (:func:`choose_floor`) and a benchmark's
targets (a module ``<bench>_targets`` with ``evaluate(worlds)`` and ``lines(targets)``, when there
is one).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from typing import Any

NOTE = (
    "Ranks sharing ONE GPU under MPS (each on 100 // W percent of its SMs): the peers' memory is the "
    "same HBM, so these are not NVLink figures. Read each figure as its ratio to the floor beside it: "
    "a kernel of the same run, on the same ranks and SM share, that loads and stores the bytes the "
    "operation moves through the same peer pointers, without any synchronization, or torch's own "
    "kernels for the same bytes where those are faster (the floor rule)."
)
TIMING = (
    "µs per call: CUDA-graph replay of `iters` calls started together on every rank after a barrier, "
    "`reps` replays, each rank's median, the slower rank's kept (eager rows: the same with a Python loop)"
)
#: A floor kernel slower than this times torch's kernels for the same bytes is not a floor: torch's figure is used.
FLOOR_RULE = 1.1
FLOOR_RULE_TEXT = (
    f"each floor kernel is timed beside torch's own kernels for the same bytes (index_select, index_add_, "
    f"copy_, sum; same rank, SM share and run); a floor kernel slower than {FLOOR_RULE}x torch's figure is "
    "replaced by torch's figure (both are recorded, and which was used)"
)
COPY_TEXT = (
    "copy_gbps: a large torch copy_ of the same run on the same SM share, every rank at once, "
    "(bytes read + bytes written) / time; a row's copy_us is its bytes moved (read + written) at that rate"
)


@dataclasses.dataclass
class Figure:
    """One row: an operation's time beside its floor's, and their ratio.

    ``floors``: the floor kernel's and torch's figures and which one ``floor`` is (the floor rule);
    ``bytes_moved``: what the operation reads and writes in all, ``copy_us`` those bytes at the
    run's copy bandwidth and ``copy_ratio`` the time over it; ``tags``: what the row is, for a
    benchmark's targets (step, dtype, tokens, mode, ...)."""

    figure: str
    value: float | None
    floor: float | None
    ratio: float | None
    floor_kernel: str
    floor_moves: str
    units: str
    timing: str
    sm_share_percent: int
    more: dict[str, Any]
    error: str | None = None
    floors: dict[str, Any] = dataclasses.field(default_factory=dict)
    bytes_moved: int | None = None
    copy_us: float | None = None
    copy_ratio: float | None = None
    tags: dict[str, Any] = dataclasses.field(default_factory=dict)


def choose_floor(kernel_us: float | str | None, torch_us: float | str | None) -> tuple[float | None, str]:
    """The floor rule: ``(floor µs, which)``, ``which`` "kernel" or "torch". torch's figure replaces
    the floor kernel's when the kernel is slower than :data:`FLOOR_RULE` times it (or failed)."""
    k = kernel_us if isinstance(kernel_us, (int, float)) else None
    t = torch_us if isinstance(torch_us, (int, float)) else None
    if t is not None and (k is None or k > FLOOR_RULE * t):
        return t, "torch"
    return k, "kernel"


def targets_module(bench: str):
    """``<bench>_targets`` (its ``evaluate`` and ``lines``), or None."""
    try:
        return importlib.import_module(f"{bench}_targets")
    except ImportError:
        return None


@dataclasses.dataclass
class World:
    """One benchmark at one world: its status and rows."""

    world: int
    status: str = "not run"
    sm_share_percent: int | None = None
    sms: int | None = None  # the multiprocessors rank 0's device reports (under its MPS share)
    rows: list[dict] = dataclasses.field(default_factory=list)
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)  # the run's figures that are not rows


class Results:
    """Every benchmark's worlds, written to ``<bench>_<machine>_mps.json`` and ``.png``."""

    def __init__(self, benches: list[str], worlds: list[int], settings: dict, out: str, machine_name: str):
        self.benches, self.worlds, self.settings, self.out = benches, worlds, settings, out
        self.machine: dict = {}
        self.machine_name = machine_name
        self.by = {b: {w: World(w) for w in worlds} for b in benches}

    def absorb(self, world: int, events: list[dict], failure: str | None, pending: list[str]) -> list[str]:
        """Take one run's progress events; return the benchmarks still to run (not started)."""
        started, ended = set(), set()
        for ev in events:
            kind, bench = ev["kind"], ev.get("bench")
            if kind == "machine":
                self.machine = self.machine or ev["machine"]
                for b in self.benches:
                    self.by[b][world].sm_share_percent = ev["sm_share_percent"]
                    self.by[b][world].sms = ev.get("sms")
                from common import slug

                self.machine_name = slug(ev["machine"]) if ev["machine"].get("gpus") else self.machine_name
            elif kind == "start":
                started.add(bench)
            elif kind == "row":
                self.by[bench][world].rows.append(ev["row"])
            elif kind == "note":
                self.by[bench][world].notes[ev["key"]] = ev["value"]
            elif kind == "end":
                ended.add(bench)
                self.by[bench][world].status = ev["status"]
        for b in started - ended:  # the one in progress when the world died
            self.by[b][world].status = f"error: the world's processes died: {failure or 'no end recorded'}"[:3000]
        left = [b for b in pending if b not in started]
        if failure and not started:  # died before anything began: do not try again
            for b in left:
                self.by[b][world].status = f"error: {failure}"[:3000]
            return []
        return left

    def table(self, bench: str) -> str:
        lines = [f"{bench}: ranks sharing one GPU under MPS; {TIMING}", "  " + NOTE, "  floor rule: " + FLOOR_RULE_TEXT]
        lines.append("  " + COPY_TEXT)
        if self.machine.get("device"):
            lines.append(f"  device: {self.machine['device']}")
        for w in self.worlds:
            wr = self.by[bench][w]
            share = f"{wr.sm_share_percent}%" if wr.sm_share_percent is not None else "?"
            sms = f", {wr.sms} SMs reported" if wr.sms is not None else ""
            lines.append(f"world {w} (SM share {share} a rank{sms}): {wr.status}")
            if wr.notes:
                lines.append("  " + ", ".join(_item(k, v) for k, v in wr.notes.items()))
            if wr.rows:
                lines.append(f"  {'figure':44s} {'µs':>8s} {'floor':>8s} {'ratio':>7s} {'used':>6s} {'kernel':>8s} "
                             f"{'torch':>8s} {'xcopy':>6s}  floor kernel; also")  # fmt: skip
            for r in wr.rows:
                fl = r.get("floors") or {}
                cells = [
                    _num(r["value"], 8),
                    _num(r["floor"], 8),
                    f"{r['ratio']:6.2f}×" if r["ratio"] is not None else f"{'-':>7s}",
                    f"{fl.get('used', '-'):>6s}",
                    _num(fl.get("kernel_us"), 8),
                    _num(fl.get("torch_us"), 8),
                    f"{r['copy_ratio']:5.2f}×" if r.get("copy_ratio") is not None else f"{'-':>6s}",
                ]
                more = ", ".join(_item(k, v) for k, v in r["more"].items())
                tail = f"  {r['floor_kernel']}" + (f"; {more}" if more else "")
                tail += f"  [{r['error']}]" if r["error"] else ""
                lines.append(f"  {r['figure'][:44]:44s} {' '.join(cells)}{tail}")
        mod = targets_module(bench)
        if mod is not None:
            lines.extend(mod.lines(mod.evaluate(self.world_dicts(bench))))
        return "\n".join(lines)

    def world_dicts(self, bench: str) -> dict[str, dict]:
        return {str(w): dataclasses.asdict(self.by[bench][w]) for w in self.worlds}

    def write(self, bench: str) -> str:
        name = os.path.join(self.out, f"{bench}_{self.machine_name}_mps")
        os.makedirs(self.out, exist_ok=True)
        text = self.table(bench)
        worlds = self.world_dicts(bench)
        payload = {
            "note": NOTE,
            "bench": bench,
            "device": self.machine.get("device") or (self.machine.get("gpus") or ["?"])[0],
            "timing": TIMING,
            "floor_rule": FLOOR_RULE_TEXT,
            "copy_bandwidth": COPY_TEXT,
            "machine": self.machine,
            "settings": self.settings,
            "worlds": worlds,
            "table": text,
        }
        mod = targets_module(bench)
        if mod is not None:
            payload["targets"] = mod.evaluate(worlds)
        tmp = name + ".json.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1, default=str)
            f.write("\n")
        os.replace(tmp, name + ".json")
        try:
            if mod is not None and hasattr(mod, "plot"):
                mod.plot(worlds, payload["device"], name + ".png")
            else:
                self.plot(bench, name + ".png")
        except Exception as e:  # noqa: BLE001 - the JSON is what counts
            print(f"{bench}: plot failed: {e!r}", flush=True)
        return name

    def plot(self, bench: str, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names: list[str] = []
        for w in self.worlds:
            for r in self.by[bench][w].rows:
                if r["figure"] not in names:
                    names.append(r["figure"])
        fig, ax = plt.subplots(figsize=(9, 5))
        plotted = 0
        for i, n in enumerate(names):
            pts = [
                (w, r["ratio"]) for w in self.worlds for r in self.by[bench][w].rows if r["figure"] == n and r["ratio"]
            ]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ls="-" if i < 10 else "--", label=n)
                plotted += 1
        ax.axhline(1.0, color="gray", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(self.worlds, [str(w) for w in self.worlds])
        ax.set_yscale("log")
        ax.set_xlabel("ranks on the one GPU (each on 100 // W % of its SMs)")
        ax.set_ylabel("time / floor of the same run (the floor rule; log)")
        gpu = self.machine.get("device") or (self.machine.get("gpus") or ["?"])[0]
        ax.set_title(
            f"{bench} under MPS, {gpu}: ratio to a floor moving the same bytes, no synchronization\n"
            "peers' memory is the same HBM: not NVLink figures",
            fontsize=9,
        )
        if plotted:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no figure measured", transform=ax.transAxes, ha="center")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def write_all(self) -> None:
        for b in self.benches:
            self.write(b)


def _num(v: Any, width: int) -> str:
    return f"{v:{width}.2f}" if isinstance(v, (int, float)) else f"{'-':>{width}s}"


def _item(k: str, v: Any) -> str:
    """``k 1.23`` for a number, ``k: v`` otherwise (a dict's items likewise, in braces)."""
    if isinstance(v, float):
        return f"{k} {v:.2f}"
    if isinstance(v, dict):
        return f"{k} {{" + ", ".join(_item(str(a), x) for a, x in v.items()) + "}"
    return f"{k}: {v}"


def fake_results(benches: list[str], worlds: list[int], settings: dict, out: str) -> Results:
    """Made-up rows (no GPU touched): the files and the table, for ``--dry-run``. A benchmark with
    a targets module gets its ``fake_world`` rows and notes, so that its targets are read too."""
    import random

    rnd = random.Random(0)
    res = Results(benches, worlds, settings, out, "dryrun")
    res.machine = {"gpus": ["(dry run: no GPU)"], "gpu_count": 0, "device": "(dry run: no GPU)"}
    for b in benches:
        mod = targets_module(b)
        for w in worlds:
            wr = res.by[b][w]
            wr.status, wr.sm_share_percent = "ok (dry run: made-up numbers)", 100 // w
            if mod is not None and hasattr(mod, "fake_world"):
                wr.rows, wr.notes = mod.fake_world(w, rnd)
                continue
            wr.notes = {"copy_gbps": 1000.0 / w}
            for i in range(3):
                v, f, t = rnd.uniform(2, 50) * w, rnd.uniform(1, 10) * w, rnd.uniform(1, 10) * w
                floor, used = choose_floor(f, t)
                row = Figure(f"{b} figure {i}", v, floor, v / floor, "fake_floor", "nothing (dry run)", "µs per call",
                             "graph", 100 // w, {"empty kernel": 0.5, "check": "ok on every rank"}, None,
                             {"kernel": "fake_floor", "kernel_us": f, "torch": "fake torch", "torch_us": t,
                              "used": used}, 1 << 20, 5.0, v / 5.0)  # fmt: skip
                wr.rows.append(dataclasses.asdict(row))
            wr.rows.append(dataclasses.asdict(
                Figure(f"{b} failing figure", None, 1.0, None, "fake_floor", "nothing", "µs per call", "graph",
                       100 // w, {}, "value: error: rank 1: capture: RuntimeError('made up')")))  # fmt: skip
        res.by[b][worlds[-1]].status = "skipped: budget"
    return res
