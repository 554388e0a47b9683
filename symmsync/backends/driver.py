"""The CUDA driver, through cuda-python: one accessor and one result check for all of symmsync.

Every module that calls the driver (the CUDA backend, :mod:`symmsync.core.launch`, the fence's
side-stream events, :mod:`symmsync.tools.runtime_alloc`, the doctor) gets the bindings from
:func:`driver` and unpacks a call's ``(CUresult, *values)`` with :func:`check`, so a
missing cuda-python or a failed call reads the same everywhere::

    drv = driver()
    ptr = check(drv.cuMemAddressReserve(size, align, 0, 0), "cuMemAddressReserve", call="SymmetricBuffer.grow")
"""

from __future__ import annotations

from typing import Any

from ..errors import BackendError

__all__ = ["available", "check", "driver", "error_name"]

_module: Any = None


def driver() -> Any:
    """The ``cuda.bindings.driver`` module (or the older ``cuda.cuda`` layout), imported once.

    Raises:
        BackendError: cuda-python is not installed (``pip install 'symmsync[cuda]'``).
    """
    global _module
    if _module is None:
        try:
            from cuda.bindings import driver as drv
        except ImportError:  # older cuda-python layout
            try:
                from cuda import cuda as drv  # type: ignore[no-redef]
            except ImportError as e:
                raise BackendError(
                    "the cuda backend needs cuda-python, which is not installed: pip install 'symmsync[cuda]' "
                    f"(or pip install cuda-python) ({e})"
                ) from e
        _module = drv
    return _module


def available() -> bool:
    """True when cuda-python can be imported (the fast launch path and the CUDA backend need it)."""
    try:
        driver()
    except BackendError:
        return False
    return True


def error_name(err: Any) -> str:
    """The driver's name for a ``CUresult`` (``CUDA_ERROR_INVALID_VALUE``), or its number."""
    drv = driver()
    name = drv.cuGetErrorName(err)
    return name[1].decode() if name[0] == drv.CUresult.CUDA_SUCCESS else str(err)


def check(result: Any, what: str, call: str | None = None) -> Any:
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising on an error.

    Args:
        result: what the binding returned: a ``CUresult`` or a tuple starting with one.
        what: the driver call, named in the error (``"cuMemMap"``).
        call: the symmsync operation it served, named first when given
            (``"SymmetricBuffer.grow"``).

    Returns:
        ``None`` for a call that returns only its status, the single value, or a tuple of
        the values.

    Raises:
        BackendError: the call failed; the message names the call and the driver's error.
    """
    err = result[0] if isinstance(result, tuple) else result
    if err != driver().CUresult.CUDA_SUCCESS:
        prefix = f"{call}: " if call else ""
        raise BackendError(f"{prefix}{what} failed: {error_name(err)}")
    if not isinstance(result, tuple) or len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]
