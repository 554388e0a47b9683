"""A buffer over memory the runtime owns: adopted (already mapped by the runtime on every rank)
or registered (the runtime's own allocation on each rank, which symmsync maps on every peer).

What :meth:`SymmetricBuffer.from_peer_addresses <symmsync.SymmetricBuffer.from_peer_addresses>`,
``from_torch`` and ``register`` run (their docstrings are the contract): the same collective
steps as an allocation (this rank's problem, one agreement, then the mapping as one
transaction of :mod:`symmsync.core.memory`), over the runtime's bytes. docs/runtime-memory.md
says which memory can be registered and how each kind is shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import backends
from ..errors import ConfigError
from . import memory, nodes


def adopt(
    cls: type,
    ptrs: Sequence[int],
    nbytes: int,
    group: Any,
    device: torch.device | str | None,
    cells: str,
    max_views: int,
    channels: int,
    backend_options: dict[str, Any] | None,
    call: str,
) -> Any:
    """A buffer of class ``cls`` over memory the runtime mapped already (collective): ``ptrs[r]``
    rank ``r``'s address, usable on this rank; the cells in an allocation of symmsync's own."""
    backends.refuse_compiling(call)
    self = cls.__new__(cls)
    self._join(group)
    problem = memory.args_problem(nbytes, max_views, channels, None, backend_options)
    try:
        dev = backends.as_device(device) if device is not None else backends.default_device()
    except ConfigError as e:
        dev, problem = torch.device("cpu"), problem or str(e)
    if problem is None:
        ptrs, problem = memory.Adopted.local_problem(ptrs, cells, self._world)
    sizes = {"nbytes": nbytes, "max_views": max_views, "channels": channels}
    self._agree(call, dev, problem, {"backend": dev.type, "cells": cells, **sizes}, new=True)
    nodes.refuse_spanning(self._nodes, call, "a runtime's addresses of other nodes' ranks cannot be mapped here")
    self._device = dev
    self._nbytes = nbytes
    self._finish(memory.Adopted.build(self._group, dev, ptrs, nbytes, max_views, channels, backend_options or {}))
    return self


def register(
    cls: type,
    local: torch.Tensor | int,
    nbytes: int | None,
    group: Any,
    max_nbytes: int | None,
    device: torch.device | str | None,
    max_views: int,
    channels: int,
    backend_options: dict[str, Any] | None,
) -> Any:
    """A buffer of class ``cls`` over this rank's ``local`` memory, every peer's mapped here (collective)."""
    backends.refuse_compiling("SymmetricBuffer.register")
    self = cls.__new__(cls)
    self._join(group)
    ptr, dev, problem = memory.Registered.local_problem(local, nbytes, device, memory.ALIGN)
    if nbytes is None and isinstance(local, torch.Tensor):
        nbytes = local.numel() * local.element_size()
    max_nbytes = nbytes if max_nbytes is None else max_nbytes
    problem = problem or memory.args_problem(nbytes, max_views, channels, max_nbytes, backend_options)
    kind = dev.type if dev is not None else "?"
    sizes = {"nbytes": nbytes, "max_nbytes": max_nbytes, "max_views": max_views, "channels": channels}
    self._agree("SymmetricBuffer.register", dev, problem, {"backend": kind, **sizes}, new=True)
    self._device = dev
    self._nbytes = nbytes
    name = backends.name_for(dev)
    be = memory.create_backend(self._group, name, dev, backend_options or {})
    cells = memory.create_backend(self._group, name, dev, dict(backend_options or {}))
    mem = memory.Registered.build(self._group, be, cells, self._near, ptr, nbytes, max_nbytes, max_views, channels)
    self._finish(mem)
    return self
