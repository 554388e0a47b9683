"""Integer handles that name symmsync objects to the torch custom ops.

A compiled graph carries tensors, ints, floats and strings, never a Python object, so
an object a model calls inside its forward (a collective, the direct-KV writer, a
fence) is named to its op by an int it registered at construction, as a runtime names
a process group by a string. The handle is this process's: the same object has its own
handle on every rank (objects made in the same order get the same numbers, which
nothing relies on). The table holds objects weakly: a handle never keeps its object
alive, and looking one up after the object is gone raises.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from ..errors import ClosedError, ConfigError

_lock = threading.Lock()
_issued = 0  # the last handle given out
_objects: dict[int, tuple[weakref.ReferenceType, str]] = {}  # handle -> (its object, held weakly; its kind)


def register(obj: Any, kind: str) -> int:
    """A new handle for ``obj``, an object of ``kind`` (the name an op asks for: ``"AllReduce"``);
    held weakly: the entry goes when ``obj`` does."""
    global _issued
    with _lock:
        _issued += 1
        handle = _issued
        _objects[handle] = (weakref.ref(obj, lambda _ref, h=handle: _objects.pop(h, None)), kind)
    return handle


def lookup(handle: int, kind: str) -> Any:
    """The object ``handle`` names, checked to be of ``kind``.

    The kind is a name, not a class, so that an op's module needs no import of the class
    whose objects it calls (the op is below the object in the layers).

    Raises:
        ClosedError: the object was garbage-collected (a graph outlived it).
        ConfigError: ``handle`` names nothing this process registered, or an object of
            another kind.
    """
    entry = _objects.get(handle)
    obj = entry[0]() if entry is not None else None
    if obj is None:
        if isinstance(handle, int) and 0 < handle <= _issued:
            raise ClosedError(
                f"symmsync handle {handle} named a {kind} that no longer exists: "
                "keep the object alive as long as a compiled graph that calls it"
            )
        raise ConfigError(f"{handle!r} is not a symmsync handle of this process")
    if entry[1] != kind:
        raise ConfigError(f"symmsync handle {handle} names a {entry[1]} object, not a {kind}")
    return obj
