"""Argument checks: one wording for every entry point, and ``bool`` is never an int.

Each ``*_problem`` function returns a sentence describing what is wrong with a
value, or ``None``; collective entry points send that sentence through
:func:`symmsync.core.agreement.agree`, so every rank raises it. :func:`require` raises
one locally, naming the rank and the call.

Kinds of mistakes and their errors (:mod:`symmsync.errors`):

* a value of the wrong type, or outside what the argument allows: :class:`~symmsync.ConfigError`;
* an index or a byte range outside what exists (a rank, a member, a channel, a
  layer, bytes past a region, a misaligned offset): :class:`~symmsync.BoundsError`;
* a consumer kernel's tensor input (shape, dtype, device, slots): :class:`~symmsync.InputError`.

A consumer's tensor arguments are checked by one rule, :func:`tensor_problem`: any
``torch.Tensor`` (an ``nn.Parameter`` and other subclasses too) of the dtype, shape or size,
device and layout the call needs, that needs no gradient; its sentence names the one
property that differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .errors import BoundsError, ConfigError, SymmSyncError

#: Largest wait budget, in seconds (about 31 years; kernels count int64 nanoseconds).
MAX_TIMEOUT_S = 1e9


def is_int(v: Any) -> bool:
    """True for a Python int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def int_problem(
    name: str,
    v: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    multiple_of: int | None = None,
    power_of_two: bool = False,
) -> str | None:
    """What is wrong with ``v`` as the int argument ``name``, or ``None``."""
    if not is_int(v):
        return f"{name} must be an int, got {v!r}"
    if power_of_two and (v <= 0 or v & (v - 1)):
        return f"{name} must be a power of two, got {v}"
    if minimum is not None and v < minimum:
        want = "positive" if minimum == 1 else "non-negative" if minimum == 0 else f">= {minimum}"
        return f"{name} must be {want}, got {v}"
    if maximum is not None and v > maximum:
        return f"{name} must be at most {maximum}, got {v}"
    if multiple_of is not None and v % multiple_of:
        return f"{name} must be a multiple of {multiple_of}, got {v}"
    return None


def number_problem(
    name: str, v: Any, *, positive: bool = False, maximum: float | None = None, unit: str = "", why: str = ""
) -> str | None:
    """What is wrong with ``v`` as the real-number argument ``name`` (an int or a float,
    never a bool; NaN is refused), or ``None``.

    Args:
        name: the argument, as the message names it.
        v: its value.
        positive: refuse 0 too (default: refuse only negatives).
        maximum: the largest value allowed (default: none; infinity passes).
        unit: what the number counts, for the message (``"seconds"``).
        why: the reason for the bounds, for the message.
    """
    ok = is_int(v) or isinstance(v, float)
    if ok and (v > 0 if positive else v >= 0) and (maximum is None or v <= maximum):
        return None
    want = ("a positive number" if positive else "a non-negative number") + (f" of {unit}" if unit else "")
    want += (f" up to {maximum:g}" if maximum is not None else "") + (f" ({why})" if why else "")
    return f"{name} must be {want}, got {v!r}"


def timeout_problem(v: Any) -> str | None:
    """What is wrong with ``v`` as a wait budget ``timeout_s`` (a fence's, a Signals
    object's), or ``None``."""
    why = "the budget is int64 nanoseconds on the device"
    return number_problem("timeout_s", v, positive=True, maximum=MAX_TIMEOUT_S, unit="seconds", why=why)


def positive_int_problem(name: str, v: Any) -> str | None:
    """What is wrong with ``v`` as a positive int, or ``None``."""
    return int_problem(name, v, minimum=1)


def index_problem(name: str, v: Any, n: int, of: str) -> str | None:
    """What is wrong with ``v`` as an index into ``n`` things (``of`` names them), or ``None``."""
    if not is_int(v):
        return f"{name} must be an int, got {v!r}"
    if not 0 <= v < n:
        return f"{name} {v} is out of range: {of} has {n} (0..{n - 1})" if n else f"{name} {v}: {of} has none"
    return None


def byte_span(t: torch.Tensor) -> int:
    """The bytes from ``t``'s first element to the end of its last (non-negative strides): 0 for
    an empty tensor."""
    if t.numel() == 0:
        return 0
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def shares_bytes(t: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether the byte ranges of ``t`` and ``other`` (:func:`byte_span` from each one's first
    element: for a strided tensor, the bytes between its elements too) overlap on one device; an
    empty tensor shares none."""
    span, other_span = byte_span(t), byte_span(other)
    if span == 0 or other_span == 0 or t.device != other.device:
        return False
    lo, olo = t.data_ptr(), other.data_ptr()
    return lo < olo + other_span and olo < lo + span


def tensor_problem(
    name: str,
    t: Any,
    *,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    shape: tuple[int, ...] | None = None,
    numel: int | None = None,
    device_index: int,
    memory: str,
    no_grad: str,
    shape_note: str = "",
    apart: dict[str, torch.Tensor] | None = None,
) -> str | None:
    """What is wrong with ``t`` as the tensor argument ``name`` of a consumer's call, or ``None``:
    the one rule of every consumer's tensor checks (the collectives, the writer, the dispatcher).

    ``t`` passes when it is a ``torch.Tensor`` (any subclass: an ``nn.Parameter`` is a tensor)
    of ``dtype`` (one of them, for a tuple), ``shape`` (or ``numel`` elements), on the device
    whose index is ``device_index`` (-1: the CPU), contiguous, and not requiring grad while grad
    mode is on, and shares no byte with the tensors ``apart`` names (an output the call writes while
    it reads them). The sentence names the first property that differs, and what it is and should be.

    Args:
        name: the argument, as the message names it (``"norm_weight"``).
        t: its value.
        dtype: the dtype (or dtypes) it must have; ``None``: any.
        shape: the shape it must have; ``None``: any.
        numel: the elements it must have; ``None``: any.
        device_index: ``Tensor.get_device()`` of the consumer's memory (-1 for the CPU).
        memory: the consumer's memory, for the message (``"the collective's memory on cpu"``).
        no_grad: the call and its verb, as the message says it has no autograd formula (``"the collectives
            have"``).
        shape_note: why the shape is what it must be, after the shape's sentence.
        apart: the call's other tensors, by name, that ``t`` may not overlap (for an ``out=``: the
            inputs the call reads while it writes ``out``).
    """
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if dtype is not None and (t.dtype not in dtype if isinstance(dtype, tuple) else t.dtype is not dtype):
        if isinstance(dtype, tuple):
            names = [str(d).removeprefix("torch.") for d in dtype]
            want = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
        else:
            want = str(dtype)
        return f"{name} must be {want}, got {t.dtype}"
    if shape is not None and tuple(t.shape) != tuple(shape):
        return f"{name} must have shape {tuple(shape)}{shape_note}, got {tuple(t.shape)}"
    if numel is not None and t.numel() != numel:
        return f"{name} must have {numel} elements, got {t.numel()} (shape {tuple(t.shape)})"
    # get_device() is -1 for CPU tensors and for meta tensors too: a tensor without memory
    # (neither CUDA nor CPU) never reaches a launch.
    dev = t.get_device()
    if dev != device_index or not (t.is_cuda or t.is_cpu):
        return f"{name} is on {t.device}, {memory}"
    if not t.is_contiguous():
        return f"{name} must be contiguous (call .contiguous()), got strides {tuple(t.stride())}"
    if t.requires_grad and torch.is_grad_enabled():
        return (
            f"{name} requires grad and grad mode is on, but {no_grad} no autograd formula (a backward would get "
            "no gradient through it): call it under torch.no_grad() or torch.inference_mode()"
        )
    for other, o in (apart or {}).items():
        if isinstance(o, torch.Tensor) and shares_bytes(t, o):
            return (
                f"{name} shares memory with {other} (the call reads {other} while it writes {name}): "
                f"give {name} memory of its own"
            )
    return None


def require(problem: str | None, *, rank: int, call: str, error: Callable[[str], SymmSyncError] = ConfigError) -> None:
    """Raise ``error("rank R: call: problem")`` when there is a problem."""
    if problem is not None:
        raise error(f"rank {rank}: {call}: {problem}")


def check_index(name: str, v: Any, n: int, of: str, *, rank: int, call: str) -> int:
    """``v`` when it indexes ``n`` things; else :class:`~symmsync.BoundsError` (or
    :class:`~symmsync.ConfigError` for a non-int)."""
    if not is_int(v):
        require(f"{name} must be an int, got {v!r}", rank=rank, call=call)
    require(index_problem(name, v, n, of), rank=rank, call=call, error=BoundsError)
    return v
