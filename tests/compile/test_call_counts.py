"""The host cost of a call, counted: Python function calls per call of each op, within a budget.

Host time is what a call outside a whole-graph capture costs (docs/performance.md, "Host cost
per call"), and CI cannot time it. It can count it: the Python functions one call enters,
eagerly, compiled (``torch.compile(fullgraph=True)``, Inductor, not graphed: counted above
the call of a compiled function that only allocates its output, so that torch's wrapper is
not counted) and through the op as a split graph calls it between compiled pieces. The
kernel's own run is left out (Triton's interpreter runs it in Python here; on a GPU it is one
``cuLaunchKernel``): counting stops at
:meth:`symmsync.core.launch.Launcher._triton_launch`. Each budget is the count of today's code with
a little room; a change that adds calls to a hot path (a bound launch rebuilt per call, a
check run twice, a dispatch through ``torch.library.custom_op``'s Python wrapper) fails here
and must either be undone or raise the budget knowingly.

World 1 on the host backend: no peer to wait for, so the count is the call's alone.
"""

import collections
import sys

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives as C
from symmsync import pcp
from symmsync.core.launch import Launcher
from symmsync.testing import run

N = 8 * 64  # a decode batch of 8 rows of 64

#: Python calls per call, at most (today's counts, in the comments, plus room for small changes).
#: On the host backend a call also settles after its launch (its waits' records and its call
#: headers' state read: 6 to 7 calls a GPU's hot path does not make) and views its bfloat16
#: tensors as their bits for the interpreter (a call each; none on a GPU).
BUDGETS = {
    "all_reduce.eager": 26,  # 24
    "all_reduce.op": 26,  # 24
    "all_reduce.compiled": 25,  # 23 above the compiled baseline
    "fused.eager": 28,  # 26
    "fused.op": 28,  # 26
    "fused.compiled": 27,  # 25 above the compiled baseline
    "all_gather.eager": 26,  # 24
    "all_gather.op": 26,  # 24
    "all_gather.compiled": 25,  # 23 above the compiled baseline
    "reduce_scatter.eager": 27,  # 25
    "reduce_scatter.op": 27,  # 25
    "reduce_scatter.compiled": 26,  # 24 above the compiled baseline
    "fence.eager": 16,  # 13
    "fence.op": 18,  # 15
    "fence.compiled": 17,  # 14 above the compiled baseline
    "write.eager": 26,  # 24
    "write.op": 30,  # 28
    "write.compiled": 31,  # 29 above the compiled baseline
}


def count_calls(fn) -> collections.Counter:
    """The Python functions ``fn()`` enters, counted, without what Triton's launcher runs."""
    counts: collections.Counter = collections.Counter()
    skip = 0
    stop = Launcher._triton_launch.__code__

    def profile(frame, event, arg):
        nonlocal skip
        if event == "call":
            if skip:
                skip += 1
                return
            code = frame.f_code
            counts[f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}"] += 1
            if code is stop:
                skip = 1
        elif event == "return" and skip:
            skip -= 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


def counted(fn, baseline=None) -> tuple[int, dict]:
    """(calls of one call of ``fn`` after two warm-up calls, above ``baseline``'s; what they were)."""
    for _ in range(2):
        fn()
        if baseline is not None:
            baseline()
    calls = count_calls(fn)
    base = count_calls(baseline) if baseline is not None else collections.Counter()
    return sum(calls.values()) - sum(base.values()), dict(calls - base)


def counts() -> dict:
    """Rank function (world 1): the counts of every case of :data:`BUDGETS`."""
    assert dist.get_world_size() == 1
    per = -(-C.workspace_bytes(N, torch.float32, 1) // 128) * 128
    layout = pcp.CacheLayout(num_blocks=2, num_layers=2, base=3 * per)
    buf = ss.SymmetricBuffer(layout.end, backend="host", channels=5)
    view = buf.view([0])
    ar = C.AllReduce(view, N, torch.float32, channel=0)
    ag = C.AllGather(view, N, torch.float32, offset=per, channel=1)
    rs = C.ReduceScatter(view, N, torch.float32, offset=2 * per, channel=2)
    fence = ss.Fence(view, 3)
    writer = pcp.DirectKVWriter(ss.pcp_view(buf), layout, channel=4)
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    w = torch.rand(64, generator=g) + 0.5
    kv, pe, ix = (torch.randn(4, d, generator=g).bfloat16() for d in (512, 64, 128))
    batch = writer.prepare(torch.tensor([3, 9, 64, 70]))
    span = writer.span(0)  # what a split graph passes the op: the span it declares mutated
    kv_write = torch.ops.symmsync.kv_write.default
    compile_ = lambda f: torch.compile(f, fullgraph=True)
    # The baselines allocate their output and launch no kernel (Inductor would compile one in C++).
    plain = compile_(lambda t: torch.empty_like(t))
    plain_args = {1: (x,), 2: (x, r)}

    def compiled(f, n_args=1):
        cf = compile_(f)
        args = plain_args[n_args]
        two = compile_(lambda t, u: torch.empty_like(t)) if n_args == 2 else None
        return (lambda: cf(*args)), (lambda: (two or plain)(*args))

    def write_step(kv, pe, ix):  # one layer, so that the count is one write's
        writer.write(0, kv, pe, ix, batch)
        return torch.empty_like(kv)

    cw = compile_(write_step)
    plain_write = compile_(lambda kv, pe, ix: torch.empty_like(kv))
    cases = {
        "all_reduce.eager": (lambda: ar(x), None),
        "all_reduce.op": (lambda: torch.ops.symmsync.all_reduce.default(x, ar.op_handle, "auto"), None),
        "all_reduce.compiled": compiled(lambda t: ar(t)),
        "fused.eager": (lambda: ar(x, residual=r, norm_weight=w, eps=1e-6), None),
        "fused.op": (
            lambda: torch.ops.symmsync.all_reduce_residual_rms_norm.default(x, r, w, 1e-6, ar.op_handle, "auto"),
            None,
        ),
        "fused.compiled": compiled(lambda t, u: ar(t, residual=u, norm_weight=w, eps=1e-6), 2),
        "all_gather.eager": (lambda: ag(x), None),
        "all_gather.op": (lambda: torch.ops.symmsync.all_gather.default(x, ag.op_handle, 1), None),
        "all_gather.compiled": compiled(lambda t: ag(t)),
        "reduce_scatter.eager": (lambda: rs(x), None),
        "reduce_scatter.op": (lambda: torch.ops.symmsync.reduce_scatter.default(x, rs.op_handle, 1), None),
        "reduce_scatter.compiled": compiled(lambda t: rs(t)),
        "fence.eager": (fence.fence, None),
        "fence.op": (lambda: torch.ops.symmsync.fence.default(fence.op_handle, 0, fence.orders()), None),
        "fence.compiled": compiled(lambda t: fence.fence() or torch.empty_like(t)),
        "write.eager": (lambda: writer.write(0, kv, pe, ix, batch), None),
        "write.op": (lambda: kv_write(writer.op_handle, 0, kv, pe, ix, batch.slots, span), None),
        "write.compiled": (lambda: cw(kv, pe, ix), lambda: plain_write(kv, pe, ix)),
    }
    out = {}
    with torch.no_grad():
        for name, (fn, baseline) in cases.items():
            out[name] = counted(fn, baseline)
    buf.close()
    return out


def test_each_calls_python_calls_stay_within_its_budget():
    (result,) = run(counts, 1, timeout_s=300)
    over = {name: result[name] for name, budget in BUDGETS.items() if result[name][0] > budget}
    assert not over, {name: (n, BUDGETS[name], calls) for name, (n, calls) in over.items()}
    assert set(result) == set(BUDGETS)
