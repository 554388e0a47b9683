"""What ``benchmarks/shared.py`` keeps of a run: every benchmark's worlds, their rows and status,
written after each world to ``<bench>_<machine>_mps.json`` and ``.png`` (the ratio to the floor
per world), and the table it prints.
"""

from __future__ import annotations

import dataclasses
import json
import os

NOTE = (
    "Ranks sharing ONE GPU under MPS (each on 100 // W percent of its SMs): the peers' memory is the "
    "same HBM, so these are not NVLink figures. Read each figure as its ratio to the floor beside it: "
    "a kernel of the same run, on the same ranks and SM share, that loads and stores the bytes the "
    "operation moves through the same peer pointers, without any synchronization."
)
TIMING = (
    "µs per call: CUDA-graph replay of `iters` calls started together on every rank after a barrier, "
    "`reps` replays, each rank's median, the slower rank's kept (eager rows: the same with a Python loop)"
)


@dataclasses.dataclass
class World:
    """One benchmark at one world: its status and rows."""

    world: int
    status: str = "not run"
    sm_share_percent: int | None = None
    sms: int | None = None  # the multiprocessors rank 0's device reports (under its MPS share)
    rows: list[dict] = dataclasses.field(default_factory=list)


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
        lines = [f"{bench}: ranks sharing one GPU under MPS; {TIMING}", "  " + NOTE]
        for w in self.worlds:
            wr = self.by[bench][w]
            share = f"{wr.sm_share_percent}%" if wr.sm_share_percent is not None else "?"
            sms = f", {wr.sms} SMs reported" if wr.sms is not None else ""
            lines.append(f"world {w} (SM share {share} a rank{sms}): {wr.status}")
            if wr.rows:
                lines.append(f"  {'figure':46s} {'µs':>9s} {'floor µs':>9s} {'ratio':>7s}  floor kernel; also")
            for r in wr.rows:
                v = f"{r['value']:9.2f}" if r["value"] is not None else f"{'-':>9s}"
                f = f"{r['floor']:9.2f}" if r["floor"] is not None else f"{'-':>9s}"
                q = f"{r['ratio']:6.2f}×" if r["ratio"] is not None else f"{'-':>7s}"
                more = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k}: {v}" for k, v in r["more"].items())
                tail = f"  {r['floor_kernel']}" + (f"; {more}" if more else "")
                tail += f"  [{r['error']}]" if r["error"] else ""
                lines.append(f"  {r['figure'][:46]:46s} {v} {f} {q}{tail}")
        return "\n".join(lines)

    def write(self, bench: str) -> str:
        name = os.path.join(self.out, f"{bench}_{self.machine_name}_mps")
        os.makedirs(self.out, exist_ok=True)
        text = self.table(bench)
        payload = {
            "note": NOTE,
            "bench": bench,
            "timing": TIMING,
            "machine": self.machine,
            "settings": self.settings,
            "worlds": {str(w): dataclasses.asdict(self.by[bench][w]) for w in self.worlds},
            "table": text,
        }
        tmp = name + ".json.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1, default=str)
            f.write("\n")
        os.replace(tmp, name + ".json")
        try:
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
        ax.set_ylabel("time / floor kernel of the same run (log)")
        gpu = (self.machine.get("gpus") or ["?"])[0]
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
