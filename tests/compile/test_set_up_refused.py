"""Set-up calls made inside a compiled function, or while a rank captures, are refused with one error.

Host backend, world 2. Every collective set-up call (the constructors, ``view``, ``grow``,
``claim``, the writer's ``prepare``) inside a function ``torch.compile`` compiles raises the one
``ConfigError`` docs/inside-a-model.md gives ("called inside a function that torch.compile
compiles ... Make it before compiling") on every rank: itself without ``fullgraph``, carried by
Dynamo's ``Unsupported`` with it. None of them takes anything (a view's region, a claim), and the
same calls made eagerly afterwards work. Then, with a capture planted on rank 1 (what
``backends.capturing`` answers), the consumers' constructors and ``prepare`` raise
``CaptureError`` on both ranks. The oracle is the text of the error each rank gets.
"""

import pytest
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import backends, pcp
from symmsync import collectives as C
from symmsync.testing import run

N = 64
F32 = torch.float32
SAID = "called inside a function that torch.compile compiles"


def _set_up():
    w = dist.get_world_size()
    sizes = {op: C.workspace_bytes(N, F32, w, op) for op in ("all_reduce", "all_gather", "reduce_scatter")}
    caches = pcp.CacheLayout(num_blocks=1, num_layers=1)
    plan = ss.carve(**sizes, caches=caches.nbytes, scratch=128)
    buf = ss.SymmetricBuffer(plan.nbytes, backend="host", max_nbytes=2 * plan.nbytes, channels=4)
    view = buf.view(list(range(w)))
    layout = pcp.CacheLayout(num_blocks=1, num_layers=1, base=plan["caches"])
    return buf, view, layout, plan


def _calls(buf, view, layout, plan, writer):
    """Every set-up call, by the name its error gives."""
    slots = torch.arange(4) + 4 * dist.get_rank()
    return {
        "SymmetricBuffer": lambda: ss.SymmetricBuffer(4096, backend="host"),
        "SymmetricBuffer.from_peer_addresses": lambda: ss.SymmetricBuffer.from_peer_addresses(
            buf.ptrs.tolist(), buf.nbytes, device="cpu"
        ),
        "SymmetricBuffer.view": lambda: buf.view(list(range(dist.get_world_size()))),
        "SymmetricBuffer.grow": lambda: buf.grow(buf.max_nbytes),
        "SymmetricBuffer.claim": lambda: buf.claim("scratch", plan["scratch"], 128),
        "Fence": lambda: ss.Fence(view, 1),
        "Signals": lambda: ss.Signals(view),
        "AllReduce": lambda: C.AllReduce(view, N, F32, offset=plan["all_reduce"], channel=1),
        "AllGather": lambda: C.AllGather(view, N, F32, offset=plan["all_gather"], channel=2),
        "ReduceScatter": lambda: C.ReduceScatter(view, N, F32, offset=plan["reduce_scatter"], channel=3),
        "DirectKVWriter": lambda: pcp.DirectKVWriter(view, layout, channel=1),
        "DirectKVWriter.prepare": lambda: writer.prepare(slots),
    }


def compiled_set_up() -> dict:
    buf, view, layout, plan = _set_up()
    writer = pcp.DirectKVWriter(view, layout, channel=0)  # made eagerly: its prepare() is the call
    calls = _calls(buf, view, layout, plan, writer)
    seen = {}
    for name, make in calls.items():
        for fullgraph in (True, False):

            def step(x, make=make):
                make()
                return x + 1

            torch._dynamo.reset()
            try:
                torch.compile(step, fullgraph=fullgraph, backend="eager")(torch.ones(2))
                seen[name, fullgraph] = ("made", "")
            except Exception as e:  # noqa: BLE001 - Dynamo's own type under fullgraph, ours without
                seen[name, fullgraph] = (type(e).__name__, str(e))
    seen["taken"] = ([str(r) for r in buf.regions], buf.nbytes, len(buf.views))
    # The same calls, eagerly: every one works (nothing was half made).
    made = {
        name: type(make()).__name__ for name, make in calls.items() if name != "SymmetricBuffer.from_peer_addresses"
    }
    seen["eager"] = made
    dist.barrier()
    buf.close()
    return seen


def test_every_set_up_call_inside_a_compiled_function_raises_the_one_error_on_every_rank():
    for rank, seen in enumerate(run(compiled_set_up, 2, timeout_s=900)):
        regions, nbytes, views = seen.pop("taken")
        made = seen.pop("eager")
        names = {name for name, _ in seen}
        assert len(names) == 12
        for (name, fullgraph), (kind, message) in seen.items():
            if fullgraph:  # Dynamo reports what the traced call raised
                assert kind == "Unsupported", (name, kind, message)
                assert f'ConfigError("rank {rank}: {name}: {SAID}' in message, (name, message)
            else:
                assert kind == "ConfigError", (name, kind, message)
                assert message.startswith(f"rank {rank}: {name}: {SAID}"), (name, message)
                assert "Make it before compiling" in message
        assert len(regions) == 1 and "caches" in regions[0]  # the eager writer's, and nothing else
        assert views == 1  # no view was made
        assert set(made) == names - {"SymmetricBuffer.from_peer_addresses"}


def captured_set_up() -> dict:
    buf, view, layout, plan = _set_up()
    writer = pcp.DirectKVWriter(view, layout, channel=0)
    calls = _calls(buf, view, layout, plan, writer)
    real = backends.capturing
    if dist.get_rank() == 1:
        backends.capturing = lambda device: True  # what a capture on this rank's current stream reads
    seen = {}
    for name in ("Signals", "AllReduce", "AllGather", "ReduceScatter", "DirectKVWriter", "DirectKVWriter.prepare"):
        try:
            calls[name]()
            seen[name] = ("made", "")
        except ss.SymmSyncError as e:
            seen[name] = (type(e).__name__, str(e))
    backends.capturing = real
    seen["after"] = C.AllReduce(view, N, F32, offset=plan["all_reduce"], channel=1)(torch.ones(N)).tolist()
    dist.barrier()
    buf.close()
    return seen


@pytest.mark.parametrize("world", [2])
def test_consumers_made_while_one_rank_captures_raise_capture_error_on_every_rank(host_ranks, world):
    for seen in host_ranks(captured_set_up, world, timeout_s=600):
        assert seen.pop("after") == [float(world)] * N  # nothing was taken: the same call works after
        for name, (kind, message) in seen.items():
            assert kind == "CaptureError", (name, kind, message)
            assert "rank 1" in message and "called while a CUDA graph was being captured" in message, message
