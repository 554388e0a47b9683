"""SymmetricBuffer: one collective allocation with direct access to every peer's copy.

Every rank of a torch.distributed group allocates the same number of bytes; the
handles are exchanged through the group and every rank maps every peer, so a
kernel on any rank can load from and store to any rank's memory through a table
of base addresses (:attr:`SymmetricBuffer.ptrs`).

Each rank's allocation is laid out as::

    [0, nbytes)                  the user region: what tensor() and kernels address
    [signal_base, + signal_size) signal cells of the peer views' fences (see group.py)

so user offsets are the same on every rank and never touch a fence's slots.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import backends
from .errors import CLOSED_REASON, BackendError, BoundsError, ClosedError, ConfigError, SizeMismatchError

ALIGN = 16  #: every tensor view starts on a multiple of this many bytes
_LINE = 128  #: signal cells are padded to cache lines so peers' writes never share one


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class SignalLayout:
    """Where the signal cells of each (view region, channel) live in every rank's allocation.

    A cell starts with a 128-byte line holding this rank's int64 epoch counter and
    the grid-arrival counter of the channel, followed by one int64 slot per rank of
    the world (padded to a whole line), where peers store the epochs they publish.
    :mod:`symmsync.language` documents the same layout from the kernel side.
    """

    def __init__(self, base: int, world_size: int, max_views: int, channels: int):
        self.base = base
        self.max_views = max_views
        self.channels = channels
        self.cell_bytes = _LINE + _round_up(world_size * 8, _LINE)
        self.size = max_views * channels * self.cell_bytes

    def cell(self, region: int, channel: int) -> int:
        """Byte offset of the cell, from the start of each rank's allocation."""
        return self.base + (region * self.channels + channel) * self.cell_bytes


def _gather(group: Any, obj: Any, world_size: int) -> list[Any]:
    out: list[Any] = [None] * world_size
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as e:  # gloo/NCCL: a peer died or left the collective
        raise _lost_peer(group, e) from e
    return out


def _barrier(group: Any) -> None:
    try:
        dist.barrier(group=group)
    except RuntimeError as e:
        raise _lost_peer(group, e) from e


def _lost_peer(group: Any, e: Exception) -> BackendError:
    return BackendError(
        f"rank {dist.get_rank(group)}: an exchange with the other ranks of the group failed: a rank "
        f"probably died or left the collective (check the other ranks' logs). torch.distributed: {e}"
    )


def _plain(v: Any) -> Any:
    """``v`` if every rank can receive and compare it, else its repr (any junk argument
    must reach the exchange, so that every rank raises instead of one)."""
    return v if isinstance(v, (int, str)) else repr(v)


def _ranks_text(ranks: Sequence[int]) -> str:
    return "rank " + str(ranks[0]) if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class SymmetricBuffer:
    """A collective allocation of ``nbytes`` on every rank, with every peer mapped.

    Args:
        nbytes: bytes of the user region on each rank; the same on every rank.
        group: torch.distributed process group (default: the world group). It must be
            initialized; every rank of it must construct the buffer.
        device: where the memory lives (default: the current CUDA device if there is
            one, else the CPU).
        backend: ``"auto"`` (CUDA for CUDA devices, host otherwise; with no ``device``,
            host when Triton's interpreter is active in this process, as in
            ``symmsync.testing.run(backend="host")``, else the current CUDA device if
            there is one), ``"host"`` or ``"cuda"``.
        max_views: peer views that can be created on this buffer (each owns a signal region).
        channels: fence channels per view.
        backend_options: passed to the backend (the CUDA backend takes ``handle_type``).

    Raises:
        ConfigError: a bad argument on any rank (raised on every rank).
        SizeMismatchError: ranks asked for different sizes (raised on every rank).
        BackendError: a rank could not allocate or map (raised on every rank; nothing
            stays mapped).

    Example::

        with ss.SymmetricBuffer(1 << 20) as buf:
            peer = buf.tensor(0, (256,), torch.float32, rank=(buf.rank + 1) % buf.world_size)
    """

    def __init__(
        self,
        nbytes: int,
        group: Any = None,
        device: torch.device | str | None = None,
        backend: str = "auto",
        *,
        max_views: int = 16,
        channels: int = 4,
        backend_options: dict[str, Any] | None = None,
    ):
        self._join(group)
        # One exchange of every rank's arguments, so every rank raises the same error.
        problem = None
        try:
            name, dev = backends.resolve(backend, device)
        except ConfigError as e:
            name, dev, problem = backend, None, str(e)
        if problem is None:
            problem = self._check_args(nbytes, max_views, channels)
        if problem is None and not isinstance(backend_options, (dict, type(None))):
            problem = f"backend_options must be a dict, got {backend_options!r}"
        info = {
            "nbytes": nbytes if isinstance(nbytes, int) else repr(nbytes),
            "backend": _plain(name),
            "max_views": _plain(max_views),
            "channels": _plain(channels),
            "problem": problem,
        }
        self._raise_on_bad_args(_gather(self._group, info, self._world))

        self._nbytes = nbytes
        self._device = dev
        self._signals = SignalLayout(_round_up(nbytes, _LINE), self._world, max_views, channels)
        self._backend = self._create_backend(name, dev, backend_options or {})
        self._map_all(self._signals.base + self._signals.size)
        self._finish()

    def _join(self, group: Any) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "SymmetricBuffer is a collective: call torch.distributed.init_process_group first "
                "(symmsync.testing.run does it for tests)"
            )
        self._group = group if group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self._group)
        self._world = dist.get_world_size(self._group)
        self._closed = False
        self._own: backends.Memory | None = None
        self._peers: list[backends.Memory | None] = [None] * self._world
        self._view_count = 0
        # Every live PeerView created on it: close() aborts them. Weak, so that a buffer
        # and its views form no reference cycle (which kept process groups alive at exit).
        self._views: weakref.WeakSet = weakref.WeakSet()

    def _finish(self) -> None:
        self._ptrs = torch.tensor([m.ptr for m in self._peers], dtype=torch.int64, device=self._device)
        self._finalizer = weakref.finalize(self, SymmetricBuffer._release_all, self._backend, self._own, self._peers)

    # ---------------------------------------------------------------- adoption
    @classmethod
    def from_peer_addresses(
        cls,
        ptrs: Sequence[int],
        nbytes: int,
        group: Any = None,
        device: torch.device | str | None = None,
        *,
        max_views: int = 16,
        channels: int = 4,
    ) -> SymmetricBuffer:
        """Adopt symmetric memory a runtime already allocated and mapped (collective).

        Args:
            ptrs: ``ptrs[r]`` is the address, usable on this rank's device, of rank
                ``r``'s memory (``r`` in the group's order).
            nbytes: size of each rank's memory (the same on every rank).
            group: the process group of those ranks (default: the world group).
            device: where the memory is (default: the current CUDA device, else CPU).

        symmsync keeps its fence signal cells in the last bytes of that memory (zeroed
        here, on every rank); :attr:`nbytes` is what is left before them. The runtime
        keeps ownership: :meth:`close` releases nothing.
        """
        self = cls.__new__(cls)
        self._join(group)
        problem = cls._check_args(nbytes, max_views, channels)
        try:
            dev = backends.as_device(device) if device is not None else backends.default_device()
        except ConfigError as e:
            dev, problem = torch.device("cpu"), problem or str(e)
        probe = SignalLayout(0, self._world, max_views, channels) if problem is None else None
        if problem is None:
            try:
                ptrs = [operator.index(p) for p in ptrs]
            except TypeError:
                problem = "ptrs must be a sequence of int addresses"
        if problem is None and any(not 0 < p < 2**64 for p in ptrs):
            problem = f"ptrs holds {[p for p in ptrs if not 0 < p < 2**64]}, which are not addresses"
        if problem is None and len(ptrs) != self._world:
            problem = f"ptrs holds {len(ptrs)} addresses for a group of {self._world} ranks"
        if problem is None and nbytes < probe.size + _LINE:
            problem = f"{nbytes} bytes cannot hold symmsync's {probe.size} bytes of signal cells; adopt a larger region"
        info = {
            "nbytes": nbytes if isinstance(nbytes, int) else repr(nbytes),
            "backend": dev.type,
            "max_views": _plain(max_views),
            "channels": _plain(channels),
            "problem": problem,
        }
        self._raise_on_bad_args(_gather(self._group, info, self._world))
        base = (nbytes - probe.size) // _LINE * _LINE
        self._nbytes = base
        self._device = dev
        self._signals = SignalLayout(base, self._world, max_views, channels)
        self._backend = backends.adopted(dev)
        for r, p in enumerate(ptrs):
            self._peers[r] = self._backend.import_handle((p, nbytes), r)
        self._own = self._peers[self._rank]
        self._own.tensor[base : base + self._signals.size].zero_()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        _barrier(self._group)  # no rank fences before every rank's cells are zero
        self._finish()
        return self

    @classmethod
    def from_torch(cls, handle: Any, group: Any = None, **kwargs: Any) -> SymmetricBuffer:
        """Adopt a ``torch.distributed._symmetric_memory`` rendezvous handle (collective).

        Uses the handle's buffer (``buffer_ptrs``, ``buffer_size``); torch's own signal
        pads stay torch's. See :meth:`from_peer_addresses` for what symmsync reserves.
        """
        device = torch.device("cuda", torch.cuda.current_device())
        return cls.from_peer_addresses(list(handle.buffer_ptrs), int(handle.buffer_size), group, device, **kwargs)

    # ---------------------------------------------------------------- construction
    @staticmethod
    def _check_args(nbytes: Any, max_views: Any, channels: Any) -> str | None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            return f"nbytes must be an int, got {type(nbytes).__name__}"
        if nbytes <= 0:
            return f"nbytes must be positive, got {nbytes}"
        for label, v in (("max_views", max_views), ("channels", channels)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                return f"{label} must be a positive int, got {v!r}"
        return None

    def _raise_on_bad_args(self, infos: list[dict]) -> None:
        bad = [(r, i["problem"]) for r, i in enumerate(infos) if i["problem"]]
        if bad:
            r, msg = bad[0]
            others = f" (and {_ranks_text([b[0] for b in bad[1:]])})" if len(bad) > 1 else ""
            raise ConfigError(f"SymmetricBuffer: rank {r}{others}: {msg}")
        for key in ("backend", "max_views", "channels"):
            vals = {i[key] for i in infos}
            if len(vals) > 1:
                per = ", ".join(f"rank {r}: {i[key]!r}" for r, i in enumerate(infos))
                raise ConfigError(f"SymmetricBuffer: {key} differs across ranks ({per}); pass the same on every rank")
        sizes = [i["nbytes"] for i in infos]
        if len(set(sizes)) > 1:
            per = ", ".join(f"rank {r}: {s}" for r, s in enumerate(sizes))
            raise SizeMismatchError(
                f"SymmetricBuffer: every rank must allocate the same size, got {per}; "
                "compute nbytes from values that agree across ranks"
            )

    def _create_backend(self, name: str, dev: torch.device, options: dict[str, Any]) -> backends.Backend:
        problem = None
        be = None
        try:
            be = backends.create(name, dev, **options)
        except (BackendError, ConfigError) as e:
            problem = str(e)
        except TypeError as e:  # an option the backend does not take
            problem = f"bad backend_options {options!r}: {e}"
        problems = _gather(self._group, problem, self._world)
        bad = [r for r, p in enumerate(problems) if p]
        if bad:
            raise BackendError(
                f"SymmetricBuffer: backend {name!r} unavailable on {_ranks_text(bad)}: {problems[bad[0]]}"
            )
        assert be is not None
        return be

    def _map_all(self, total: int) -> None:
        """Allocate, exchange handles, map every peer: all or nothing on every rank."""
        handle = problem = None
        try:
            self._own = self._backend.allocate(total, self._rank)
            handle = self._backend.export_handle(self._own)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            problem = f"{type(e).__name__}: {e}"
        handles: list = []
        try:
            handles = _gather(self._group, (handle, problem), self._world)
            self._fail_if_any("allocate", [p for _, p in handles])
            self._backend.exchanged(self._own, [h for h, _ in handles])  # who may map this rank's memory

            problem = None
            try:
                for r, (h, _) in enumerate(handles):
                    self._peers[r] = self._own if r == self._rank else self._backend.import_handle(h, r)
            except Exception as e:  # noqa: BLE001
                problem = f"{type(e).__name__}: {e}"
            self._fail_if_any("map", _gather(self._group, problem, self._world))
            # Every rank has mapped every segment: names and exported handles can go, and
            # once the barrier passes they are gone on every rank (a crash leaks nothing).
            self._backend.all_mapped(self._own)
            _barrier(self._group)
        except BackendError:
            # A peer died during the exchange (or a rank failed, and _fail_if_any released
            # already): release, and drop the handles a dead peer can no longer drop itself.
            SymmetricBuffer._release_all(self._backend, self._own, self._peers)
            self._own = None
            self._peers = [None] * self._world
            self._closed = True
            for h, _ in handles:
                if h is not None:
                    self._backend.abandon(h)
            raise

    def _fail_if_any(self, what: str, problems: list[str | None]) -> None:
        bad = [r for r, p in enumerate(problems) if p]
        if not bad:
            return
        SymmetricBuffer._release_all(self._backend, self._own, self._peers)
        self._own = None
        self._peers = [None] * self._world
        self._closed = True
        raise BackendError(
            f"SymmetricBuffer: could not {what} on {_ranks_text(bad)}: {problems[bad[0]]}; "
            "every rank released what it had mapped"
        )

    @staticmethod
    def _release_all(backend: backends.Backend, own: backends.Memory | None, peers: list) -> None:
        for i, m in enumerate(peers):
            if m is not None and m is not own:
                peers[i] = None
                backend.release(m)
        if own is not None and own.tensor is not None:
            backend.release(own)

    # ---------------------------------------------------------------- properties
    @property
    def rank(self) -> int:
        """This process's rank in the buffer's group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the buffer's group."""
        return self._world

    @property
    def nbytes(self) -> int:
        """Bytes of the user region on each rank."""
        return self._nbytes

    @property
    def device(self) -> torch.device:
        """Device holding this rank's memory (and the pointer tables)."""
        return self._device

    @property
    def backend(self) -> str:
        """Name of the memory backend in use: ``"host"`` or ``"cuda"``."""
        return self._backend.name

    @property
    def group(self) -> Any:
        """The torch.distributed group the buffer was allocated over."""
        return self._group

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or a failed construction released everything)."""
        return self._closed

    @property
    def ptrs(self) -> torch.Tensor:
        """int64 tensor ``[world_size]`` of every rank's base address, on :attr:`device`."""
        self._check_open("ptrs")
        return self._ptrs

    @property
    def signals(self) -> SignalLayout:
        """Where fences' signal cells live (used by :mod:`symmsync.group`)."""
        return self._signals

    # ---------------------------------------------------------------- access
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"rank {self._rank}: SymmetricBuffer.{what} used after close()")

    def local_memory(self) -> torch.Tensor:
        """``uint8`` tensor over this rank's whole allocation, signal cells included."""
        self._check_open("local_memory")
        return self._own.tensor

    def tensor(
        self, offset: int, shape: Sequence[int] | int, dtype: torch.dtype, rank: int | None = None
    ) -> torch.Tensor:
        """A tensor over ``rank``'s memory (default: this rank's), without a copy.

        Args:
            offset: byte offset into the user region; a multiple of 16.
            shape: shape of the view.
            dtype: element type.
            rank: whose memory to view, as a rank of the buffer's group.

        Raises:
            BoundsError: the view would leave the user region or is misaligned.
            ConfigError: ``rank`` is not a rank of the group.
            ClosedError: the buffer is closed.
        """
        self._check_open("tensor")
        rank = self._rank if rank is None else rank
        if not isinstance(rank, int) or not 0 <= rank < self._world:
            raise ConfigError(f"rank {self._rank}: tensor(rank={rank!r}) is not a rank of a world of {self._world}")
        if not isinstance(dtype, torch.dtype):
            raise BoundsError(f"rank {self._rank}: dtype must be a torch.dtype, got {dtype!r}")
        try:
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
        except TypeError:
            shape = (shape,)  # not a sequence: rejected below
        if any(not isinstance(s, int) or s < 0 for s in shape):
            raise BoundsError(f"rank {self._rank}: shape must hold non-negative ints, got {shape}")
        if not isinstance(offset, int) or offset < 0 or offset % ALIGN:
            raise BoundsError(f"rank {self._rank}: offset {offset!r} must be a non-negative multiple of {ALIGN} bytes")
        size = math.prod(shape) * dtype.itemsize
        if offset + size > self._nbytes:
            raise BoundsError(
                f"rank {self._rank}: a {tuple(shape)} {dtype} view at offset {offset} needs bytes "
                f"[{offset}, {offset + size}) but the buffer holds {self._nbytes}"
            )
        return self._peers[rank].tensor[offset : offset + size].view(dtype).view(shape)

    # ---------------------------------------------------------------- views
    def view(self, ranks: Sequence[int]):
        """This rank's :class:`~symmsync.PeerView` over ``ranks`` (which must include it).

        A collective over the buffer's group: every rank calls it, each with the rank
        list of its own subgroup, in the same order on every member. Subgroups may be
        disjoint (TP×PCP) or nested; each view gets its own signal region.
        """
        from .group import PeerView

        self._check_open("view")
        return PeerView._create(self, ranks)

    def _next_region(self) -> int:
        region = self._view_count
        self._view_count += 1
        return region

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Release this rank's memory and its peer mappings. Idempotent; needs no other rank.

        A tensor obtained from :meth:`tensor` (or :meth:`local_memory`) before closing
        stays valid on both backends: it keeps the mapping it views alive, and that
        mapping (this rank's memory, or a peer's as mapped here) is unmapped when the
        last tensor over it is gone; with none left, at once. A peer's memory kept
        this way shows what that peer last wrote, also after the peer closed. The
        buffer itself raises :class:`~symmsync.ClosedError` once closed.

        Every view of the buffer is aborted first, with the reason "closed": members
        still waiting in a fence on one of them raise :class:`~symmsync.PeerAborted`
        at once instead of waiting out their budget; a fence they already completed
        is not affected.
        """
        if self._closed:
            return
        for view in list(self._views):  # peers still fencing with this rank fail at once, told "closed"
            view._abort_quietly(CLOSED_REASON)
        self._closed = True
        self._finalizer.detach()
        SymmetricBuffer._release_all(self._backend, self._own, self._peers)
        self._own = None
        self._peers = [None] * self._world

    def __enter__(self) -> SymmetricBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._nbytes} bytes"
        return (
            f"SymmetricBuffer(rank={self._rank}/{self._world}, {state}, backend={self._backend.name}, "
            f"device={self._device})"
        )
