"""The watch of a node's processes: a member that died is named within a poll, by every consumer.

A member that dies without a word (killed, ``os._exit``, a crash) never marks its abort flags,
so a member waiting for it in a fence, a collective's step or a signal wait would wait out its
whole budget. Every process of one node runs on one host, so each rank can see whether its
node peers' processes still run. While a view within one node has a waiter (a
:class:`~symmsync.Fence`, :class:`~symmsync.Signals`, a collective, the writer's and the MoE
dispatcher's steps: :meth:`ViewFailure.register <symmsync.core.failure.ViewFailure.register>`
watches the view), a thread of this process (one for all the views, a daemon, ended when no
view is left) reads every :data:`WATCH_S` whether each other member's process still runs
(:func:`alive`: ``/proc/<pid>/stat``, the process's start time compared, so a reused pid is
not taken for it). For a member found dead it does what that member would have done on
giving up, the same as the watch of spanning views (:mod:`symmsync.spanning.parts`) does for a
node peer that another node found dead:

* it writes the reason :data:`DIED` into the dead member's own cells of the view (every channel;
  its memory stays mapped here), unless that member had written a reason of its own before it
  died (its last abort, then, is what the members read);
* then it sets that member's abort flag in this rank's own cells of the view (every channel, a
  plain store: only that member ever wrote its slot here).

So every wait for it fails at its next poll with :class:`~symmsync.PeerAborted` (a signal wait:
:class:`~symmsync.SignalAborted`) naming it, ``aborted={rank: "died ..."}``, exactly as if it had
aborted; a wait for what it published before it died still completes. Nothing of the modelled
protocol changes (verify/): an abort flag and its reason, written once, before the flag.

The watch launches no kernel (Triton's interpreter is not thread-safe) and touches nothing
else; the waiter that fails aborts the view on its own thread (relaying the origin). Members
whose processes this rank cannot see (another host, another pid namespace, no ``/proc``) are
not watched: a wait for them ends at its budget, as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

import torch

from ..language import cells

log = logging.getLogger("symmsync")

#: How often the watch reads whether each watched member's process still runs, in seconds.
WATCH_S = 0.05

#: The reason a dead member's cells are given (what its members' errors name).
DIED = "died (its process ended without a word: killed, os._exit or a crash)"

#: ``(host, pid namespace, pid, start time)``: a process, as :func:`identity` gives it.
Identity = tuple[str, str, int, int]


def _stat(pid: int | str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # past the command's name, which may hold spaces


def identity() -> Identity | None:
    """This process as its node peers can watch it (a buffer's exchange of arguments carries it),
    or ``None`` where it cannot be watched (no ``/proc``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            host = f.read().strip()
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    fields = _stat("self")
    if fields is None:
        return None
    return host, ns, os.getpid(), int(fields[19])  # field 22 of stat: the start time


def comparable(mine: Identity | None, theirs: Identity | None) -> bool:
    """Whether this process can see ``theirs``: one host (boot), one pid namespace."""
    return mine is not None and theirs is not None and mine[:2] == theirs[:2]


def alive(theirs: Identity) -> bool:
    """Whether the process ``theirs`` still runs (a zombie its parent has not reaped has ended)."""
    fields = _stat(theirs[2])
    return fields is not None and fields[0] not in ("Z", "X") and int(fields[19]) == theirs[3]


class _Watched:
    """One view under the watch: its members' processes and what was flagged already."""

    def __init__(self, view: Any, procs: list[Identity | None]):
        self.view = weakref.ref(view)
        mine = procs[view.local_index]
        self.procs = {i: p for i, p in enumerate(procs) if i != view.local_index and comparable(mine, p)}
        self.flagged: set[int] = set()

    def look(self) -> bool:
        """One look at the members; False once the view is gone or closed (stop watching it)."""
        view = self.view()
        if view is None or view.buffer.closed:
            return False
        for i, proc in self.procs.items():
            if i not in self.flagged and not alive(proc):
                self.flagged.add(i)
                log.warning(
                    "symmsync: rank %d of view %s died; its members' waits end", view.ranks[i], list(view.ranks)
                )
                flag_dead(view, i)
        return len(self.flagged) < len(self.procs)


def flag_dead(view: Any, i: int) -> None:
    """Mark member ``i`` of ``view`` (found dead) as aborted at this rank: its reason in its own
    cells (every channel, unless it wrote one), then its abort flag in this rank's cells."""
    buf = view.buffer
    rank = view.ranks[i]
    offsets = [view.cell_offset(c) for c in range(buf.cells.channels)]
    theirs = buf.cell_memory(rank).view(torch.int64)
    mine = buf.cell_memory().view(torch.int64)
    reason = torch.tensor(cells.encode_reason(cells.REASON_ERROR, DIED), dtype=torch.int64)
    flags = torch.tensor([(c + cells.SLOTS) // 8 + i for c in offsets], dtype=torch.int64)

    def store() -> None:
        for c in offsets:
            at = (c + cells.REASON) // 8
            if int(theirs[at].item()) == 0:  # it wrote no reason of its own
                theirs[at : at + cells.REASON_WORDS] = reason.to(theirs.device)
        mine[flags.to(mine.device)] |= cells.ABORT_FLAG  # after the reasons: a wait that sees it reads them

    if not buf.capabilities.streams:
        store()
        return
    with torch.cuda.device(buf.device):  # a side stream: the current one may hold the waiting step
        side = torch.cuda.Stream(buf.device)
        with torch.cuda.stream(side):
            store()
        side.synchronize()


_WATCHED: dict[int, _Watched] = {}  # by id of the view
_LOCK = threading.Lock()
_watcher: list[threading.Thread] = []


def watch(view: Any, procs: Any) -> None:
    """Watch ``view``'s members (its processes ``procs``, in view order) from now on, until the
    view's buffer closes or the view is gone. Idempotent; a view of one member, or one whose
    members this process cannot see, is not watched."""
    key = id(view)
    with _LOCK:
        if key in _WATCHED and _WATCHED[key].view() is view:
            return
        watched = _Watched(view, list(procs))
        if not watched.procs:
            return
        _WATCHED[key] = watched
        if not _watcher:
            _watcher.append(threading.Thread(target=_loop, name="symmsync-liveness-watch", daemon=True))
            _watcher[0].start()


def _loop() -> None:
    while True:
        with _LOCK:
            live = list(_WATCHED.items())
            if not live:
                _watcher.clear()
                return
        for key, watched in live:
            try:
                keep = watched.look()
            except Exception as e:  # noqa: BLE001 - a watch must not die of one view's trouble
                log.debug("the liveness watch of a view failed: %s", e)
                keep = False
            if not keep:
                with _LOCK:
                    if _WATCHED.get(key) is watched:
                        del _WATCHED[key]
        del live
        time.sleep(WATCH_S)
