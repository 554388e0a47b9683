"""The MoE dispatcher's targets under MPS, read from a ``benchmarks/moe.py --shared`` run's rows and
notes (``moe_shared.py`` writes them; ``shared_results.py`` calls :func:`evaluate`, :func:`lines`
and :func:`plot` when it writes ``moe_<machine>_mps.json`` and ``.png``). Pure Python: no GPU,
no torch.

Each target is judged per world, ``met`` / ``missed`` / ``not measured``:

* at 128 tokens a rank (the rows tagged ``target_size``), graph replay: dispatch and combine
  each at most 2.0x torch's kernel for the same rows in bf16 and 2.5x in fp8 (the stretch, 1.5x,
  reported beside): the one kernel that delivers the step's rows, timed beside it (dispatch: an
  ``index_select`` of the routed rows out of the tokens; combine: their sum into the tokens,
  ``sum`` over the top-k or ``index_add_``, the faster), with the ratios to torch's kernels for the
  floor's bytes, to the floor used and to the bytes at the copy bandwidth beside;
* one token a rank (graph replay): dispatch and combine each at most 2x a fence of the same world;
* eager at most graph replay + 15 µs, from 32 tokens a rank up (the rows tagged ``eager_judged``;
  every pair measured);
* the host cost of an eager dispatch at most 3x a torch ``index_select``;
* reported, no bound: the ``programs`` sweep's fastest value in each of its rounds, and what the
  transfer adds to the Mixtral-like layer (with and without ``wait=False`` overlap).
"""

from __future__ import annotations

from typing import Any

#: torch's one kernel for the rows a step delivers (graph rows; the yardstick of the first targets): the
#: routed rows gathered out of the tokens; the routed rows summed into their tokens (the faster of two).
ROWS_DISPATCH = "torch index_select of the routed rows"
ROWS_SUM, ROWS_ADD = "torch sum over the top-k of the routed rows", "torch index_add_ of the routed rows"
TORCH_BOUND = {"bf16": 2.0, "fp8": 2.5}
STRETCH = 1.5
TARGET_TOKENS = 128
FENCE_BOUND = 2.0
EAGER_SLACK_US, EAGER_FROM = 15.0, 32
HOST_BOUND = 3.0


def _rows(world: dict, **want) -> list[dict]:
    return [r for r in world.get("rows", []) if all(r.get("tags", {}).get(k) == v for k, v in want.items())]


def _one(world: dict, **want) -> dict | None:
    rows = [r for r in _rows(world, **want) if r.get("value") is not None]
    return rows[0] if rows else None


def _torch_us(row: dict | None) -> float | None:
    """torch's one kernel for the rows the step delivers (the fastest of the row's ``torch_rows``)."""
    times = [row["more"].get(k) for k in row.get("tags", {}).get("torch_rows", [])] if row else []
    times = [t for t in times if isinstance(t, (int, float)) and t > 0]
    return min(times) if times else None


def _status(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "missed")


def evaluate(worlds: dict[str, dict]) -> dict[str, Any]:
    """Every target at every world: ``{"per_world": {w: [target, ...]}, "summary": {status: count}}``,
    each target a dict with ``target``, ``measured`` and ``status``."""
    per: dict[str, list[dict]] = {}
    for w, world in worlds.items():
        out: list[dict] = []
        for kind, bound in TORCH_BOUND.items():
            for step in ("dispatch", "combine"):
                row = _one(world, what="step", step=step, kind=kind, target_size=True, mode="graph")
                t = _torch_us(row)
                ratio = round(row["value"] / t, 3) if row and t else None
                tokens = row["tags"]["tokens"] if row else TARGET_TOKENS
                r = row or {}
                same = r.get("floors", {}).get("torch_us")
                out.append({
                    "target": f"{step} {kind}, {tokens} tokens, graph: <= {bound}x torch's kernel for the "
                              f"same rows (stretch {STRETCH}x)",
                    "measured": {"us": r.get("value"), "torch_us": t, "ratio_to_torch": ratio,
                                 "torch_same_bytes_us": same,
                                 "ratio_to_torch_same_bytes": round(r["value"] / same, 3) if same else None,
                                 "ratio_to_floor": r.get("ratio"), "floor_used": r.get("floors", {}).get("used"),
                                 "ratio_to_copy": r.get("copy_ratio"),
                                 "stretch": _status(None if ratio is None else ratio <= STRETCH)},
                    "status": _status(None if ratio is None else ratio <= bound),
                })  # fmt: skip
        fence = _one(world, what="fence")
        for kind in TORCH_BOUND:
            for step in ("dispatch", "combine"):
                row = _one(world, what="step", step=step, kind=kind, tokens=1, mode="graph")
                ratio = round(row["value"] / fence["value"], 3) if row and fence else None
                out.append({
                    "target": f"{step} {kind}, one token, graph: <= {FENCE_BOUND}x a fence of the same world",
                    "measured": {"us": row and row["value"], "fence_us": fence and fence["value"], "ratio": ratio},
                    "status": _status(None if ratio is None else ratio <= FENCE_BOUND),
                })  # fmt: skip
        pairs, bad = [], []
        for row in _rows(world, what="step", mode="eager"):
            tg = row["tags"]
            if not tg.get("eager_judged", tg["tokens"] >= EAGER_FROM) or row.get("value") is None:
                continue
            graph = _one(world, what="step", step=tg["step"], kind=tg["kind"], tokens=tg["tokens"], mode="graph")
            if graph is None:
                continue
            extra = round(row["value"] - graph["value"], 2)
            pairs.append({**{k: tg[k] for k in ("step", "kind", "tokens")}, "eager_minus_graph_us": extra})
            if extra > EAGER_SLACK_US:
                bad.append(f"{tg['step']} {tg['kind']} {tg['tokens']} tok: +{extra} µs")
        out.append({
            "target": f"eager <= graph replay + {EAGER_SLACK_US:g} µs from {EAGER_FROM} tokens up",
            "measured": {"pairs": pairs, "over": bad},
            "status": _status(None if not pairs else not bad),
        })  # fmt: skip
        host = world.get("notes", {}).get("host_us") or {}
        ratio = host.get("dispatch_ratio")
        out.append({
            "target": f"host cost of an eager dispatch <= {HOST_BOUND}x a torch op (index_select)",
            "measured": host,
            "status": _status(None if ratio is None else ratio <= HOST_BOUND),
        })  # fmt: skip
        sweep = world.get("notes", {}).get("programs_sweep") or {}
        best = sweep.get("best") or []
        out.append({
            "target": f"programs sweep (bf16, {sweep.get('tokens', 128)} tokens, graph), three rounds: the fastest "
                      "value a multiprocessor in each",
            "measured": {"best_per_round": best, "same_each_round": len(set(best)) == 1 if best else None},
            "status": "reported" if len(best) >= 3 and None not in best else _status(None),
        })  # fmt: skip
        layer = _one(world, what="layer")
        measured = {}
        if layer:
            ov = layer["more"].get("wait=False overlap")
            measured = {"layer_us": layer["value"], "local_us": layer["floor"],
                        "transfer_adds_us": round(layer["value"] - layer["floor"], 2),
                        "overlap_us": ov if isinstance(ov, float) else None,
                        "overlap_adds_us": round(ov - layer["floor"], 2) if isinstance(ov, float) else None,
                        "shared_mlp_us": layer["more"].get("shared MLP alone"),
                        "check": layer["more"].get("check")}  # fmt: skip
        out.append({
            "target": "Mixtral-like layer: what the transfer adds (waited, and with wait=False overlap)",
            "measured": measured,
            "status": "reported" if layer else _status(None),
        })  # fmt: skip
        per[w] = out
    summary: dict[str, int] = {}
    for out in per.values():
        for t in out:
            summary[t["status"]] = summary.get(t["status"], 0) + 1
    return {"per_world": per, "summary": summary}


def lines(targets: dict[str, Any]) -> list[str]:
    """The targets as table lines."""
    out = [f"targets ({', '.join(f'{k} {v}' for k, v in targets['summary'].items())}):"]
    for w, items in targets["per_world"].items():
        out.append(f"  world {w}:")
        for t in items:
            m = t["measured"]
            if "ratio_to_torch" in m:
                what = (f"{_f(m['ratio_to_torch'])}x torch ({_f(m['us'])} / {_f(m['torch_us'])} µs); "
                        f"{_f(m['ratio_to_torch_same_bytes'])}x torch for the floor's bytes, "
                        f"{_f(m['ratio_to_floor'])}x floor ({m['floor_used']}), {_f(m['ratio_to_copy'])}x copy; "
                        f"stretch {m['stretch']}")  # fmt: skip
            elif "fence_us" in m:
                what = f"{_f(m['ratio'])}x fence ({_f(m['us'])} / {_f(m['fence_us'])} µs)"
            elif "pairs" in m:
                what = f"{len(m['pairs'])} pairs" + (f"; over: {', '.join(m['over'])}" if m["over"] else "")
            elif "best_per_round" in m:
                what = f"fastest a multiprocessor: {m['best_per_round']}"
            elif "dispatch_ratio" in m:
                what = f"dispatch {m['dispatch_ratio']}x, combine {m.get('combine_ratio')}x torch's index_select"
            elif "transfer_adds_us" in m:
                what = (f"layer {_f(m['layer_us'])} µs, without the transfer {_f(m['local_us'])} µs: adds "
                        f"{_f(m['transfer_adds_us'])} µs; with wait=False {_f(m['overlap_adds_us'])} µs "
                        f"(shared MLP alone {_f(m['shared_mlp_us'])} µs); check: {m['check']}")  # fmt: skip
            else:
                what = "-"
            out.append(f"    [{t['status']:>12s}] {t['target']}: {what if t['status'] != 'not measured' else '-'}")
    return out


def _f(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def plot(worlds: dict[str, dict], device: str, path: str) -> None:
    """Left: each step's time over torch's kernels for the same rows (128 tokens, graph replay) per
    world, the bounds dashed; right: what the transfer adds to the layer, waited and overlapped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = evaluate(worlds)["per_world"]
    ws = sorted(int(w) for w in worlds)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 5))
    for kind in TORCH_BOUND:
        for step in ("dispatch", "combine"):
            pts = []
            for w in ws:
                for t in targets[str(w)]:
                    if t["target"].startswith(f"{step} {kind}, ") and t["measured"].get("ratio_to_torch"):
                        pts.append((w, t["measured"]["ratio_to_torch"]))
            if pts:
                a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{step} {kind}")
        a.axhline(TORCH_BOUND[kind], ls="--", lw=0.8, color="gray")
    a.axhline(STRETCH, ls=":", lw=0.8, color="gray")
    a.set_xscale("log", base=2)
    a.set_xticks(ws, [str(w) for w in ws])
    a.set_xlabel("ranks on the one GPU (each on 100 // W % of its SMs)")
    a.set_ylabel(f"time / torch's kernels for the same rows ({TARGET_TOKENS} tokens, graph)")
    a.legend(fontsize=8)
    for key, label in (("transfer_adds_us", "waited"), ("overlap_adds_us", "wait=False overlap")):
        pts = [(w, m[key]) for w in ws for t in targets[str(w)] if (m := t["measured"]).get(key) is not None]
        if pts:
            b.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    b.set_xscale("log", base=2)
    b.set_xticks(ws, [str(w) for w in ws])
    b.set_xlabel("ranks on the one GPU")
    b.set_ylabel("µs the transfer adds to the Mixtral-like layer")
    b.legend(fontsize=8)
    fig.suptitle(f"MoE dispatch/combine under MPS, {device}: peers' memory is the same HBM, not NVLink", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fake_world(world: int, rnd) -> tuple[list[dict], dict]:
    """Made-up rows and notes of one world with the tags ``moe_shared.py`` gives (``--dry-run``)."""
    import dataclasses

    from shared_results import Figure

    rows = []

    def row(name, tags, value, kernel, torch_us=None, more=None):
        if tags.get("what") == "step" and tags["mode"] == "graph":
            keys = [ROWS_DISPATCH] if tags["step"] == "dispatch" else [ROWS_SUM, ROWS_ADD]
            tags["torch_rows"], more = keys, {k: rnd.uniform(0.4, 0.9) * torch_us for k in keys}
        used = "torch" if torch_us and kernel > 1.1 * torch_us else "kernel"
        floor = torch_us if used == "torch" else kernel
        floors = {"kernel": "fake_floor", "kernel_us": kernel, "torch": "fake torch", "torch_us": torch_us,
                  "used": used} if torch_us else {}  # fmt: skip
        f = Figure(name, value, floor, round(value / floor, 3), "fake_floor", "nothing (dry run)", "µs per call",
                   tags.get("mode", "graph"), 100 // world, {"check": "ok on every rank", **(more or {})}, None, floors,
                   1 << 20, 10.0, round(value / 10.0, 3), tags)  # fmt: skip
        rows.append(dataclasses.asdict(f))

    row("Fence.fence()", {"what": "fence", "mode": "graph"}, 3.0 * world, 1.0, 0.9)
    for kind in TORCH_BOUND:
        for tokens in (1, 32, 128):
            for mode in ("graph", "eager"):
                for step in ("dispatch", "combine"):
                    v = rnd.uniform(5, 50) * world
                    row(f"{step} {kind} {tokens} tok {mode}",
                        {"what": "step", "step": step, "kind": kind, "tokens": tokens, "mode": mode,
                         "target_size": tokens == TARGET_TOKENS, "eager_judged": tokens >= EAGER_FROM},
                        v, rnd.uniform(1, 40) * world, rnd.uniform(1, 30) * world)  # fmt: skip
    row("Mixtral-like layer", {"what": "layer", "tokens": 128, "mode": "graph"}, 300.0 + world, 250.0,
        more={"wait=False overlap": 280.0, "shared MLP alone": 40.0})  # fmt: skip
    rounds = [{"order": [1, 2, 4, 8, 16], "us": {}, "best_programs_per_sm": rnd.choice([2, 4])} for _ in range(3)]
    notes = {
        "copy_gbps": 1000.0 / world,
        "host_us": {"dispatch": 30.0, "combine": 20.0, "torch index_select": 8.0, "dispatch_ratio": 3.75,
                    "combine_ratio": 2.5},
        "programs_sweep": {"rounds": rounds, "best": [r["best_programs_per_sm"] for r in rounds]},
    }  # fmt: skip
    return rows, notes
