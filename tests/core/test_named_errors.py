"""A symmsync error raised inside an interpreted kernel reaches the caller as itself (host backend).

Triton's interpreter wraps whatever a kernel raises in ``InterpreterError``, once per nested
``@triton.jit`` call; :mod:`symmsync.backends.mode` makes every launch raise symmsync's own error
instead, with Triton's error as its ``__cause__``. The kernels here are the user's own (a
``kernel[grid](...)`` launch, not symmsync's launcher): a debug check of a device primitive
(``SYMMSYNC_DEBUG=1``: a publish from several programs of one launch) is caught by
``except ss.DebugCheckError``; an error of Triton's own (a shape that does not broadcast)
still raises ``InterpreterError``, exactly as Triton raises it.
"""

import traceback

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from triton.runtime.errors import InterpreterError

import symmsync as ss
import symmsync.language as ssl
from symmsync.testing import run

RUN_S = 240


@triton.jit
def publish_kernel(ptrs, cell, me, SIZE: tl.constexpr):
    ssl.publish(ptrs, cell, me, SIZE)  # from every program of the launch: the debug check's misuse


@triton.jit
def shapes_kernel(x):
    tl.store(x + tl.arange(0, 4), tl.load(x + tl.arange(0, 2)))  # 2 values for 4 lanes: Triton refuses


def _chain(e):
    """Every exception on ``e``'s ``__cause__`` chain, in order (stops at a repeat: a cycle)."""
    seen = []
    while e is not None and all(e is not s for s in seen):
        seen.append(e)
        e = e.__cause__
    return seen, e is not None


def kernel_errors():
    buf = ss.SymmetricBuffer(1024, backend="host")
    view = buf.view([0, 1])
    fence = ss.Fence(view, timeout_s=60)
    out = {"debug": ssl.DEBUG}
    try:
        publish_kernel[(4,)](view.cell_ptrs, fence.cell, view.local_index, SIZE=2)
        out["own"] = "returned"
    except ss.DebugCheckError as e:
        chain, cycle = _chain(e)
        out["own"] = {
            "msg": str(e),
            "cause": type(e.__cause__).__name__,
            "cause_is_triton": isinstance(e.__cause__, InterpreterError),
            "chain": [type(c).__name__ for c in chain],
            "cycle": cycle,
            "formats": "DebugCheckError" in "".join(traceback.format_exception(e)),
        }
    except Exception as e:  # noqa: BLE001 - what reaches the caller without symmsync.backends.mode's unwrapping
        out["own"] = {"uncaught": type(e).__name__}
    try:
        shapes_kernel[(1,)](torch.zeros(4))
        out["foreign"] = "returned"
    except Exception as e:  # noqa: BLE001 - the oracle is the exact type
        out["foreign"] = {"type": type(e).__name__, "cause": type(e.__cause__).__name__}
    dist.barrier()
    buf.close()
    return out


def test_a_debug_check_in_a_users_kernel_is_caught_by_name_with_tritons_error_as_its_cause():
    for r, out in enumerate(run(kernel_errors, 2, backend="host", timeout_s=RUN_S, env={"SYMMSYNC_DEBUG": "1"})):
        assert out["debug"], out
        own = out["own"]
        assert isinstance(own, dict) and "msg" in own, own
        assert f"rank {r} (view index {r}), program (1, 0, 0)" in own["msg"], own
        assert own["cause_is_triton"] and own["chain"][0] == "DebugCheckError", own
        assert set(own["chain"][1:]) == {"InterpreterError"}, own  # Triton's wrappers, kept, without a cycle
        assert not own["cycle"] and own["formats"], own
        # An error that is not symmsync's stays exactly as Triton raises it.
        assert out["foreign"] == {"type": "InterpreterError", "cause": "ValueError"}, out["foreign"]
