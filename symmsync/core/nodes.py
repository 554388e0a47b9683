"""Nodes: the sets of ranks that can map each other's memory, and how a group splits into them.

A *node* is a set of ranks whose memory every member can map: processes of one host on
the host backend; on CUDA, processes of one host whose GPUs can peer-map each other (a
multi-node NVLink domain with fabric handles would be one node; symmsync does not detect
one yet). A :class:`~symmsync.SymmetricBuffer` over ranks of several nodes maps only the
peers of its own node; what crosses nodes goes through torch.distributed
(:class:`symmsync.spanning.exchange.OffNode`).

The partition is agreed when a buffer is made: every rank contributes its :class:`NodeKey`
in the buffer's one exchange of arguments, and every rank derives the same
:class:`NodeLayout` from the same keys (:func:`partition`), or raises the same
:class:`~symmsync.ConfigError`. So detection costs no exchange of its own.

Simulated nodes: with ``SYMMSYNC_NODE_SIZE=k`` (:data:`NODE_SIZE_ENV`) in every rank's
environment, the job is split into nodes of ``k`` consecutive global (world) ranks: world
rank ``w`` is on node ``w // k``, whatever host it runs on. This lets one machine (a laptop
on the host backend, or one GPU host) run a job as several nodes, e.g. 2 nodes x 2 ranks::

    SYMMSYNC_NODE_SIZE=2 torchrun --nproc-per-node 4 job.py

Every rank must see the same value, and the world size must be a multiple of it; else
every rank raises one :class:`~symmsync.ConfigError`.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..checks import is_int
from ..errors import ConfigError, ViewError
from .agreement import Same

#: The setting that splits a job into simulated nodes of this many consecutive world ranks.
NODE_SIZE_ENV = "SYMMSYNC_NODE_SIZE"

#: How a buffer's exchange compares the node setting (:func:`fields`): alike on every rank.
AGREED = {"node_size": Same(hint=f"set {NODE_SIZE_ENV} alike on every rank (or on none)")}


@dataclass(frozen=True)
class NodeKey:
    """What one rank contributes to the partition: ranks with equal ``host`` are one node,
    provided they can map each other: no member's ``device`` is among another's ``seen``
    GPUs but outside its ``reach``.

    Attributes:
        host: the node's name: the hostname, or ``"simulated node i"`` under :data:`NODE_SIZE_ENV`.
        device: this rank's GPU (its UUID) on CUDA; ``""`` where any member maps any other.
        seen: the GPUs (UUIDs) this process sees. A GPU it does not see (``CUDA_VISIBLE_DEVICES``
            of one GPU per process) cannot be asked about, and counts as mappable, as on one node.
        reach: the GPUs among ``seen`` that this rank's GPU can map, its own included.
    """

    host: str
    device: str = ""
    seen: tuple[str, ...] = ()
    reach: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeLayout:
    """How a group of ranks splits into nodes.

    Indices are those of the group the layout is about: a buffer's group ranks for
    :attr:`SymmetricBuffer.nodes <symmsync.SymmetricBuffer.nodes>`, view indices
    ``0..size-1`` for :attr:`PeerView.nodes <symmsync.PeerView.nodes>`.

    Attributes:
        nodes: the members of each node, each in ascending index order; the nodes ordered
            by their first member.

    Example::

        >>> layout = NodeLayout(((0, 1), (2, 3)))
        >>> str(layout), layout.node_of(2), layout.peers_at(1)
        ('2 nodes: [0, 1] [2, 3]', 1, (1, 3))
    """

    nodes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        flat = [i for node in self.nodes for i in node]
        ok = (
            all(node and list(node) == sorted(node) for node in self.nodes)
            and sorted(flat) == list(range(len(flat)))
            and [node[0] for node in self.nodes] == sorted(node[0] for node in self.nodes)
        )
        if not ok:
            raise ConfigError(
                f"NodeLayout: nodes {self.nodes} must hold each index 0..n-1 once, each node ascending, "
                "the nodes ordered by their first member"
            )
        object.__setattr__(self, "_node_of", {i: n for n, node in enumerate(self.nodes) for i in node})

    @classmethod
    def one(cls, size: int) -> NodeLayout:
        """The layout of ``size`` members on one node."""
        return cls((tuple(range(size)),))

    @property
    def size(self) -> int:
        """Number of members, on every node together."""
        return len(self._node_of)

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return len(self.nodes)

    @property
    def single(self) -> bool:
        """True when every member is on one node."""
        return len(self.nodes) == 1

    @property
    def uniform(self) -> bool:
        """True when every node has the same number of members."""
        return len({len(node) for node in self.nodes}) == 1

    def _check(self, i: int) -> int:
        if not is_int(i) or i not in self._node_of:
            raise ConfigError(f"NodeLayout: index {i!r} is not a member of {self}")
        return i

    def node_of(self, i: int) -> int:
        """The node (its index in :attr:`nodes`) of member ``i``."""
        return self._node_of[self._check(i)]

    def same_node(self, i: int, j: int) -> bool:
        """True when members ``i`` and ``j`` are on one node (can map each other)."""
        return self.node_of(i) == self.node_of(j)

    def members_of(self, i: int) -> tuple[int, ...]:
        """The members of ``i``'s node, ``i`` included, ascending."""
        return self.nodes[self.node_of(i)]

    def position(self, i: int) -> int:
        """``i``'s index within its node."""
        return self.members_of(i).index(i)

    def peers_at(self, position: int) -> tuple[int, ...]:
        """The member at ``position`` of each node, in node order (needs :attr:`uniform`)."""
        if not self.uniform:
            raise ConfigError(f"NodeLayout.peers_at: the nodes of {self} differ in size; positions need uniform nodes")
        if not is_int(position) or not 0 <= position < len(self.nodes[0]):
            raise ConfigError(f"NodeLayout.peers_at: position {position!r} is outside [0, {len(self.nodes[0])})")
        return tuple(node[position] for node in self.nodes)

    def restrict(self, indices: Sequence[int]) -> NodeLayout:
        """The layout of the subgroup ``indices`` (of this layout's group), in the subgroup's
        own indices ``0..len(indices)-1``: how a view's layout comes from its buffer's."""
        indices = [self._check(i) for i in indices]
        if len(set(indices)) != len(indices):
            raise ConfigError(f"NodeLayout.restrict: indices {indices} repeat")
        by_node: dict[int, list[int]] = {}
        for new, old in enumerate(indices):
            by_node.setdefault(self._node_of[old], []).append(new)
        return NodeLayout(tuple(sorted(tuple(members) for members in by_node.values())))

    def __str__(self) -> str:
        body = " ".join(str(list(node)) for node in self.nodes)
        return f"{len(self.nodes)} node{'s' if len(self.nodes) != 1 else ''}: {body}"


def node_size_setting() -> tuple[int | None, str | None]:
    """``(k, problem)``: the simulated node size :data:`NODE_SIZE_ENV` asks for (``None``:
    unset), and what is wrong with it for this job (``None``: nothing)."""
    raw = os.environ.get(NODE_SIZE_ENV, "").strip()
    if not raw:
        return None, None
    try:
        k = int(raw)
    except ValueError:
        return None, f"{NODE_SIZE_ENV}={raw!r} must be a positive int (ranks per simulated node)"
    world = dist.get_world_size()
    if k <= 0 or world % k:
        return None, f"{NODE_SIZE_ENV}={raw!r} must be a positive divisor of the world size {world}"
    return k, None


def local_key(device: torch.device | None) -> tuple[NodeKey, str | None]:
    """``(key, problem)``: this rank's :class:`NodeKey` for memory on ``device``, and what
    keeps it from being found (a bad :data:`NODE_SIZE_ENV`)."""
    k, problem = node_size_setting()
    if problem is not None:
        return NodeKey(""), problem
    if k is not None:
        return NodeKey(f"simulated node {dist.get_rank() // k}"), None
    host = socket.gethostname()
    if device is None or device.type != "cuda":
        return NodeKey(host), None
    try:
        return _cuda_key(host, device), None
    except Exception as e:  # noqa: BLE001 - reported to every rank, never raised before the exchange
        return NodeKey(host), f"could not tell which GPUs {device} can map: {e}"


def _cuda_key(host: str, device: torch.device) -> NodeKey:
    """This rank's GPU and the GPUs it can peer-map (by UUID, so that processes that see
    different devices under different indices still compare alike)."""

    def uuid(i: int) -> str:
        return str(torch.cuda.get_device_properties(i).uuid)

    me = device.index if device.index is not None else torch.cuda.current_device()
    seen = range(torch.cuda.device_count())
    reach = [uuid(i) for i in seen if i == me or torch.cuda.can_device_access_peer(me, i)]
    return NodeKey(host, uuid(me), tuple(sorted(uuid(i) for i in seen)), tuple(sorted(reach)))


def partition(keys: Sequence[NodeKey], call: str) -> NodeLayout:
    """The layout every rank derives from every rank's key (group rank order); the same on
    every rank, since every rank derives it from the same keys.

    Raises:
        ConfigError: two ranks of one host whose GPUs cannot map each other (their node is
            not one); every rank raises it, since every rank sees the same keys.
    """
    hosts: dict[str, list[int]] = {}
    for r, key in enumerate(keys):
        hosts.setdefault(key.host, []).append(r)
    for members in hosts.values():
        for i in members:
            for j in members:
                if keys[j].device in keys[i].seen and keys[j].device not in keys[i].reach:
                    raise ConfigError(
                        f"{call}: ranks {i} and {j} run on one host ({keys[i].host}) but rank {i}'s GPU "
                        f"{keys[i].device} cannot map rank {j}'s GPU {keys[j].device}, so they are not one node; "
                        f"enable peer access between the host's GPUs, or set {NODE_SIZE_ENV} on every rank to "
                        "split the job into nodes of ranks that can map each other"
                    )
    return NodeLayout(tuple(tuple(members) for members in hosts.values()))


# ---------------------------------------------------------------------- a buffer's layout
def with_fields(args: dict[str, Any], problem: str | None, device: Any) -> tuple[dict[str, Any], str | None]:
    """``(args, problem)`` for a buffer's one exchange of arguments, with what this rank adds:
    its node setting (compared by :data:`AGREED`), its :class:`NodeKey`, a token that names
    the buffer in the store; the problem, if none yet, of its node setting. :func:`layout`
    reads them back."""
    key = NodeKey("")
    if problem is None:  # a refused call sends no values: nothing to find (the device may be junk)
        key, problem = local_key(device)
    setting = os.environ.get(NODE_SIZE_ENV, "").strip()
    return {**args, "node_size": setting, "node": key, "token": secrets.token_hex(8)}, problem


def layout(agreed: Sequence[dict[str, Any]], call: str, rank: int) -> tuple[NodeLayout, str, tuple[int, ...]]:
    """``(layout, name, near)`` from every rank's :func:`with_fields`: the agreed
    :class:`NodeLayout` (or the :func:`partition` error, on every rank), the buffer's name,
    the same on every rank (rank 0's token), and the ranks ``rank`` maps (its node's)."""
    nodes = partition([a["node"] for a in agreed], call)
    return nodes, agreed[0]["token"], nodes.members_of(rank)


def refuse_spanning(nodes: NodeLayout, call: str, why: str) -> None:
    """Raise :class:`~symmsync.ConfigError` (on every rank alike: the layout is agreed) where
    ``nodes`` spans several nodes."""
    if not nodes.single:
        raise ConfigError(f"{call}: the group spans {nodes}; {why}: make one per node (a group of one node's ranks)")


def refuse_table(nodes: NodeLayout, what: str, owner: str, whose: str = "the buffer's group") -> None:
    """Raise :class:`~symmsync.ViewError` where a kernel table (``ptrs``, ``cell_ptrs``) of a
    group that spans several nodes is asked for: its off-node entries are 0, never for a kernel."""
    if not nodes.single:
        raise ViewError(
            f"{owner}.{what}: {whose} spans {nodes}, and a kernel cannot address another node's memory: "
            "kernels take views within one node (buf.view(<your node's ranks>)); the collectives and the "
            "writer handle spanning views"
        )


def spanning_problem(nodes: NodeLayout, what: str) -> str | None:
    """Why ``what`` (``"a Fence"``, ``"Signals"``) cannot be made on a view of layout
    ``nodes``, or ``None`` for a view within one node."""
    if nodes.single:
        return None
    return (
        f"the view spans {nodes}; {what} waits on every member's cells, which only the ranks of one node "
        "map: make it on a view within one node (buf.view(<your node's ranks>)); the collectives and the "
        "writer handle spanning views"
    )


def refuse_peer(nodes: NodeLayout, me: int, rank: int, call: str) -> None:
    """Raise :class:`~symmsync.ViewError` where rank ``me`` asks for the memory of ``rank``
    on another node, which it does not map."""
    if not nodes.same_node(me, rank):
        raise ViewError(
            f"rank {me}: {call}: rank {rank} is on node {nodes.node_of(rank)} and rank {me} on node "
            f"{nodes.node_of(me)} ({nodes}); only the peers of one node are mapped: move the data with "
            "symmsync.spanning.exchange.OffNode (or the collectives), or address a rank of your own node"
        )
