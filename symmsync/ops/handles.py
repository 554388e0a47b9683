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
from typing import Any, TypeVar

from ..errors import ClosedError, ConfigError

T = TypeVar("T")

_lock = threading.Lock()
_issued = 0  # the last handle given out
_objects: dict[int, weakref.ReferenceType] = {}  # handle -> its object, held weakly


def register(obj: Any) -> int:
    """A new handle for ``obj``, held weakly: the entry goes when ``obj`` does."""
    global _issued
    with _lock:
        _issued += 1
        handle = _issued
        _objects[handle] = weakref.ref(obj, lambda _ref, h=handle: _objects.pop(h, None))
    return handle


def lookup(handle: int, cls: type[T]) -> T:
    """The object ``handle`` names, checked to be a ``cls``.

    An op's module passes the class its op calls (the module lives beside that class, in the
    consumer's folder), so a handle of another kind of object is refused by type, not by name.

    Raises:
        ClosedError: the object was garbage-collected (a graph outlived it).
        ConfigError: ``handle`` names nothing this process registered, or an object of
            another class.
    """
    ref = _objects.get(handle)
    obj = ref() if ref is not None else None
    if obj is None:
        if isinstance(handle, int) and 0 < handle <= _issued:
            raise ClosedError(
                f"symmsync handle {handle} named a {cls.__name__} that no longer exists: "
                "keep the object alive as long as a compiled graph that calls it"
            )
        raise ConfigError(f"{handle!r} is not a symmsync handle of this process")
    if not isinstance(obj, cls):
        raise ConfigError(f"symmsync handle {handle} names a {type(obj).__name__} object, not a {cls.__name__}")
    return obj
