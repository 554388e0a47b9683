"""The off-node exchange: the one place symmsync moves data between nodes, through torch.distributed.

A view whose members span nodes (:attr:`PeerView.nodes <symmsync.PeerView.nodes>`) cannot
map its far members' memory; what must cross nodes goes through the job's own
torch.distributed backend (NCCL on GPUs, gloo on CPUs; gloo where the default group is
bound to a device, whose NCCL groups would need every rank of the job) in an
:class:`OffNode`, made once per view by its members::

    off = OffNode(view, timeout_s=30)
    parts = off.all_gather(t)                      # every member's t, in view order
    heads = off.all_gather(t, among="position")    # one member per node: the inter-node step

Every wait is bounded. An exchange is issued asynchronously and polled; meanwhile it
watches this rank's abort of the view and the aborts the view's other members posted in
the torch.distributed store (:func:`post_abort`, called by every abort of a spanning view:
:meth:`PeerView.abort <symmsync.PeerView.abort>`, ``SymmetricBuffer.close()``, a waiter
that failed). So a rank that gives up or closes on one node reaches every rank of the
other nodes waiting in an exchange as :class:`~symmsync.PeerAborted` naming it, within a
poll (:data:`STORE_POLL_S`). A rank that dies without a word (killed, ``os._exit``) breaks
torch.distributed's exchange (gloo: the connection closes): that is a
:class:`~symmsync.PeerAborted` naming the members that did not post, within
:data:`SILENT_S`, that they saw it break too (torch.distributed does not say which one
died). One that hangs: a :class:`~symmsync.FenceTimeout` once
``timeout_s`` passed, naming the step, the ranks waited for and the budget. Never
torch.distributed's own error, never a hang. After any of these the exchange fails
closed: this rank aborts the view (telling the others), and every later call raises the
same error. A rank that cannot read the store (its host went away) fails its exchange with
an empty :attr:`~symmsync.PeerAborted.aborted`: it cannot tell who failed, so it names no
death; the others, where they can still read the store, name that rank and its reason.
The exchange torch.distributed still holds after a failure ends with the groups' own
timeout (``timeout_s`` + :data:`GROUP_GRACE_S`); with NCCL, whose watchdog may then end the
process (not run: see docs/guarantees.md), treat a failure across nodes as the end of the
process, as after a GPU trap. A call during CUDA graph capture raises
:class:`~symmsync.CaptureError`: the wait is on the host.
"""

from __future__ import annotations

import datetime
import logging
import re
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import backends, failure
from .agreement import Same, agree, ranks_text
from .checks import timeout_problem
from .errors import BackendError, CaptureError, ConfigError, FenceTimeout, PeerAborted

if TYPE_CHECKING:
    from .views import PeerView

log = logging.getLogger("symmsync")

#: Where aborts of spanning views are posted in the torch.distributed store: one key per
#: view and rank, ``symmsync/abort/<view name>/<global rank>``, holding the reason.
STORE_PREFIX = "symmsync/abort"

#: How often a waiting exchange reads the store for the other members' aborts, in seconds.
STORE_POLL_S = 0.02

#: How long a rank waits on, in seconds, once a member of its exchange posted an abort: the
#: exchange still completes if that member sent its part before (it finished the exchange, then
#: closed). And how long a rank whose exchange broke waits for the other members to post that they
#: gave up too: those that stay silent are the ones that died (torch.distributed does not say).
SILENT_S = 1.0

#: What a rank posts when torch.distributed broke its exchange off (it does not say who died).
BROKE = "the exchange broke"

#: What a rank that cannot read the store says (and posts, where the store still takes it).
STORE_LOST = "the store could not be read"

#: How long a wait polls without sleeping between polls, in seconds.
SPIN_S = 0.002

#: How much longer than ``timeout_s`` torch.distributed's own timeout of the groups is, in
#: seconds: an exchange this rank gave up on ends within it, so that nothing lingers.
GROUP_GRACE_S = 5.0


def bound_device() -> torch.device | None:
    """The device the default group is bound to (``init_process_group(device_id=...)``), or None."""
    return getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)


def global_ranks(view: PeerView) -> list[int]:
    """The view's members as global (world) ranks, in view order."""
    group = view.buffer.group
    if group is None or group == dist.group.WORLD:
        return list(view.ranks)
    return [dist.get_global_rank(group, r) for r in view.ranks]


def _key(view: PeerView, rank: int) -> str:
    return f"{STORE_PREFIX}/{view.name}/{rank}"


def post_abort(view: PeerView, reason: str) -> None:
    """Post this rank's abort of ``view`` (a view that spans nodes) in the store, where the
    members of other nodes read it (:class:`OffNode`'s waits). Best effort: a store that
    cannot be reached is logged, and the members fall back to their budget."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(_key(view, global_ranks(view)[view.local_index]), reason)
    except Exception as e:  # noqa: BLE001 - an abort must not raise for it
        log.warning("could not post the abort of view %s in the torch.distributed store: %s", list(view.ranks), e)


def posted_aborts(view: PeerView, ranks: list[int]) -> dict[int, str]:
    """``{global rank: reason}`` of the ``ranks`` that posted an abort of ``view``."""
    store = dist.distributed_c10d._get_default_store()
    found = {}
    for r in ranks:
        key = _key(view, r)
        if store.check([key]):
            found[r] = store.get(key).decode(errors="replace")
    return found


failure.on_spanning_abort(post_abort)  # every abort of a spanning view posts here


class OffNode:
    """The bounded torch.distributed exchanges among the members of one view (collective).

    Every member of ``view`` makes it, in the same order relative to the other
    torch.distributed groups it makes (torch.distributed names a group made by its
    members alone from how many groups each has). It creates the two groups it needs
    once: one of the view's members, and one of the members at this rank's position in
    its node. It registers with the view's
    failure owner: once this rank aborted the view, every call raises
    :class:`~symmsync.PeerAborted`.

    Args:
        view: a view (it may span nodes; one within one node works too).
        timeout_s: the budget of each exchange, in seconds; the same on every member.

    Raises:
        ConfigError: a bad ``timeout_s`` on any member, or budgets that differ (on every member).
        BackendError: torch.distributed could not make the groups.
    """

    def __init__(self, view: PeerView, *, timeout_s: float):
        if not all(hasattr(view, a) for a in ("nodes", "failure", "ranks", "buffer")):  # a PeerView's
            raise ConfigError(f"OffNode: view must be a PeerView, got {type(view).__name__}")
        self.view = view
        self.timeout_s = float(timeout_s) if isinstance(timeout_s, (int, float)) else 60.0
        problem = timeout_problem(timeout_s)
        self._ranks = global_ranks(view)
        me, layout = view.local_index, view.nodes
        pg_timeout = datetime.timedelta(seconds=(self.timeout_s if problem is None else 60.0) + GROUP_GRACE_S)
        self._view_group = self._new_group(self._ranks, pg_timeout)
        # The members at this rank's position, one per node that has one, in node order (view
        # indices). Every member makes both groups, so that members make as many groups.
        at = layout.position(me)
        self._position = [node[at] for node in layout.nodes if len(node) > at]
        self._position_group = self._new_group([self._ranks[i] for i in self._position], pg_timeout)
        agree(
            self._view_group,
            "OffNode",
            {"timeout_s": timeout_s},
            problem=problem,
            same={"timeout_s": Same()},
            device=view.buffer.device,
        )
        self._error: Exception | None = None
        view.failure.register(self, "OffNode")

    def _new_group(self, ranks: list[int], timeout: datetime.timedelta) -> Any:
        # A default group bound to a device (init_process_group(device_id=...)) makes NCCL groups
        # by splitting its communicator, which every rank of the job must join; the view's members
        # alone make these, so there they are gloo groups (gloo moves CUDA tensors through the host).
        bound = bound_device()
        try:
            return dist.new_group(
                sorted(ranks),
                timeout=timeout,
                use_local_synchronization=True,
                backend="gloo" if bound is not None else None,
            )
        except Exception as e:  # torch.distributed's own error: say it in symmsync's words
            raise BackendError(
                f"rank {dist.get_rank()}: OffNode: could not make the torch.distributed group of global "
                f"{ranks_text(sorted(ranks))} (did every member of the view make its OffNode?): {e}"
            ) from e

    # ------------------------------------------------------------------ Waiter
    def abort_error(self, reason: str) -> Exception:
        """What every call raises once this rank aborted the view with ``reason``."""
        return failure.used_after_abort(self.view, "OffNode", reason)

    # ------------------------------------------------------------------ exchanges
    def all_gather(self, t: torch.Tensor, among: str = "view") -> list[torch.Tensor]:
        """Every member's ``t``, in view-index order (collective over ``among``).

        Args:
            t: this rank's tensor: the same shape and dtype on every member (a member that
                differs leaves the exchange to torch.distributed's own checks, which gloo
                and NCCL do not all make).
            among: ``"view"``: every member of the view. ``"position"``: the members at
                this rank's position in its node (:meth:`~symmsync.nodes.NodeLayout.position`),
                one per node that has a member there, in node order (the inter-node step of a
                hierarchical collective; with uniform nodes, ``view.nodes.peers_at(position)``).

        Returns:
            The tensors, on ``t.device``.

        Raises:
            PeerAborted: this rank aborted the view, or a member posted an abort of it
                (naming that member and its reason), or torch.distributed's exchange
                broke (a member died; naming the members that stayed silent).
            FenceTimeout: the exchange did not finish within ``timeout_s``.
            ConfigError: a bad argument (on this rank).
            CaptureError: called while this rank's stream captures a CUDA graph.
        """
        view = self.view
        view.failure.check(self)
        call = "OffNode.all_gather"
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"rank {view.rank}: {call}: t must be a tensor, got {type(t).__name__}")
        if among == "view":
            members, group = list(range(view.size)), self._view_group
        elif among == "position":
            members, group = self._position, self._position_group
        else:
            raise ConfigError(f"rank {view.rank}: {call}: among must be 'view' or 'position', got {among!r}")
        self.refuse_capture(t.device, call)
        ranks = [self._ranks[i] for i in members]
        order = sorted(ranks)  # a group's ranks are in ascending global order
        src = t.contiguous()
        out = [torch.empty_like(src) for _ in ranks]
        try:
            work = dist.all_gather(out, src, group=group, async_op=True)
        except RuntimeError as e:
            self._fail(self._explain(call, ranks, _gist(e)), f"{call}: {BROKE}")
        self._wait(work, call, ranks)
        return [out[order.index(r)] for r in ranks]

    def refuse_capture(self, device: torch.device, call: str) -> None:
        """Raise :class:`~symmsync.CaptureError` where ``device``'s current stream captures a CUDA
        graph: an exchange between nodes is a torch.distributed call this rank waits for on the
        host, which a graph cannot hold. A caller checks before its first step, so that nothing
        is written, sent or aborted: where every member captured, the view stays usable."""
        if backends.capturing(device):
            raise CaptureError(
                f"rank {self.view.rank}: {call}: called during CUDA graph capture; its exchange between nodes "
                "waits on the host, which a graph cannot hold: make the call outside the capture (eagerly, "
                "or compiled without CUDA graphs)"
            )

    def _wait(self, work: Any, call: str, ranks: list[int]) -> None:
        """Poll ``work`` until it is done; fail closed on an abort, a broken exchange or the budget."""
        me = self._ranks[self.view.local_index]
        others = [r for r in ranks if r != me]
        start = time.monotonic()
        next_read, told = start, None
        while True:
            try:
                if work.is_completed():
                    work.wait()
                    return
            except RuntimeError as e:  # gloo: a peer's connection closed
                self._fail(self._explain(call, ranks, _gist(e)), f"{call}: {BROKE}")
            if self.view.failure.reason is not None:
                self.view.failure.check(self)
            now = time.monotonic()
            if told is None and now >= next_read:
                next_read = now + STORE_POLL_S
                try:
                    posted = posted_aborts(self.view, others)
                except Exception as e:  # noqa: BLE001 - the store is torch.distributed's: say it in our words
                    # Posted (where the store still takes it) as this rank's own cause, not as BROKE:
                    # the others then name this rank, and name no member as dead.
                    self._fail(self._store_lost(call, ranks, _gist(e)), f"{call}: {STORE_LOST} ({_gist(e)})")
                if any(BROKE in why for why in posted.values()):  # it broke for a member: no part is coming
                    self._fail(self._explain(call, ranks, None), f"{call}: {BROKE}")
                if posted:
                    told = now  # a member gave up: but it may have sent its part before, which then arrives
            if told is not None and now - told > SILENT_S:
                err = self._explain(call, ranks, None)
                self._fail(err, f"{call}: gave up after {ranks_text(sorted(err.aborted))}")
            if now - start > self.timeout_s:
                self._fail(self._timeout(call, ranks), f"{call}: timed out after {self.timeout_s:g} s")
            time.sleep(0 if now - start < SPIN_S else 0.0005)  # a fast exchange is not made to wait a sleep

    # ------------------------------------------------------------------ failures
    def _fail(self, err: Exception, reason: str) -> None:
        """Fail closed: every later call raises ``err``, and the view's members are told ``reason``
        (unless this rank told them why already)."""
        view = self.view
        view.failure.fail(self, err)
        view.failure.abort_quietly(reason)
        raise err

    def _explain(self, call: str, ranks: list[int], detail: str | None) -> PeerAborted:
        """The error of an exchange that broke (torch.distributed's ``detail``) or that members
        posted aborts of, naming who gave up first.

        A member whose abort says something else than :data:`BROKE` (it closed, aborted, timed
        out) is named with its reason, at once. Otherwise every member only saw the exchange
        break, and this rank posts that too (so the others count it alive) and waits up to
        :data:`SILENT_S` for every other member of the exchange but one to do the same: those
        that stay silent are named as the ones that died, since torch.distributed does not
        say. Best effort: a member slower than that is named too.
        """
        view, me = self.view, self._ranks[self.view.local_index]
        members = [r for r in ranks if r != me]
        posted: dict[int, str] = {}
        deadline, told = time.monotonic() + SILENT_S, False
        while True:
            try:
                posted = posted_aborts(view, members)
            except Exception as e:  # noqa: BLE001 - the store may have gone with the dead rank
                return self._store_lost(call, ranks, _gist(e))  # who is silent cannot be told now
            first = {r: why for r, why in posted.items() if BROKE not in why}
            if first:
                return self._aborted(call, first)
            if not told:  # tell the others this rank lives
                view.failure.abort_quietly(f"{call}: {BROKE} ({detail or 'told by ' + ranks_text(sorted(posted))})")
                told = True
            if len(posted) >= len(members) - 1 or time.monotonic() > deadline:
                break
            time.sleep(STORE_POLL_S)
        silent = [r for r in members if r not in posted]
        if not silent:
            return self._aborted(call, posted)
        why = f"died or left: silent after the exchange broke ({detail or 'as its peers told'})"
        return self._peer_aborted(
            call,
            f"the exchange broke and {ranks_text(silent)} stayed silent (died or left? check its log; "
            f"{detail or 'told by the ranks that saw it break'})",
            dict.fromkeys(silent, why),
        )

    def _store_lost(self, call: str, ranks: list[int], detail: str) -> PeerAborted:
        """The error of an exchange whose rank cannot read the store: it cannot tell which member
        failed, so :attr:`~symmsync.PeerAborted.aborted` is empty and the message guesses no death."""
        others = [r for r in ranks if r != self._ranks[self.view.local_index]]
        return self._peer_aborted(
            call,
            f"{STORE_LOST} ({detail}), so whether {ranks_text(others)} failed cannot be told (did the "
            "store's host, MASTER_ADDR, go away?)",
            {},
        )

    def _aborted(self, call: str, aborted: dict[int, str]) -> PeerAborted:
        said = "; ".join(f"rank {r}: {why}" for r, why in sorted(aborted.items()))
        return self._peer_aborted(call, f"{ranks_text(sorted(aborted))} aborted the view ({said})", aborted)

    def _peer_aborted(self, call: str, what: str, aborted: dict[int, str]) -> PeerAborted:
        """The one form of an exchange's :class:`~symmsync.PeerAborted`: ``what`` happened, naming ``aborted``."""
        me = self._ranks[self.view.local_index]
        return PeerAborted(
            f"rank {me}: {call} on view {list(self.view.ranks)}: {what}; the exchange fails closed (carry on "
            "with a new view)",
            rank=me,
            epoch=-1,
            late={},
            channel=-1,
            aborted=aborted,
        )

    def _timeout(self, call: str, ranks: list[int]) -> FenceTimeout:
        me = self._ranks[self.view.local_index]
        gone = [r for r in ranks if r != me]
        return FenceTimeout(
            f"rank {me}: {call} on view {list(self.view.ranks)}: the exchange with {ranks_text(gone)} did not "
            f"finish within its budget of {self.timeout_s:g} s (a member hung, or never called it); it fails "
            "closed (raise timeout_s if the step is legitimately slow)",
            rank=me,
            epoch=-1,
            late=dict.fromkeys(gone, -1),
            channel=-1,
        )

    def __repr__(self) -> str:
        return f"OffNode(view={list(self.view.ranks)}, nodes={self.view.nodes}, timeout_s={self.timeout_s:g})"


def _gist(e: Exception) -> str:
    """torch.distributed's error in a few words: its first sentence, without gloo's source location."""
    text = str(e).strip()
    line = text.splitlines()[0].split(". ")[0].rstrip(".") if text else ""
    return re.sub(r"^\[[^\]]*\]\s*", "", line) or type(e).__name__
