"""The launch path of every symmsync kernel: compile once, pack arguments once, launch.

Public API, for consumers that launch their own kernels (:mod:`symmsync.pcp` does):
:class:`Launcher` (one kernel with fixed compile-time constants and grid),
:class:`BoundLaunch` (its arguments packed once, and a call's own arguments passed to it:
a call is one launch, and keeps none of its tensors),
:func:`current_stream` and :func:`cu_stream` (raw CUDA stream handles and their
cuda-python objects).

Triton's own launcher binds and specializes every argument in Python on every call,
which costs more host time than the launch itself (docs/performance.md, "The launch
path (eager)"). A fence runs once per layer, so symmsync
keeps the compiled kernel, packs the kernel parameters into a ctypes array, and
launches with ``cuLaunchKernel`` from cuda-python on torch's current stream; a
CUDA graph captures such a launch like any other.

(A ctypes call of the driver's entry point, resolved with ``cuGetProcAddress``,
measured slower than cuda-python's wrapper; the same page has the figures.)

The fast path is taken only when it is exact: the kernel was compiled by Triton
for these argument classes (pointer alignment, int width, the value 1), and it
needs no scratch memory. Anything else goes through Triton's launcher, and
:attr:`Launcher.path` says which path the last launch took. Under Triton's
interpreter (host backend) every launch is Triton's (the interpreter runs Python).
"""

from __future__ import annotations

import ctypes
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from ..backends.driver import check, driver
from ..backends.mode import kernels_interpreted
from ..errors import BackendError

_CTYPES = {
    "i1": ctypes.c_int8,
    "i8": ctypes.c_int8,
    "i16": ctypes.c_int16,
    "i32": ctypes.c_int32,
    "i64": ctypes.c_int64,
    "u1": ctypes.c_uint8,
    "u8": ctypes.c_uint8,
    "u16": ctypes.c_uint16,
    "u32": ctypes.c_uint32,
    "u64": ctypes.c_uint64,
    "fp32": ctypes.c_float,
    "f32": ctypes.c_float,
    "fp64": ctypes.c_double,
    "f64": ctypes.c_double,
}


def _arg_class(v: Any) -> tuple:
    """The part of an argument that decides which compiled variant Triton picks."""
    if isinstance(v, torch.Tensor):
        return ("t", v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool):
        return ("b",)
    if isinstance(v, int):
        width = "i32" if -(2**31) <= v < 2**31 else ("i64" if -(2**63) <= v < 2**63 else "u64")
        return ("i", width, v == 1, v % 16 == 0)
    if isinstance(v, float):
        return ("f",)
    return ("o", type(v))


def _runtime_params(kernel: Any) -> tuple[list[str], list[str]]:
    """(runtime parameter names, constexpr parameter names) of a jitted kernel, in order."""
    fn = getattr(kernel, "fn", kernel)
    runtime, consts = [], []
    for name, p in inspect.signature(fn).parameters.items():
        ann = p.annotation
        is_const = "constexpr" in (ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann)))
        (consts if is_const else runtime).append(name)
    return runtime, consts


def runtime_params(kernel: Any) -> tuple[list[str], list[str]]:
    """(runtime parameter names, constexpr parameter names) of a jitted kernel, in order."""
    return _runtime_params(kernel)


_INTERPRETED = kernels_interpreted()


def kernel_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a kernel takes it: under Triton's interpreter (numpy has no bfloat16) a bfloat16
    tensor travels as its int16 bits (the kernels convert with :mod:`symmsync.language.bf16`);
    elsewhere ``t`` itself."""
    if _INTERPRETED and t.dtype is torch.bfloat16:
        return t.view(torch.int16)
    return t


def device_programs(device: torch.device, per_sm: int, interpreted: int) -> int:
    """The programs of a launch sized by the device: ``per_sm`` for each multiprocessor the
    device reports (under MPS, its share's), or ``interpreted`` under Triton's interpreter (which
    runs programs one after another)."""
    if _INTERPRETED or device.type != "cuda":
        return interpreted
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int) -> int:
    """The raw handle of torch's current CUDA stream on a device (cheap)."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


#: raw stream handle -> its cuda-python ``CUstream`` (see :func:`cu_stream`)
_cu_streams: dict[int, Any] = {}


def cu_stream(raw: int) -> Any:
    """The cuda-python ``CUstream`` for the raw CUDA stream handle ``raw``.

    Made once per handle and kept in one table for the process, so a launch or an event
    call on a stream costs no object construction. Needs cuda-python (``symmsync[cuda]``).
    """
    stream = _cu_streams.get(raw)
    if stream is None:
        stream = _cu_streams[raw] = driver().CUstream(init_value=raw)
    return stream


class Launcher:
    """Launch one Triton kernel with fixed compile-time constants and grid.

    Args:
        kernel: the ``@triton.jit`` function.
        grid: launch grid (tuple of up to 3 ints).
        num_warps: warps per program.
        constexprs: values of the kernel's ``tl.constexpr`` parameters.

    Call :meth:`__call__` with the runtime arguments in the kernel's parameter order
    (constexpr parameters left out), or :meth:`bind` them once and call the result,
    passing on each call the few arguments that change (``per_call``).
    The grid is fixed at construction; a launch with another grid passes its own
    (``bind(..., grid=)``, ``launcher(..., grid=)``).
    """

    def __init__(self, kernel: Any, grid: Sequence[int], num_warps: int = 1, **constexprs: Any):
        self.kernel = kernel
        self._grid = _grid3(grid)
        self.num_warps = num_warps
        self.constexprs = constexprs
        self.names, const_names = _runtime_params(kernel)
        missing = set(const_names) - set(constexprs)
        if missing:
            raise BackendError(
                f"Launcher({getattr(kernel, '__name__', kernel)}): constexprs {sorted(missing)} not given"
            )
        self.interpreted = kernels_interpreted()
        self.path = "none"  #: "cuda-python" or "triton": how the last launch went
        self.fallback_reason = "not launched yet"
        self._compiled: dict[tuple, Any] = {}

    # ------------------------------------------------------------------ public
    @property
    def grid(self) -> tuple[int, int, int]:
        """The default grid of this launcher's launches (fixed at construction)."""
        return self._grid

    def __call__(self, *args: Any, grid: Sequence[int] | None = None) -> None:
        """Launch with ``args`` (runtime parameters, in order), on ``grid`` (default: the launcher's).

        Packs the arguments for this one call: for repeated launches, :meth:`bind` once.
        """
        self.bind(*args, grid=grid)()

    def bind(self, *args: Any, grid: Sequence[int] | None = None, per_call: Sequence[str] = ()) -> BoundLaunch:
        """Pack ``args`` once; the returned object launches them with no per-call packing.

        Args:
            *args: the runtime arguments, in the kernel's parameter order.
            grid: this launch's grid (default: the launcher's).
            per_call: the names of the parameters each call passes (in this order), such as
                the input and output tensors; the bound launch keeps their packed form
                (an address, a number) and none of the values themselves.
        """
        if len(args) != len(self.names):
            raise BackendError(
                f"{getattr(self.kernel, '__name__', 'kernel')}: expected {len(self.names)} runtime arguments "
                f"({', '.join(self.names)}), got {len(args)}"
            )
        unknown = [name for name in per_call if name not in self.names]
        if unknown:
            raise BackendError(
                f"{getattr(self.kernel, '__name__', 'kernel')}: per_call names {unknown} are not runtime "
                f"parameters ({', '.join(self.names)})"
            )
        positions = tuple(self.names.index(name) for name in per_call)
        return BoundLaunch(self, args, self._grid if grid is None else _grid3(grid), positions)

    def bind_named(
        self, *, grid: Sequence[int] | None = None, per_call: Sequence[str] = (), **args: Any
    ) -> BoundLaunch:
        """:meth:`bind` with the arguments by the kernel's parameter names, so that no call site
        writes their positions (a kernel's signature may change). The ``per_call`` parameters need
        no value here (each call passes its own).

        Raises:
            BackendError: a runtime parameter has no value, or a name is not one.
        """
        unknown = sorted(set(args) - set(self.names))
        missing = [n for n in self.names if n not in args and n not in per_call]
        if unknown or missing:
            raise BackendError(
                f"{getattr(self.kernel, '__name__', 'kernel')}: "
                + (f"no runtime parameters named {unknown}; " if unknown else "")
                + (f"no values for {missing}; " if missing else "")
                + f"its runtime parameters are {', '.join(self.names)}"
            )
        return self.bind(*[args.get(n) for n in self.names], grid=grid, per_call=per_call)

    # ------------------------------------------------------------------ internals
    def _triton_launch(self, args: Sequence[Any], grid: tuple[int, int, int]) -> Any:
        kwargs = dict(zip(self.names, args))
        return self.kernel[grid](**kwargs, **self.constexprs, num_warps=self.num_warps)

    def _packer(self, classes: Sequence[tuple], raw: Sequence[Any]) -> _Packed | None:
        """The packed parameters of arguments of these classes and packed values (addresses,
        numbers), when a kernel compiled for those classes exists and is exact."""
        if self.interpreted:
            self.fallback_reason = "Triton interpreter (host backend)"
            return None
        entry = self._compiled.get(tuple(classes))
        if entry is None:
            return None
        return _Packed(entry, raw, self.names)


def _grid3(grid: Sequence[int]) -> tuple[int, int, int]:
    """A grid of up to 3 dimensions, padded with 1s to 3."""
    return tuple(grid) + (1,) * (3 - len(grid))  # type: ignore[return-value]


class _Packed:
    """ctypes kernel parameters of one argument tuple, in the compiled signature's order."""

    def __init__(self, entry: _Compiled, raw: Sequence[Any], names: Sequence[str]):
        index = {name: i for i, name in enumerate(names)}
        self.keep: list[Any] = []
        #: argument index -> its ctypes cell (arguments the compiled kernel dropped have none)
        self.cells: dict[int, Any] = {}
        for name, ty in entry.signature:
            i = index[name]
            cell = ctypes.c_uint64(int(raw[i])) if ty.startswith("*") else _CTYPES[ty](raw[i])
            self.keep.append(cell)
            self.cells[i] = cell
        self.keep.append(ctypes.c_uint64(0))  # global scratch (none needed: checked at compile)
        self.keep.append(ctypes.c_uint64(0))  # profile scratch
        self.array = (ctypes.c_void_p * len(self.keep))(*[ctypes.addressof(c) for c in self.keep])
        self.address = ctypes.addressof(self.array)
        self.entry = entry


class _Compiled:
    """A compiled kernel usable through cuLaunchKernel, with what a launch needs."""

    def __init__(self, compiled: Any, device: torch.device):
        drv = driver()
        md = compiled.metadata
        if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
            raise _NotExact("the kernel needs scratch memory")
        if (
            getattr(md, "num_ctas", 1) != 1
            or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "launch_pdl", False)
        ):
            raise _NotExact("the kernel needs launch attributes (clusters, cooperative or PDL)")
        sig = getattr(compiled.src, "signature", None)
        if not isinstance(sig, dict):
            raise _NotExact("the compiled kernel has no signature to pack against")
        self.signature = []
        for name, ty in sig.items():
            if ty == "constexpr":
                continue
            if not isinstance(ty, str) or not (ty.startswith("*") or ty in _CTYPES):
                raise _NotExact(f"parameter {name} has type {ty!r}")
            self.signature.append((name, ty))
        if compiled.function is None:
            compiled._init_handles()
        self.function = drv.CUfunction(init_value=compiled.function)
        self.block = 32 * md.num_warps
        self.shared = md.shared
        self.device_index = device.index
        self.launch = drv.cuLaunchKernel
        self.success = drv.CUresult.CUDA_SUCCESS


class _NotExact(Exception):
    pass


def _packs_as(v: Any) -> Any:
    """What an argument packs to: a tensor's address, a number itself."""
    return v.data_ptr() if isinstance(v, torch.Tensor) else v


class BoundLaunch:
    """A launch whose arguments are packed: a call costs one ``cuLaunchKernel``.

    The arguments given to :meth:`Launcher.bind` are fixed, but for the ``per_call`` ones,
    which every call passes (``bound(x, out, n)``). Of those the bound launch keeps only
    what they packed to (a tensor's address and class, a number), never the values: a call
    holds no reference to its tensors once it returns, so memory that a caller frees or
    that torch's CUDA graph trees own is never kept alive by it, and no call needs to drop
    anything afterwards. A call repacks only what changed: a value that packs as the last
    one (a tensor of the same dtype at the same address; a number of the same type and
    value) costs a comparison; one of the same class (a tensor's dtype and 16-byte
    alignment; an int's width, ``== 1`` and multiple-of-16) changes its ctypes cell; one of
    another class selects the compiled variant for it (through Triton's launcher once, to
    compile it). The fixed arguments are held as given: they are the caller's own
    long-lived tensors (pointer tables, records) and numbers.
    """

    __slots__ = ("launcher", "_args", "_per", "_raw", "_classes", "_packed", "_gx", "_gy", "_gz")

    def __init__(self, launcher: Launcher, args: Sequence[Any], grid: Sequence[int], per_call: Sequence[int] = ()):
        self.launcher = launcher
        self._per = tuple(per_call)
        self._classes = [_arg_class(a) for a in args]
        # What each argument packs to: a call compares a new value with it.
        self._raw = [_packs_as(a) for a in args]
        self._packed = launcher._packer(self._classes, self._raw)
        self._args = list(args)
        for i in self._per:
            self._args[i] = None  # only their packed form is kept
        self._gx, self._gy, self._gz = _grid3(grid)

    @property
    def packed(self) -> bool:
        """True once calls go straight to ``cuLaunchKernel`` (compiled and packed)."""
        return self._packed is not None

    def release(self) -> None:
        """Drop the fixed arguments (pointer tables, records) and the packed parameters: the
        launch holds no mapping from now on, and a call raises :class:`~symmsync.BackendError`
        (an owner that closed checks first and raises its own :class:`~symmsync.ClosedError`)."""
        self._args = None
        self._packed = None

    @property
    def grid(self) -> tuple[int, int, int]:
        """The grid this launch uses."""
        return (self._gx, self._gy, self._gz)

    @property
    def per_call(self) -> tuple[str, ...]:
        """The names of the parameters each call passes, in the order a call takes them."""
        names = self.launcher.names
        return tuple(names[i] for i in self._per)

    def __call__(self, *values: Any, stream: int | None = None) -> None:
        """Launch with ``values`` for the ``per_call`` parameters (in that order), on torch's
        current stream or on the raw CUDA stream handle ``stream``.

        ``stream`` is honoured on the fast path only: a launch that is not packed yet
        (the first, through Triton's launcher) goes to the current stream, so callers
        that pass it check :attr:`packed` first. The caller keeps the tensors alive until
        the launch ran (in stream order), as for any kernel launch.
        """
        per = self._per
        if len(values) != len(per):
            raise BackendError(
                f"{getattr(self.launcher.kernel, '__name__', 'kernel')}: a call passes {len(per)} values "
                f"({', '.join(self.per_call)}), got {len(values)}"
            )
        packed = self._packed
        if packed is None:
            if self._args is None:
                raise BackendError(f"{getattr(self.launcher.kernel, '__name__', 'kernel')}: launched after release()")
            self._through_triton(values)
            return
        raw, classes = self._raw, self._classes
        reclassed = False
        for i, v in zip(per, values):
            old = classes[i]
            if type(v) is torch.Tensor:  # the common case first: an address and a dtype to compare
                p = v.data_ptr()
                if p == raw[i] and old[1] is v.dtype:
                    continue
                new = ("t", v.dtype, p % 16 == 0)
            elif old[0] != "t" and type(v) is type(raw[i]) and v == raw[i]:
                continue
            else:
                p, new = _packs_as(v), _arg_class(v)
            raw[i] = p
            if new != old:
                classes[i] = new
                reclassed = True
            else:
                cell = packed.cells.get(i)
                if cell is not None:
                    cell.value = p
        if reclassed:
            packed = self._packed = self.launcher._packer(classes, raw)
            if packed is None:  # a variant not compiled yet: Triton's launcher compiles it
                self._through_triton(values)
                return
        e = packed.entry
        raw_stream = current_stream(e.device_index) if stream is None else stream
        cu = _cu_streams.get(raw_stream)
        if cu is None:
            cu = cu_stream(raw_stream)
        (err,) = e.launch(e.function, self._gx, self._gy, self._gz, e.block, 1, 1, e.shared, cu, packed.address, 0)
        if err != e.success:  # the check only on failure: it costs a call on every launch
            check(err, f"cuLaunchKernel({getattr(self.launcher.kernel, '__name__', 'kernel')})")
        self.launcher.path = "cuda-python"

    def _through_triton(self, values: Sequence[Any]) -> None:
        """Launch through Triton (compiling if needed) and, when exact, set up the fast path."""
        launcher = self.launcher
        args = self._args.copy()
        for i, v in zip(self._per, values):
            args[i] = v
        compiled = launcher._triton_launch(args, self.grid)
        launcher.path = "triton"
        if launcher.interpreted or compiled is None:
            return
        classes = [_arg_class(a) for a in args]
        raw = [_packs_as(a) for a in args]
        self._classes, self._raw = classes, raw
        key = tuple(classes)
        try:
            entry = launcher._compiled.get(key)
            if entry is None:
                dev = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
                dev = dev or torch.device("cuda", torch.cuda.current_device())
                entry = launcher._compiled[key] = _Compiled(compiled, dev)
            self._packed = _Packed(entry, raw, launcher.names)
            launcher.fallback_reason = ""
        except _NotExact as e:
            launcher.fallback_reason = str(e)
        except BackendError as e:  # cuda-python missing (driver()): Triton's launcher still works
            launcher.fallback_reason = f"cuda-python unavailable: {e}"
