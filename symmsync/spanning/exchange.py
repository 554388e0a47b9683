"""The off-node exchange: how data crosses nodes, through gloo groups of a view's members.

A view whose members span nodes (:attr:`PeerView.nodes <symmsync.PeerView.nodes>`) cannot
map its far members' memory; what must cross nodes goes through an :class:`OffNode`, made
once per view by its members (the consumers over a view share the view's one,
:mod:`.parts`)::

    off = OffNode(view, timeout_s=30)
    parts = off.all_gather(t)                      # every member's t, in view order
    heads = off.all_gather(t, among="position")    # one member per node: the inter-node step

Its two groups are gloo groups made by hand over the job's torch.distributed store (gloo
moves CUDA tensors through the host), not entered in torch.distributed's table of groups:
that table names a group of a set of ranks from the groups of those ranks alive on each
rank, and a group made again under a name a closed one had meets the old one's keys in the
store. ``close()`` shuts them down (:meth:`OffNode.release`), so that a job that makes and
closes views keeps a bounded number (:func:`live_groups`).

Every wait is bounded. An exchange is issued asynchronously and polled; meanwhile it
watches this rank's abort of the view and the aborts the view's other members posted in
the torch.distributed store (:func:`post_abort`, called by every abort of a spanning view:
:meth:`PeerView.abort <symmsync.PeerView.abort>`, ``SymmetricBuffer.close()``, a waiter
that failed). So a rank that gives up or closes on one node reaches every rank of the
other nodes waiting in an exchange as :class:`~symmsync.PeerAborted` naming it, within a
poll (:data:`STORE_POLL_S`); a rank that relays it (its exchange broke when the other
closed) posts the origin's rank and reason. A rank that dies without a word (killed,
``os._exit``) breaks the exchange (gloo: the connection closes): that is a
:class:`~symmsync.PeerAborted` naming the members that did not post, within
:data:`SILENT_S`, that they saw it break too (gloo does not say which one died). One that
hangs: a :class:`~symmsync.FenceTimeout` once the call's budget passed, naming the step,
the ranks waited for and the budget. Never torch.distributed's own error, never a hang.
After any of these the exchange fails closed: this rank aborts the view (telling the
others), and every later call raises the same error. A rank that cannot read the store
(its host went away) fails its exchange with an empty
:attr:`~symmsync.PeerAborted.aborted`: it cannot tell who failed, so it names no death;
the others, where they can still read the store, name that rank and its reason. An
exchange gloo still holds after a failure ends with the groups' own timeout
(``timeout_s`` + :data:`GROUP_GRACE_S`), or when ``close()`` aborts the groups. A call
during CUDA graph capture raises :class:`~symmsync.CaptureError`: the wait is on the host.
"""

from __future__ import annotations

import datetime
import logging
import re
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import backends
from ..checks import MAX_TIMEOUT_S, timeout_problem
from ..core import failure
from ..core.agreement import ranks_text
from ..errors import CLOSED_REASON, BackendError, ConfigError, FenceTimeout, PeerAborted

if TYPE_CHECKING:
    from ..core.views import PeerView

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

#: The key, under a view's ``symmsync/abort/<view name>/``, of the member that gave up on it first
#: (:func:`claim_origin`): ``<global rank>\n<reason>``.
ORIGIN = "origin"

#: What a rank posts when torch.distributed broke its exchange off (it does not say who died).
BROKE = "the exchange broke"

#: What a member that did not answer within :data:`SILENT_S` after the exchange broke is named with:
#: it died or left, or it is alive and slower than that (gloo does not say which member went).
SILENT = "did not answer"

#: What a rank that cannot read the store says (and posts, where the store still takes it).
STORE_LOST = "the store could not be read"

#: How long a wait polls without sleeping between polls, in seconds.
SPIN_S = 0.002

#: How much longer than ``timeout_s`` torch.distributed's own timeout of the groups is, in
#: seconds: an exchange this rank gave up on ends within it, so that nothing lingers.
GROUP_GRACE_S = 5.0


#: Where an OffNode's groups connect in the torch.distributed store:
#: ``symmsync/offnode/<view name>/<its global ranks>/<n>/view`` and ``.../position <p>``, the n-th
#: OffNode of the view.
GROUP_PREFIX = "symmsync/offnode"

_BY_VIEW: dict[str, list[weakref.ref[OffNode]]] = {}  # view name -> its OffNodes in this process
_SERIALS: dict[str, int] = {}  # view name and ranks -> the OffNodes made on it so far (the last one's number)
_LIVE: dict[int, str] = {}  # the groups OffNodes made and did not release yet: id -> name


def live_groups() -> list[str]:
    """The names of this process's OffNode groups not released yet (each OffNode makes two; the
    buffer's ``close()`` releases them)."""
    return sorted(_LIVE.values())


def global_ranks(view: PeerView) -> list[int]:
    """The view's members as global (world) ranks, in view order."""
    group = view.buffer.group
    if group is None or group == dist.group.WORLD:
        return list(view.ranks)
    return [dist.get_global_rank(group, r) for r in view.ranks]


def _key(view: PeerView, rank: int) -> str:
    return f"{STORE_PREFIX}/{view.name}/{rank}"


def default_store() -> Any:
    """torch.distributed's default store: where aborts over nodes, and refused writes of the PCP
    writer's gathered routes, are posted."""
    return dist.distributed_c10d._get_default_store()


def post_abort(view: PeerView, reason: str) -> None:
    """Post this rank's abort of ``view`` (a view that spans nodes) in the store, where the
    members of other nodes read it (:class:`OffNode`'s waits). Before the reason: how many
    exchanges of each of the view's OffNodes this rank finished (a member waiting in one it
    finished still gets its part), and the view's origin, claimed for this rank unless a
    member claimed it first (:func:`claim_origin`; a rank that only saw an exchange break
    claims nothing). Best effort: a store that cannot be reached is logged, and the members
    fall back to their budget."""
    try:
        me = global_ranks(view)[view.local_index]
        for off in _offnodes(view):
            off.post_done(me)
        relayed = view.failure.relayed  # it relays a member's abort (or death): that member is the origin
        if relayed is not None and relayed[0] in view.ranks:
            claim_origin(view, global_ranks(view)[view.ranks.index(relayed[0])], relayed[1])
        elif BROKE not in reason:
            claim_origin(view, me, reason)
        default_store().set(_key(view, me), reason)
    except Exception as e:  # noqa: BLE001 - an abort must not raise for it
        log.warning("could not post the abort of view %s in the torch.distributed store: %s", list(view.ranks), e)


def posted_aborts(view: PeerView, ranks: list[int]) -> dict[int, str]:
    """``{global rank: reason}`` of the ``ranks`` that posted an abort of ``view``."""
    store = default_store()
    found = {}
    for r in ranks:
        key = _key(view, r)
        if store.check([key]):
            found[r] = store.get(key).decode(errors="replace")
    return found


def claim_origin(view: PeerView, rank: int, reason: str) -> tuple[int, str]:
    """Claim that global ``rank`` gave up on ``view`` first, with ``reason``; return the
    view's origin: this claim, or the one a member made before (the first claim stands).

    Every abort of a spanning view claims it before it tells anyone (:func:`post_abort`
    runs before the abort marks the node view's flags or shuts an exchange), and a rank
    that found members dead (:data:`SILENT`) claims it for the first of them: so whoever
    hears of a failure, from whomever, finds its origin here (:func:`origin`)."""
    got = default_store().compare_set(_key(view, ORIGIN), "", f"{rank}\n{reason}")
    return _parse_origin(got)


def origin(view: PeerView) -> tuple[int, str] | None:
    """``(global rank, reason)`` of the member that gave up on ``view`` first, or ``None``
    (none did, or the store cannot be read)."""
    try:
        store, key = default_store(), _key(view, ORIGIN)
        return _parse_origin(store.get(key)) if store.check([key]) else None
    except Exception:  # noqa: BLE001 - the store is torch.distributed's: no origin known
        return None


def _parse_origin(value: bytes) -> tuple[int, str]:
    rank, _, reason = value.decode(errors="replace").partition("\n")
    return int(rank), reason


def what_the_origin_did(why: str) -> str:
    """The origin's reason as the messages say it: ``closed its buffer``, ``did not answer ...``
    (it died), ``aborted the view (<reason>)``."""
    if why == CLOSED_REASON:
        return "closed its buffer"
    if why.startswith(SILENT):
        return why
    return f"aborted the view ({why})"


def origin_error(view: PeerView, rank: int, what: str, first: tuple[int, str]) -> PeerAborted:
    """The :class:`~symmsync.PeerAborted` of a call over ``view`` that failed because a member gave
    up: it names the origin ``first`` and its reason (whoever relayed it to this rank)."""
    r, why = first
    happened = f"rank {r} {what_the_origin_did(why)}, first of the view's members"
    return failure.peer_aborted(view, rank, what, happened, {r: why})


def as_origin(view: PeerView, rank: int, what: str, e: Exception) -> Exception:
    """``e`` as naming the view's origin: a :class:`~symmsync.PeerAborted` from a step within one
    node names the node peer whose flag it saw, which may only have relayed the origin's news;
    this is the same error naming the origin (:func:`origin`) and its reason instead. Any other
    error, or one that names the origin already (or no origin known), is returned as it is."""
    if not isinstance(e, PeerAborted):
        return e
    first = origin(view)
    if first is None or e.aborted == dict([first]):
        return e
    return origin_error(view, rank, what, first)


def _offnodes(view: PeerView) -> list[OffNode]:
    return [off for off in (ref() for ref in _BY_VIEW.get(view.name, ())) if off is not None]


failure.on_spanning_abort(post_abort)  # every abort of a spanning view posts here


class OffNode:
    """The bounded torch.distributed exchanges among the members of one view (collective).

    Every member of ``view`` makes it, in the same order relative to the other OffNodes of
    the view it makes. It makes the two gloo groups it needs once, by hand over the
    torch.distributed store (so that none enters torch.distributed's table of groups, whose
    names a later group of the same ranks would reuse): one of the view's members, and one of
    the members at this rank's position in its node. It registers with the view's failure
    owner: once this rank aborted the view, every call raises :class:`~symmsync.PeerAborted`;
    when the buffer closes, :meth:`release` shuts its groups down.

    Args:
        view: a view (it may span nodes; one within one node works too).
        timeout_s: the budget of each exchange, in seconds; the same on every member.

    Raises:
        ConfigError: a bad ``timeout_s`` on any member, or budgets that differ (on every member).
        BackendError: the groups could not be made (a member did not make its OffNode in time).
    """

    def __init__(self, view: PeerView, *, timeout_s: float):
        if not all(hasattr(view, a) for a in ("nodes", "failure", "ranks", "buffer")):  # a PeerView's
            raise ConfigError(f"OffNode: view must be a PeerView, got {type(view).__name__}")
        self.view = view
        problem = timeout_problem(timeout_s)
        self.timeout_s = float(timeout_s) if problem is None else 60.0
        self._ranks = global_ranks(view)
        me, layout = view.local_index, view.nodes
        # The members make a view's OffNodes in one order: the n-th one's groups are named alike.
        key = f"{view.name}/{','.join(map(str, sorted(self._ranks)))}"  # views of other ranks may share a region
        serial = _SERIALS[key] = _SERIALS.get(key, -1) + 1
        name = f"{GROUP_PREFIX}/{key}/{serial}"
        timeout = datetime.timedelta(seconds=self.timeout_s + GROUP_GRACE_S)
        self._groups: list[Any] = []
        self._view_group = self._new_group(f"{name}/view", self._ranks, timeout)
        # The members at this rank's position, one per node that has one, in node order (view indices).
        at = layout.position(me)
        self._position = [node[at] for node in layout.nodes if len(node) > at]
        self._position_group = self._new_group(
            f"{name}/position {at}", [self._ranks[i] for i in self._position], timeout
        )
        self._broken = False
        self._name = name
        self._issued = {"view": 0, "position": 0}  # exchanges begun, by group
        self._done = {"view": 0, "position": 0}  # exchanges finished, by group
        _BY_VIEW.setdefault(view.name, []).append(weakref.ref(self))
        view.failure.register(self, "OffNode")
        self._agree_budget(timeout_s, problem)

    def _new_group(self, name: str, ranks: list[int], timeout: datetime.timedelta) -> Any:
        # A gloo group of these ranks alone, over the job's store under a name of its own (gloo moves
        # CUDA tensors through the host). Its members connect to each other here, within ``timeout``.
        order = sorted(ranks)
        me = self._ranks[self.view.local_index]
        try:
            store = dist.PrefixStore(name, dist.distributed_c10d._get_default_store())
            group = dist.ProcessGroupGloo(store, order.index(me), len(order), timeout)
        except Exception as e:  # torch.distributed's own error: say it in symmsync's words
            raise BackendError(
                f"rank {me}: OffNode: could not make the gloo group of global {ranks_text(order)} (did every "
                f"member of the view make its OffNode?): {_gist(e)}"
            ) from e
        self._groups.append(group)
        _LIVE[id(group)] = name
        return group

    def _agree_budget(self, timeout_s: Any, problem: str | None) -> None:
        """Every member's budget, in one exchange over the view's group: a bad one or budgets that
        differ raise the same :class:`~symmsync.ConfigError` on every member."""
        mine = torch.tensor([float("nan") if problem is not None else self.timeout_s], dtype=torch.float64)
        parts = [torch.empty_like(mine) for _ in self._ranks]
        try:
            self._view_group.allgather([parts], [mine]).wait()
        except RuntimeError as e:
            raise BackendError(
                f"rank {self._ranks[self.view.local_index]}: OffNode: the members' budgets could not be "
                f"exchanged (a member left?): {_gist(e)}"
            ) from e
        order = sorted(self._ranks)
        budgets = {r: parts[order.index(r)].item() for r in self._ranks}
        view = list(self.view.ranks)
        bad = [r for r, b in budgets.items() if b != b]  # NaN: that member's timeout_s was not a budget
        if bad:
            raise ConfigError(
                f"OffNode: timeout_s is not a budget on {ranks_text(bad)} of view {view} (a positive number of "
                f"seconds up to {MAX_TIMEOUT_S:g})"
            )
        if len(set(budgets.values())) > 1:
            said = ", ".join(f"rank {r}: {b:g}" for r, b in budgets.items())
            raise ConfigError(
                f"OffNode: timeout_s differs across ranks of view {view} ({said}): every member must pass the same"
            )

    def release_tables(self) -> None:
        """The buffer closed (:class:`symmsync.core.failure.Waiter`): :meth:`release`."""
        self.release()

    def post_done(self, rank: int) -> None:
        """Post how many exchanges of each group this rank (global ``rank``) finished (its abort:
        :func:`post_abort`), so that a member waiting in one of them still takes its part."""
        default_store().set(f"{self._name}/done/{rank}", f"{self._done['view']} {self._done['position']}")

    def _finished(self, rank: int, among: str, n: int) -> bool:
        """Whether member ``rank``, which posted an abort, had finished exchange ``n`` of ``among``
        before (then its part was sent: this rank's exchange may still complete)."""
        key = f"{self._name}/done/{rank}"
        try:
            store = default_store()
            if not store.check([key]):
                return False
            done = dict(zip(("view", "position"), map(int, store.get(key).decode().split())))
        except Exception:  # noqa: BLE001 - not known to have finished: it fails the exchange
            return False
        return done[among] >= n

    def release(self) -> None:
        """Shut the groups down (the buffer closed; idempotent): a later call raises as after an abort."""
        for group in self._groups:
            _LIVE.pop(id(group), None)
            stop = getattr(group, "abort" if self._broken else "shutdown", None)  # where this torch has them
            if stop is not None:
                try:
                    stop()
                except Exception:  # noqa: BLE001 - a group whose peer died may refuse; it goes with its owner
                    pass
        self._groups = []
        self._view_group = self._position_group = None

    # ------------------------------------------------------------------ Waiter
    def abort_error(self, reason: str) -> Exception:
        """What every call raises once this rank aborted the view with ``reason``."""
        return failure.used_after_abort(self.view, "OffNode", reason)

    # ------------------------------------------------------------------ exchanges
    def all_gather(self, t: torch.Tensor, among: str = "view", *, timeout_s: float | None = None) -> list[torch.Tensor]:
        """Every member's ``t``, in view-index order (collective over ``among``).

        Args:
            t: this rank's tensor: the same shape and dtype on every member (a member that
                differs leaves the exchange to torch.distributed's own checks, which gloo
                and NCCL do not all make).
            among: ``"view"``: every member of the view. ``"position"``: the members at
                this rank's position in its node (:meth:`~symmsync.core.nodes.NodeLayout.position`),
                one per node that has a member there, in node order (the inter-node step of a
                hierarchical collective; with uniform nodes, ``view.nodes.peers_at(position)``).
            timeout_s: this call's budget (default and at most: the OffNode's, which its groups'
                own timeout follows).

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
        budget = self.timeout_s if timeout_s is None else min(float(timeout_s), self.timeout_s)
        self._issued[among] += 1
        try:
            work = group.allgather([out], [src])
        except RuntimeError as e:
            self._fail_with(self._explain(call, ranks, _gist(e)), call)
        self._wait(work, call, ranks, budget, among, self._issued[among])
        self._done[among] += 1
        return [out[order.index(r)] for r in ranks]

    def refuse_capture(self, device: torch.device, call: str) -> None:
        """Raise :class:`~symmsync.CaptureError` where ``device``'s current stream captures a CUDA
        graph: an exchange between nodes is a torch.distributed call this rank waits for on the
        host, which a graph cannot hold. A caller checks before its first step, so that nothing
        is written, sent or aborted: where every member captured, the view stays usable."""
        if backends.capturing(device):
            raise backends.capture_error(
                f"rank {self.view.rank}: {call}",
                "its exchange between nodes waits on the host, which a graph cannot hold",
                "Make the call outside the capture (eagerly, or compiled without CUDA graphs)",
            )

    def _wait(self, work: Any, call: str, ranks: list[int], budget: float, among: str, n: int) -> None:
        """Poll ``work`` (exchange ``n`` of ``among``) until it is done; fail closed on an abort, a
        broken exchange or the budget. A member that posted an abort before it finished this
        exchange fails it at once; one that finished it (then closed, say) leaves it up to
        :data:`SILENT_S` to complete, since its part was sent."""
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
                self._fail_with(self._explain(call, ranks, _gist(e)), call)
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
                    self._fail_with(self._explain(call, ranks, None), call)
                if posted:
                    if not all(self._finished(r, among, n) for r in posted):  # no part is coming from it
                        self._fail_with(self._explain(call, ranks, None), call)
                    told = now  # they finished this exchange, then gave up: their parts are on their way
            if told is not None and now - told > SILENT_S:
                err = self._explain(call, ranks, None)
                self._fail(err, f"{call}: gave up after {ranks_text(sorted(err.aborted))}")
            if now - start > budget:
                self._fail(self._timeout(call, ranks, budget), f"{call}: timed out after {budget:g} s")
            time.sleep(0 if now - start < SPIN_S else 0.0005)  # a fast exchange is not made to wait a sleep

    # ------------------------------------------------------------------ failures
    def _fail_with(self, err: PeerAborted, call: str) -> None:
        """:meth:`_fail` after an exchange that broke or that members gave up on: the members are
        told the origin's reason where a member posted one (so that those who hear it from this
        rank still learn who gave up first, and why), else that the exchange broke."""
        told = {r: why for r, why in err.aborted.items() if BROKE not in why and not why.startswith(SILENT)}
        if told:
            self._fail(err, f"{call}: " + "; ".join(f"rank {r}: {why}" for r, why in sorted(told.items())))
        self._fail(err, f"{call}: {BROKE}")

    def _fail(self, err: Exception, reason: str) -> None:
        """Fail closed: every later call raises ``err``, and the view's members are told ``reason``
        (unless this rank told them why already)."""
        view = self.view
        self._broken = True  # an exchange may still be pending in the groups: release() aborts them
        view.failure.fail(self, err)
        view.failure.abort_quietly(reason)
        raise err

    def _explain(self, call: str, ranks: list[int], detail: str | None) -> PeerAborted:
        """The error of an exchange that broke (torch.distributed's ``detail``) or that members
        posted aborts of, naming the member that gave up first (:func:`origin`).

        A member whose abort says something else than :data:`BROKE` (it closed, aborted, timed
        out) gave up: the view's origin is named, at once. Otherwise every member only saw the
        exchange break, and this rank posts that too (so the others count it alive; the view
        is aborted after, with the error) and waits up to :data:`SILENT_S` for every other
        member of the exchange but one to do the same: those that stay silent died, since
        torch.distributed does not say who, and the first of them is claimed as the origin
        (:func:`claim_origin`, before anyone hears of it from this rank). Best effort: a member
        slower than that is named too.
        """
        view, me = self.view, self._ranks[self.view.local_index]
        members = [r for r in ranks if r != me]
        posted: dict[int, str] = {}
        deadline, told = time.monotonic() + SILENT_S, False
        while True:
            try:
                posted = posted_aborts(view, members)
                first = {r: why for r, why in posted.items() if BROKE not in why}
                if first:
                    return self._aborted(call, first)
                if not told:  # tell the others this rank lives
                    default_store().set(
                        _key(view, me), f"{call}: {BROKE} ({detail or 'told by ' + ranks_text(sorted(posted))})"
                    )
                    told = True
            except Exception as e:  # noqa: BLE001 - the store may have gone with the dead rank
                return self._store_lost(call, ranks, _gist(e))  # who is silent cannot be told now
            if len(posted) >= len(members) - 1 or time.monotonic() > deadline:
                break
            time.sleep(STORE_POLL_S)
        silent = [r for r in members if r not in posted]
        if not silent:
            return self._aborted(call, posted)
        why = (
            f"{SILENT} within {SILENT_S:g} s once its connection closed: it died or left (check its log; "
            f"{detail or 'as its peers told'})"
        )
        try:
            first_one = claim_origin(view, silent[0], why)
        except Exception as e:  # noqa: BLE001 - the store may have gone with the dead rank
            return self._store_lost(call, ranks, _gist(e))
        return origin_error(view, me, call, first_one)

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
        """The error of an exchange that ``aborted`` (members, by the aborts they posted) gave up on:
        naming the view's origin where the store holds one, else those members."""
        first = origin(self.view)
        if first is not None:
            return origin_error(self.view, self._ranks[self.view.local_index], call, first)
        said = "; ".join(f"rank {r}: {why}" for r, why in sorted(aborted.items()))
        return self._peer_aborted(call, f"{ranks_text(sorted(aborted))} aborted the view ({said})", aborted)

    def _peer_aborted(self, call: str, what: str, aborted: dict[int, str]) -> PeerAborted:
        """An exchange's :class:`~symmsync.PeerAborted`: ``what`` happened, naming ``aborted``."""
        return failure.peer_aborted(self.view, self._ranks[self.view.local_index], call, what, aborted)

    def _timeout(self, call: str, ranks: list[int], budget: float) -> FenceTimeout:
        me = self._ranks[self.view.local_index]
        gone = [r for r in ranks if r != me]
        return FenceTimeout(
            f"rank {me}: {call} on view {list(self.view.ranks)}: the exchange with {ranks_text(gone)} did not "
            f"finish within its budget of {budget:g} s (a member hung, or never called it); it fails "
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
