"""Compiled or interpreted: decided once per process, in this module only.

Triton decides when a ``@triton.jit`` function is defined whether it runs compiled
(on a GPU) or under Triton's interpreter (on the CPU, as the host backend needs), and
:mod:`symmsync.language` picks its device primitives at the same moment. This module
makes that decision once (:func:`kernels_interpreted`) and is the only place that
reads Triton's setting; everything else asks it. Where kernels are interpreted, it also
makes every launch raise an error of symmsync's raised inside a kernel as itself, not
wrapped in Triton's ``InterpreterError`` (:func:`_raise_own_errors_from_kernels`).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch

#: Set by :func:`enable_interpreter_without_gpu` when ``import symmsync`` turned Triton's
#: interpreter on itself.
INTERPRETER_AUTO = False


def enable_interpreter_without_gpu() -> bool:
    """Turn on Triton's interpreter for this process where no GPU can run kernels.

    Called once by ``import symmsync``, before any symmsync kernel is defined (Triton
    decides compiled or interpreted when a ``@triton.jit`` function is defined, and
    symmsync picks its primitives then too). It sets ``TRITON_INTERPRET=1`` in this
    process's environment (inherited by its children) only when all of these hold:
    ``TRITON_INTERPRET`` is not set at all (an explicit value, ``0`` included, always
    wins), Triton's ``knobs.runtime.interpret`` was not set in code, and torch sees no
    CUDA device. On such a machine no kernel could run compiled, so nothing that
    worked before changes.

    Returns:
        True when it turned the interpreter on.
    """
    global INTERPRETER_AUTO
    if "TRITON_INTERPRET" in os.environ:
        return False
    triton = sys.modules.get("triton")
    knobs = getattr(triton, "knobs", None) if triton is not None else None
    if knobs is not None and "interpret" in vars(knobs.runtime):
        return False  # set in code: the user's choice
    try:
        if torch.cuda.is_available():
            return False
    except Exception:  # noqa: BLE001 - a broken driver counts as no GPU
        pass
    os.environ["TRITON_INTERPRET"] = "1"
    INTERPRETER_AUTO = True
    if triton is not None:
        _interpret_predefined_kernels()
    return True


def _interpret_predefined_kernels() -> None:
    """Run the ``@triton.jit`` functions defined before the interpreter was turned on
    (Triton's own ``tl.sum``, ``tl.max``, ..., and any kernel defined before ``import
    symmsync``) through the interpreter too.

    Triton decides at definition: a function defined while the interpreter was off is
    a ``JITFunction``, which only runs compiled, and a call to one from an interpreted
    kernel raises. This is only done where no GPU is visible, where a compiled launch
    could not run anyway: each such function is wrapped, once, in Triton's own
    ``InterpretedFunction``, for device calls and for launches.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if getattr(JITFunction, "_symmsync_interpreted", False):
        return

    def interpreted(fn: Any) -> Any:
        wrapped = fn.__dict__.get("_symmsync_interpreted_fn")
        if wrapped is None:
            wrapped = fn.__dict__["_symmsync_interpreted_fn"] = InterpretedFunction(fn.fn)
        return wrapped

    def member(fn: Any, instance: Any, owner: Any = None) -> Any:
        # Triton's tensor methods (x.sum()) are these functions set on its tensor class.
        return functools.partial(interpreted(fn), instance) if isinstance(instance, tensor) else fn

    from triton.language.core import tensor

    JITFunction.__call__ = lambda self, *args, **kwargs: interpreted(self)(*args, **kwargs)
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: interpreted(self).run(
        *args, grid=grid, warmup=warmup, **kwargs
    )
    JITFunction.__get__ = member
    JITFunction._symmsync_interpreted = True


_decided: bool | None = None


def kernels_interpreted() -> bool:
    """True when symmsync's kernels in this process run under Triton's interpreter.

    Decided at the first call (``import symmsync`` makes it, when it defines its
    kernels) and fixed from then on: kernels already defined cannot change.
    """
    global _decided
    if _decided is None:
        _decided = interpreter_active()
        if _decided:
            _raise_own_errors_from_kernels()
    return _decided


def _raise_own_errors_from_kernels() -> None:
    """Make a symmsync error raised inside an interpreted kernel reach the launch's caller as itself.

    Triton's interpreter wraps whatever a kernel raises in an ``InterpreterError``, once at
    the launch and once more at every nested ``@triton.jit`` call, so a
    :class:`~symmsync.DebugCheckError` raised by a device primitive would arrive three
    wrappers deep, missed by ``except ss.DebugCheckError``. Every launch under the
    interpreter (symmsync's and the user's own ``kernel[grid](...)``: they share Triton's
    ``GridExecutor``) is wrapped, once per process: when the innermost error of the chain
    is a :class:`~symmsync.SymmSyncError`, that error is raised, with Triton's outermost
    ``InterpreterError`` as its ``__cause__`` (whose own chain keeps the kernel's frames and
    ends at the innermost wrapper, so the chain has no cycle). Any other error is raised
    exactly as Triton raised it. Checked against the interpreters of triton 3.6 and 3.9.
    """
    from triton.runtime import interpreter
    from triton.runtime.errors import InterpreterError

    from ..errors import SymmSyncError

    executor = interpreter.GridExecutor
    if getattr(executor, "_symmsync_own_errors", False):
        return
    launch = executor.__call__

    @functools.wraps(launch)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return launch(self, *args, **kwargs)
        except InterpreterError as outer:
            inner = outer
            while isinstance(inner.__cause__, InterpreterError):
                inner = inner.__cause__
            own = inner.__cause__
            if not isinstance(own, SymmSyncError):
                raise
            inner.__cause__ = inner.__context__ = None  # own.__cause__ is outer: no cycle
            raise own from outer

    executor.__call__ = call
    executor._symmsync_own_errors = True


def interpreter_active() -> bool:
    """True when Triton kernels defined now run under Triton's interpreter."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # pragma: no cover - older triton
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
