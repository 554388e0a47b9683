#!/usr/bin/env python3
"""Model-check symmsync's protocols with Spin, every configuration: the fence (verify/fence.pml),
the point-to-point signals with their pipelined transfer (verify/signals.pml), the
collectives' slot protocol (verify/collectives.pml) and the MoE dispatcher's buffer reuse
(verify/moe.pml).

For each configuration: ``spin -a`` with its -D flags, gcc builds the verifier ``pan``, ``pan``
searches the whole state space (no bitstate hashing, no partial search), and the output is
parsed. Correct configurations must verify with 0 errors; each bug variant must produce the
counterexample it is listed with. Prints a table; exits 1 when any result differs from what is
expected, 2 when spin or gcc is missing.

    python3 verify/check.py                 # every configuration
    python3 verify/check.py fence-3r eq-2r  # some of them
    python3 verify/check.py sig-pipe sig-eq # the signal model's
    python3 verify/check.py coll-mix-3r     # the collectives' model's
    python3 verify/check.py --list          # what each configuration is
    python3 verify/check.py --trail eq-2r   # also print the counterexample's steps
    python3 verify/check.py --markdown      # the results as verify/README.md's table

Standard library only; verify/README.md says what each model covers and what it proves.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "fence.pml")
SIGNALS = "signals.pml"
COLLECTIVES = "collectives.pml"
MOE = "moe.pml"
GEMM = "gemm.pml"

#: Seconds one step (spin -a, gcc, pan) may take before the check counts as failed.
STEP_TIMEOUT_S = 300
#: pan's search depth bound; a search that reaches it is reported as incomplete (an error).
MAX_DEPTH = 100_000
#: pan's memory bound in MB.
MEMLIM_MB = 4096


#: The configurations whose search takes seconds (millions of states). ``make verify`` (CI runs
#: it) checks every configuration; the test suite (tests/tooling/test_verify.py) leaves these to
#: it, skipped with that reason, unless SYMMSYNC_VERIFY_ALL=1.
HEAVY = frozenset(
    {
        "ends-3r", "abort-split-3r", "channels-crash-2r", "abort-channels-2r", "abort-views-4r", "refuse-3r",
        "coll-mix-2r", "coll-mix-3r", "coll-refuse-3r", "moe-3r", "moe-mismatch-3r", "moe-refuse-3r",
        "gemm-3r", "gemm-refuse-3r",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Config:
    name: str
    flags: tuple[str, ...]
    # "pass", or the kind of counterexample: deadlock, payload, arrival, abort, refusal, timeout, final,
    # cycle, stale, overwrite (classify() tells them apart)
    expect: str
    what: str
    cycles: bool = False  # search for cycles (-DNP, pan -l) instead of safety violations
    model: str = "fence.pml"  # which model under verify/


C = Config
CONFIGS: tuple[Config, ...] = (
    # ---- the protocol as coded: every one must verify --------------------------------------
    C("fence-2r", ("VS=2", "F=6"), "pass", "2 ranks, 6 fences, fence(); no timeout: safety and no deadlock"),
    C("fence-3r", ("VS=3", "F=6"), "pass", "3 ranks, 6 fences, fence(); no timeout: safety and no deadlock"),
    C("split-2r", ("VS=2", "F=6", "SPLIT"), "pass", "2 ranks, 6 fences, arrive() then wait()"),
    C("split-3r", ("VS=3", "F=6", "SPLIT"), "pass", "3 ranks, 6 fences, arrive() then wait()"),
    C("crash-2r", ("VS=2", "F=6", "CRASH", "TMODE=1"), "pass", "2 ranks, 6 fences; any one rank may stop"),
    C("crash-3r", ("VS=3", "F=6", "CRASH", "TMODE=1"), "pass", "3 ranks, 6 fences; any one rank may stop"),
    C(
        "ends-3r",
        ("VS=3", "F=6", "CRASH", "TMODE=1"),
        "pass",
        "crash-3r searched for cycles: every run ends, nothing spins forever",
        cycles=True,
    ),
    C(
        "clock-3r",
        ("VS=3", "F=6", "SPLIT", "CRASH", "TMODE=2"),
        "pass",
        "3 ranks, 6 split fences; waits may time out at any moment; any one rank may stop",
    ),
    C("channels-2r", ("VS=2", "NV=2", "F=4"), "pass", "2 ranks, 2 channels of one view interleaved, 4 fences each"),
    C(
        "channels-crash-2r",
        ("VS=2", "NV=2", "F=3", "SPLIT", "CRASH", "TMODE=1"),
        "pass",
        "2 ranks, 2 channels, 3 split fences each; any one rank may stop",
    ),
    C("views-4r", ("VS=2", "NV=2", "F=4", "DISJOINT"), "pass", "4 ranks in 2 disjoint 2-rank views, 4 fences each"),
    C("abort-2r", ("VS=2", "F=4", "ABORT"), "pass", "2 ranks, 4 fences; any one rank may abort at any point"),
    C("abort-3r", ("VS=3", "F=4", "ABORT"), "pass", "3 ranks, 4 fences; any one rank may abort at any point"),
    C("abort-split-3r", ("VS=3", "F=4", "SPLIT", "ABORT"), "pass", "3 ranks, 4 split fences; one may abort"),
    C(
        "abort-channels-2r",
        ("VS=2", "NV=2", "F=3", "ABORT"),
        "pass",
        "2 ranks, 2 channels, 3 fences each; an abort marks both channels",
    ),
    C(
        "abort-views-4r",
        ("VS=2", "NV=2", "F=3", "DISJOINT", "ABORT"),
        "pass",
        "4 ranks in 2 disjoint views, 3 fences each; an abort marks only its own view",
    ),
    C("refuse-2r", ("VS=2", "F=4", "REFUSE"), "pass", "2 ranks, 4 fences; any member may refuse its part of any"),
    C("refuse-3r", ("VS=3", "F=3", "REFUSE"), "pass", "3 ranks, 3 fences; any member may refuse its part of any"),
    C("refuse-split-2r", ("VS=2", "F=4", "SPLIT", "REFUSE"), "pass", "2 ranks, 4 split fences; refusals"),
    # ---- known bugs: each must produce its counterexample ----------------------------------
    C("eq-2r", ("VS=2", "F=6", "BUG_EQ"), "deadlock", "wait compares slot == e"),
    C("eq-3r", ("VS=3", "F=6", "BUG_EQ"), "deadlock", "wait compares slot == e"),
    C("early-2r", ("VS=2", "F=6", "BUG_EARLY"), "payload", "publish before the payload stores"),
    C("early-3r", ("VS=3", "F=6", "BUG_EARLY"), "payload", "publish before the payload stores"),
    C("single-2r", ("VS=2", "F=6", "BUG_SINGLE"), "payload", "one payload buffer, no epoch parity"),
    C("single-3r", ("VS=3", "F=6", "BUG_SINGLE"), "payload", "one payload buffer, no epoch parity"),
    C("relaxed-2r", ("VS=2", "F=6", "BUG_RELAXED"), "payload", "publish without release"),
    C("relaxed-3r", ("VS=3", "F=6", "BUG_RELAXED"), "payload", "publish without release"),
    C("shared-2r", ("VS=2", "NV=2", "F=4", "BUG_SHARED"), "arrival", "two channels share one cell"),
    C(
        "open-3r",
        ("VS=3", "F=6", "SPLIT", "CRASH", "TMODE=2", "BUG_OPEN"),
        "arrival",
        "a timed-out wait goes on (fails open)",
    ),
    C("flag-2r", ("VS=2", "F=4", "ABORT", "BUG_FLAG"), "arrival", "the abort flag counts as an arrival"),
    C("flag-3r", ("VS=3", "F=4", "ABORT", "BUG_FLAG"), "arrival", "the abort flag counts as an arrival"),
    C(
        "unmasked-2r",
        ("VS=2", "F=4", "ABORT", "BUG_UNMASKED"),
        "abort",
        "a flagged slot is an abort whatever its count (a completed fence fails)",
    ),
    C("nomark-2r", ("VS=2", "F=4", "ABORT", "BUG_NOMARK"), "deadlock", "an abort that sets no flags: peers hang"),
    C(
        "refuse-oneword-2r",
        ("VS=2", "F=4", "REFUSE", "BUG_ONEWORD"),
        "refusal",
        "one refusal word per member, no epoch parity: a member a fence ahead overwrites an unread mark",
    ),
    C(
        "refuse-late-2r",
        ("VS=2", "F=4", "REFUSE", "BUG_LATEMARK"),
        "refusal",
        "the refusal marks stored after the publish: a reader misses them",
    ),
    # ---- point-to-point signals (signals.pml): the pipelined transfer, replayed ----------------
    C(
        "sig-pipe",
        ("R=2", "N=3", "K=2"),
        "pass",
        "ring of 2 tiles, 3 chunks per launch, 2 launches (replays): credits, counted waits",
        model=SIGNALS,
    ),
    C("sig-pipe-r3", ("R=3", "N=4", "K=3"), "pass", "ring of 3 tiles, 4 chunks per launch, 3 launches", model=SIGNALS),
    C(
        "sig-ends",
        ("R=2", "N=3", "K=2", "ABORT"),
        "pass",
        "sig-abort searched for cycles: every run ends, nothing spins forever",
        cycles=True,
        model=SIGNALS,
    ),
    C(
        "sig-abort",
        ("R=2", "N=3", "K=2", "ABORT"),
        "pass",
        "either rank may abort at any point: the other's signal wait ends",
        model=SIGNALS,
    ),
    C(
        "sig-abort-r3",
        ("R=3", "N=4", "K=3", "ABORT"),
        "pass",
        "ring of 3, 4 chunks, 3 launches; either rank may abort",
        model=SIGNALS,
    ),
    C("sig-relaxed", ("R=2", "N=3", "K=2", "BUG_RELAXED"), "payload", "put_signal without release", model=SIGNALS),
    C("sig-eq", ("R=2", "N=3", "K=2", "BUG_EQ"), "deadlock", "counted wait compares == count", model=SIGNALS),
    C(
        "sig-abs",
        ("R=2", "N=3", "K=2", "BUG_ABS"),
        "payload",
        "wait on the launch's own chunk number, no base: stale in a replay",
        model=SIGNALS,
    ),
    C(
        "sig-nocredit",
        ("R=2", "N=3", "K=2", "BUG_NOCREDIT"),
        "payload",
        "no credit before reusing a tile",
        model=SIGNALS,
    ),
    C(
        "sig-noflag",
        ("R=2", "N=3", "K=2", "ABORT", "BUG_NOFLAG"),
        "deadlock",
        "signal waits that ignore the abort flags: the peer of an aborted rank hangs",
        model=SIGNALS,
    ),
    # ---- the collectives' slot protocol (collectives.pml): calls back to back, no host barrier ----
    C(
        "coll-mix-2r",
        ("N=2", "C=6", "KIND=MIX"),
        "pass",
        "2 members, 6 calls, each one-shot, two-shot, symmetric or symmetric two-shot",
        model=COLLECTIVES,
    ),
    C(
        "coll-mix-3r",
        ("N=3", "C=4", "KIND=MIX"),
        "pass",
        "3 members, 4 calls, each one-shot, two-shot, symmetric or symmetric two-shot",
        model=COLLECTIVES,
    ),
    C("coll-one-3r", ("N=3", "C=6", "KIND=ONE"), "pass", "3 members, 6 one-phase calls", model=COLLECTIVES),
    C("coll-two-2r", ("N=2", "C=4", "KIND=TWO"), "pass", "2 members, 4 two-shot calls", model=COLLECTIVES),
    C(
        "coll-sym-2r",
        ("N=2", "C=4", "KIND=SYM"),
        "pass",
        "2 members, 4 one-shot calls on the symmetric input",
        model=COLLECTIVES,
    ),
    C(
        "coll-nbuf1-3r",
        ("N=3", "C=6", "KIND=ONE", "BUG_NBUF1"),
        "overwrite",
        "one input slot, no parity: a fast member's next copy-in overwrites a slot still read",
        model=COLLECTIVES,
    ),
    C(
        "coll-nbuf1-mix-2r",
        ("N=2", "C=6", "KIND=MIX", "BUG_NBUF1"),
        "overwrite",
        "the same in mixed calls",
        model=COLLECTIVES,
    ),
    C(
        "coll-twofence-2r",
        ("N=2", "C=4", "KIND=TWO", "BUG_NOFENCE2"),
        "stale",
        "two-shot without its second publish and wait: a reduced chunk read before it is written",
        model=COLLECTIVES,
    ),
    C(
        "coll-symfence-2r",
        ("N=2", "C=4", "KIND=SYM", "BUG_NOFENCE2"),
        "overwrite",
        "symmetric input without the second fence: the caller's refill lands under a slow reader",
        model=COLLECTIVES,
    ),
    C(
        "coll-refuse-2r",
        ("N=2", "C=4", "KIND=MIX", "REFUSE"),
        "pass",
        "2 members, mixed calls, call 2 refused",
        model=COLLECTIVES,
    ),
    C(
        "coll-refuse-one-2r",
        ("N=2", "C=4", "KIND=ONE", "REFUSE"),
        "pass",
        "2 members, one-phase calls, call 2 refused",
        model=COLLECTIVES,
    ),
    C(
        "coll-refuse-3r",
        ("N=3", "C=4", "KIND=MIX", "REFUSE"),
        "pass",
        "3 members, mixed calls, call 2 refused",
        model=COLLECTIVES,
    ),
    C(
        "coll-norefuse-2r",
        ("N=2", "C=4", "KIND=ONE", "REFUSE", "BUG_NOREFUSE"),
        "stale",
        "a refused call, the kernel blind to it: the refusing member's input read, never copied",
        model=COLLECTIVES,
    ),
    C(
        "coll-hdr1-mix-2r",
        ("N=2", "C=6", "KIND=MIX", "BUG_HDR1"),
        "overwrite",
        "one call header per sender, no parity: a fast member's next header lands under a slow check",
        model=COLLECTIVES,
    ),
    # ---- the MoE dispatcher's buffer reuse (moe.pml): steps back to back, no host barrier ----
    C(
        "moe-2r",
        ("N=2", "S=4"),
        "pass",
        "2 members, 4 steps, combine and dispatch in turn: counts first, rows once, headers, release signals, waits",
        model=MOE,
    ),
    C("moe-3r", ("N=3", "S=3"), "pass", "3 members, 3 steps", model=MOE),
    C("moe-2r-dispatches", ("N=2", "S=4", "ONEKIND"), "pass", "2 members, 4 dispatches, no combine", model=MOE),
    C(
        "moe-noparity",
        ("N=2", "S=4", "ONEKIND", "BUG_NOPARITY"),
        "overwrite",
        "dispatches back to back, one copy of the counts and rows, no parity",
        model=MOE,
    ),
    C(
        "moe-nowait",
        ("N=2", "S=4", "BUG_NOWAIT"),
        "final",
        "no counted waits: a header not landed yet fails a step every member made alike",
        model=MOE,
    ),
    C(
        "moe-early",
        ("N=2", "S=4", "BUG_EARLY"),
        "stale",
        "the signals before the stores: a dispatch's rows read before they land",
        model=MOE,
    ),
    C("moe-mismatch", ("N=2", "S=3", "MISMATCH"), "pass", "a dispatch against a combine: all stop", model=MOE),
    C("moe-mismatch-3r", ("N=3", "S=3", "MISMATCH"), "pass", "the same with 3 members", model=MOE),
    C("moe-refuse", ("N=2", "S=4", "REFUSE"), "pass", "a member refuses step 2: nobody reads it, all go on", model=MOE),
    C("moe-refuse-3r", ("N=3", "S=3", "REFUSE"), "pass", "the same with 3 members", model=MOE),
    C(
        "moe-norefuse",
        ("N=2", "S=4", "REFUSE", "BUG_NOREFUSE"),
        "stale",
        "a member refuses step 2, the check blind to it: rows read that were never sent",
        model=MOE,
    ),
    C(
        "moe-noheader",
        ("N=2", "S=3", "MISMATCH", "BUG_NOHEADER"),
        "stale",
        "a dispatch against a combine, no header check: a step read that was never sent",
        model=MOE,
    ),
    C(
        "moe-nocountwait",
        ("N=2", "S=4", "BUG_NOCOUNTWAIT"),
        "stale",
        "a dispatch's rows stored before its counts wait: offsets from counts not landed yet",
        model=MOE,
    ),
    # ---- symmsync.gemm's tile signals (gemm.pml): calls back to back, no host barrier ----
    C(
        "gemm-2r",
        ("N=2", "C=3"),
        "pass",
        "2 members, 3 calls: header and blocks in either order, parity regions, a wait per block",
        model=GEMM,
    ),
    C("gemm-3r", ("N=3", "C=2"), "pass", "3 members, 2 calls", model=GEMM),
    C("gemm-mismatch", ("N=2", "C=3", "MISMATCH"), "pass", "a member's rows differ at call 2: all stop", model=GEMM),
    C(
        "gemm-refuse",
        ("N=2", "C=3", "REFUSE"),
        "pass",
        "a member refuses call 2: nobody reads it, all go on",
        model=GEMM,
    ),
    C("gemm-refuse-3r", ("N=3", "C=3", "REFUSE"), "pass", "the same with 3 members", model=GEMM),
    C(
        "gemm-noparity",
        ("N=2", "C=3", "BUG_NOPARITY"),
        "overwrite",
        "one region per sender, no parity: a fast member's next call overwrites a block being read",
        model=GEMM,
    ),
    C("gemm-nowait", ("N=2", "C=3", "BUG_NOWAIT"), "stale", "no block waits: a block read before it lands", model=GEMM),
    C(
        "gemm-early",
        ("N=2", "C=3", "BUG_EARLY"),
        "stale",
        "a block's signal before its stores: a block read before it lands",
        model=GEMM,
    ),
    C(
        "gemm-noheader",
        ("N=2", "C=3", "REFUSE", "BUG_NOHEADER"),
        "stale",
        "a member refuses call 2, no header check: its next call's signal passes an old block off as call 2's",
        model=GEMM,
    ),
)
del C


@dataclass
class Result:
    config: Config
    got: str = "error"  # pass, a counterexample kind, or error
    errors: int | None = None
    states: int | None = None
    depth: int | None = None
    seconds: float | None = None  # pan's search time
    detail: str = ""
    output: str = field(default="", repr=False)
    workdir: str | None = None

    @property
    def ok(self) -> bool:
        return self.got == self.config.expect


def missing_tools() -> list[str]:
    return [t for t in ("spin", "gcc") if shutil.which(t) is None]


def classify(output: str) -> tuple[str, str]:
    """The kind of the first error pan reports, and its line."""
    for line in output.splitlines():
        if line.startswith("pan:1:") or line.startswith("pan: non-progress cycle"):
            if "invalid end state" in line:
                return "deadlock", line
            if "non-progress cycle" in line or "acceptance cycle" in line:
                return "cycle", line
            if "assertion violated" in line:
                if "aflag[" in line:
                    return "abort", line
                if "refw[" in line:
                    return "refusal", line
                if "pay[" in line or "tile[" in line:
                    return "payload", line
                if any(f"{a}[" in line for a in ("inp", "hdr", "sym", "red", "rows", "cnt", "blk")):
                    # collectives.pml's, moe.pml's and gemm.pml's READ: an earlier call's value, or a later one's
                    return ("stale" if ">=k)" in line else "overwrite"), line
                if "sent[" in line:
                    return "arrival", line
                if "dead[" in line or "gaveup[" in line:
                    return "timeout", line
                return "final", line
            return "other", line
    return "other", "pan reported an error it did not describe"


def _int(pattern: str, text: str) -> int | None:
    m = re.search(pattern, text)
    return int(m.group(1)) if m else None


def run_config(cfg: Config, keep: bool = False, opt: str = "-O2") -> Result:
    """Build and run the verifier of one configuration; never raises for a failed check. ``opt``: gcc's
    optimization of the verifier (the search and its result are the same at every level; ``-O0`` builds
    in a fifth of the time and searches a light configuration's few states in about as long)."""
    res = Result(cfg)
    work = tempfile.mkdtemp(prefix=f"symmsync-verify-{cfg.name}-")
    res.workdir = work
    shutil.copy(os.path.join(HERE, cfg.model), work)  # spin -a and the trail (<model>.trail) live there
    defines = [f"-D{f}" for f in cfg.flags]
    ccflags = ["-DNP"] if cfg.cycles else ["-DSAFETY"]
    steps = [
        ["spin", "-a", *defines, cfg.model],
        ["gcc", opt, "-w", *ccflags, "-DCOLLAPSE", f"-DMEMLIM={MEMLIM_MB}", "-o", "pan", "pan.c"],
        ["./pan", f"-m{MAX_DEPTH}", *(["-l"] if cfg.cycles else [])],
    ]
    try:
        for cmd in steps:
            try:
                p = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                res.detail = f"{cmd[0]} ran past {STEP_TIMEOUT_S} s"
                return res
            res.output += p.stdout + p.stderr
            if p.returncode != 0 and cmd[0] != "./pan":
                res.detail = f"{' '.join(cmd)} failed ({p.returncode}): {(p.stdout + p.stderr).strip()[-500:]}"
                return res
        out = res.output
        res.errors = _int(r"errors: (\d+)", out)
        res.states = _int(r"(\d+) states, stored", out)
        res.depth = _int(r"depth reached (\d+)", out)
        m = re.search(r"pan: elapsed time ([\d.e+-]+) seconds", out)
        res.seconds = float(m.group(1)) if m else None
        if res.errors is None:
            res.detail = "no 'errors:' line in pan's output"
        elif res.errors == 0:
            incomplete = [s for s in ("max search depth too small", "out of memory") if s in out]
            if incomplete:
                res.detail = "search incomplete: " + ", ".join(incomplete)
            else:
                res.got = "pass"
        else:
            res.got, res.detail = classify(out)
        return res
    finally:
        if not keep and res.ok:
            shutil.rmtree(work, ignore_errors=True)
            res.workdir = None


def run_all(configs: list[Config], jobs: int, keep: bool = False, opt: str = "-O2") -> list[Result]:
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda c: run_config(c, keep, opt), configs))


def trail(res: Result) -> str:
    """The counterexample (spin -t), one line per step: step, process, model line."""
    model = res.config.model
    if res.workdir is None or not os.path.exists(os.path.join(res.workdir, model + ".trail")):
        return "(no trail)"
    defines = [f"-D{f}" for f in res.config.flags]
    p = subprocess.run(
        ["spin", "-t", "-p", *defines, model],
        cwd=res.workdir,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )
    with open(os.path.join(HERE, model)) as f:
        source = f.read().splitlines()
    name = re.escape(model)
    step = re.compile(r"^\s*(\d+):\s+proc\s+(\d+) \((\w+):\d+\) \S*" + name + r":(\d+) \(state \d+\)\s*(.*)$")
    out, last = [], None
    for line in p.stdout.splitlines():
        m = step.match(line)
        if m is None:
            if "violated" in line or "invalid end state" in line:
                out.append(line.strip())
            continue
        n, pid, name, lineno, rest = m.groups()
        if (n, pid) == last and "end state" not in rest:
            continue
        last = (n, pid)
        text = source[int(lineno) - 1].strip() if 0 < int(lineno) <= len(source) else ""
        mark = "  <valid end state>" if "end state" in rest else "  <where the trail ends>" if not rest else ""
        out.append(f"{n:>5}  {name}[{pid}]  line {lineno}: {text}{mark}")
    return "\n".join(out)


def table(results: list[Result]) -> str:
    head = ("model", "config", "expected", "got", "states", "depth", "seconds", "")
    rows = [head]
    for r in results:
        rows.append(
            (
                r.config.name,
                " ".join(r.config.flags) + (" (cycles)" if r.config.cycles else ""),
                r.config.expect,
                r.got,
                "" if r.states is None else str(r.states),
                "" if r.depth is None else str(r.depth),
                "" if r.seconds is None else f"{r.seconds:.2f}",
                "ok" if r.ok else "MISMATCH " + r.detail,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def markdown(results: list[Result]) -> str:
    """The results as verify/README.md's table (``--markdown``), one row per configuration."""
    rows = [
        "| model | config (-D flags) | what | expected | got | states stored | depth | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.config
        flags = " ".join(c.flags) + (", `-DNP`, `pan -l`" if c.cycles else "")
        seconds = "" if r.seconds is None else f"{r.seconds:.2f}"
        states = "" if r.states is None else str(r.states)
        depth = "" if r.depth is None else str(r.depth)
        rows.append(f"| {c.name} | {flags} | {c.what} | {c.expect} | {r.got} | {states} | {depth} | {seconds} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="configurations to check (default: all)")
    ap.add_argument("--list", action="store_true", help="list the configurations and exit")
    ap.add_argument("--jobs", "-j", type=int, default=min(2, os.cpu_count() or 1), help="checks run at once")
    ap.add_argument("--trail", action="store_true", help="print each counterexample's steps")
    ap.add_argument("--keep", action="store_true", help="keep the work directories (pan.c, trails)")
    ap.add_argument("--markdown", action="store_true", help="print the results as verify/README.md's table")
    args = ap.parse_args(argv)
    if args.list:
        for c in CONFIGS:
            print(f"{c.name:18} {c.model:12} expect {c.expect:9} -D{' -D'.join(c.flags)}  {c.what}")
        return 0
    by_name = {c.name: c for c in CONFIGS}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        print(f"unknown configuration(s): {', '.join(unknown)}; --list shows them", file=sys.stderr)
        return 2
    missing = missing_tools()
    if missing:
        print(
            f"verify: {' and '.join(missing)} not found; run `make verify` (it installs spin) "
            "or `apt-get install spin gcc`",
            file=sys.stderr,
        )
        return 2
    configs = [by_name[n] for n in args.names] if args.names else list(CONFIGS)
    t0 = time.monotonic()
    results = run_all(configs, args.jobs, keep=args.keep or args.trail)
    print(markdown(results) if args.markdown else table(results))
    if args.trail:
        for r in results:
            if r.got not in ("pass", "error"):
                print(f"\n--- {r.config.name}: {r.detail}\n{trail(r)}")
    bad = [r for r in results if not r.ok]
    print(
        f"\n{len(results) - len(bad)} of {len(results)} as expected in {time.monotonic() - t0:.1f} s "
        f"(spin: {subprocess.run(['spin', '-V'], capture_output=True, text=True).stdout.strip()})"
    )
    for r in bad:
        print(f"MISMATCH {r.config.name}: expected {r.config.expect}, got {r.got}: {r.detail}", file=sys.stderr)
        if r.workdir:
            print(f"  work directory kept: {r.workdir}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
