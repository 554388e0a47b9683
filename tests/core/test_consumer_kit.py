"""The consumer kit's run half, through a consumer of a kind symmsync does not ship: the tutorial's
all-to-all (examples/11_all_to_all.py, written on the public API only).

A bad input on any member fails that call on every member (InputError there, PeerRefused naming it
and its reason elsewhere), every member's outputs of it read NaN, and the next call is right;
members whose sizes differ raise CallMismatch on every member; a compiled graph that ignores the
result still makes the call; the status word says a call failed until the host settles it. The
oracle of each: the blocks an all-to-all must deliver, written here in plain torch. Two bites:
without the wait the data oracle fails; without the header check a refused call's outputs hold
plausible stale data instead of NaN.
"""

import importlib.util
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl  # noqa: F401 - the interpreter wants it visible to the jit functions below
from jobs import ROOT

import symmsync as ss
import symmsync.language as ssl
from symmsync.testing import Died, run

W_BLOCK = 4  # elements per block


def tutorial():
    """examples/11_all_to_all.py as a module, loaded once per process (it registers its op)."""
    name = "tutorial_all_to_all"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "11_all_to_all.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def blocks(me, w, call=0):
    """What member ``me`` sends in call ``call``: ``w`` blocks, block p = (me, p, call) encoded."""
    return torch.tensor([1000.0 * me + 10.0 * p + call for p in range(w) for _ in range(W_BLOCK)])


def received(me, w, call=0):
    """The oracle: what member ``me`` must get: block p is member p's block ``me``."""
    return torch.cat([blocks(p, w, call)[me * W_BLOCK : (me + 1) * W_BLOCK] for p in range(w)])


def _made(buf):
    view = buf.view(list(range(buf.world_size)))
    return tutorial().AllToAll(view, 16)


def refusals(refuser):
    """Call 0 right, call 1 refused by ``refuser`` (a float64 input), call 2 right."""
    with ss.SymmetricBuffer(1 << 16, backend="host") as buf, _made(buf) as a2a:
        me, w = buf.rank, buf.world_size
        first = a2a(blocks(me, w, 0))
        out = torch.full((w * W_BLOCK,), 7.0)
        x = blocks(me, w, 1).double() if me == refuser else blocks(me, w, 1)
        try:
            a2a(x, out=out)
            got = ("returned", None)
        except ss.InputError as e:
            got = ("InputError", str(e))
        except ss.PeerRefused as e:
            got = ("PeerRefused", e.origin, e.reason, str(e))
        third = a2a(blocks(me, w, 2))
        return {
            "first": torch.equal(first, received(me, w, 0)),
            "got": got,
            "out_nan": bool(out.isnan().all()),
            "third": torch.equal(third, received(me, w, 2)),
            "status": int(a2a.status),
        }


@pytest.mark.parametrize("world,refuser", [(2, 0), (2, 1), (3, 2)])
def test_a_refused_call_fails_on_every_member_with_nan_outputs_and_the_next_call_is_right(host_ranks, world, refuser):
    results = host_ranks(refusals, world, refuser)
    for r, res in enumerate(results):
        assert res["first"] and res["third"], res
        assert res["status"] == 0
        if r == refuser:
            kind, msg = res["got"]
            assert kind == "InputError" and "x must be torch.float32, got torch.float64" in msg, res
            assert f"rank {r}: AllToAll" in msg
        else:
            kind, origin, reason, msg = res["got"]
            assert (kind, origin, reason) == ("PeerRefused", refuser, "x must be torch.float32, got torch.float64")
            assert f"rank {refuser} refused its call" in msg and "NaN" in msg, msg
            assert res["out_nan"], "a refused call's outputs must read NaN on every member"


def sizes_differ():
    with ss.SymmetricBuffer(1 << 16, backend="host") as buf, _made(buf) as a2a:
        me, w = buf.rank, buf.world_size
        x = blocks(me, w) if me == 0 else torch.zeros(w * 2 * W_BLOCK)  # rank 1: blocks of 8
        out = torch.full_like(x, 7.0)
        with pytest.raises(ss.CallMismatch) as first:
            a2a(x, out=out)
        with pytest.raises(ss.CallMismatch) as again:  # the consumer failed: every later call raises it
            a2a(blocks(me, w))
        return {
            "differs": first.value.differs,
            "calls": first.value.calls,
            "other": first.value.other,
            "same": again.value is first.value,
            "out_nan": bool(out.isnan().all()),
            "msg": str(first.value),
        }


def test_members_whose_sizes_differ_raise_the_mismatch_on_every_member_and_the_consumer_fails(host_ranks):
    results = host_ranks(sizes_differ, 2)
    for r, res in enumerate(results):
        assert res["differs"] == ["block"], res
        assert res["calls"][0]["block"] == W_BLOCK and res["calls"][1]["block"] == 2 * W_BLOCK
        assert res["other"] == 1 - r and res["same"] and res["out_nan"]
        assert "the members' calls differ (block: rank 0: 4, rank 1: 8)" in res["msg"]


def compiled_ignoring_the_result(backend):
    with ss.SymmetricBuffer(1 << 16, backend="host") as buf, _made(buf) as a2a:
        me, w = buf.rank, buf.world_size
        step = torch.compile(lambda t: (a2a(t), t + 1)[1], fullgraph=True, backend=backend)
        before = a2a.calls.calls
        for _ in range(2):
            step(blocks(me, w))
        made = a2a.calls.calls - before
        right = torch.equal(a2a(blocks(me, w, 3)), received(me, w, 3))  # the members are in step
        return {"made": made, "right": right}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_graph_that_ignores_the_result_still_makes_the_call(host_ranks, backend):
    for res in host_ranks(compiled_ignoring_the_result, 2, backend):
        assert res == {"made": 2, "right": True}


def status_word():
    """The kernel launched without the host's settle: the status word holds the failure until it."""
    with ss.SymmetricBuffer(1 << 16, backend="host") as buf, _made(buf) as a2a:
        me, w = buf.rank, buf.world_size
        ok = int(a2a.status)
        out = torch.full((w * W_BLOCK,), 7.0)
        if me == 1:
            a2a.calls.stage("rank 1's planted refusal")
            a2a.launch(a2a.nothing, a2a.nothing, 0, ssl.REFUSED_HOST)
        else:
            a2a.launch(blocks(me, w), out, W_BLOCK, ssl.REFUSED_NONE)
        held = int(a2a.status)
        try:
            a2a.settle()
            settled = None
        except ss.PeerRefused as e:
            settled = e.reason
        return {"ok": ok, "held": held, "settled": settled, "after": int(a2a.status), "nan": bool(out.isnan().all())}


def test_the_status_word_holds_a_failed_call_until_the_host_settles_it(host_ranks):
    r0, r1 = host_ranks(status_word, 2)
    assert r0 == {"ok": 0, "held": 1, "settled": "rank 1's planted refusal", "after": 0, "nan": True}
    assert r1["held"] == 0 and r1["settled"] is None  # its own host refusal: its call raised at once


# ---------------------------------------------------------------------- bites
@triton.jit
def _no_wait(ptrs, cell, me, epoch, timeout_ns, record, SIZE, TRAP):
    return 0


@triton.jit
def _always_ok(calls, me, n, KIND, a, b, c, d, refused, SIZE):
    return 0, -1


def bitten(which):
    """The tutorial's kernel with one part taken away (the interpreter reads a kernel's module
    attributes when it runs): ``"wait"``, or ``"check"`` (the header check)."""
    if which == "wait":
        ssl.wait_or_trap = _no_wait
    else:
        ssl.check_call = _always_ok
    with ss.SymmetricBuffer(1 << 16, backend="host") as buf:
        a2a = _made(buf)
        me, w = buf.rank, buf.world_size
        out = torch.full((w * W_BLOCK,), 7.0)
        if which == "wait":
            if me == 1:
                time.sleep(1.0)  # rank 0 reads its slots before rank 1 stored
            try:
                a2a(blocks(me, w), out=out)
                right = torch.equal(out, received(me, w))
            except ss.CallMismatch:  # rank 1's header was not there yet either: the test fails all the same
                right = False
        else:
            a2a(blocks(me, w, 0), out=out)  # a good call: the slots hold its blocks
            try:
                a2a(blocks(me, w, 1).double() if me == 1 else blocks(me, w, 1), out=out)
            except ss.InputError:
                pass
            right = bool(out.isnan().all()) if me == 0 else True
        a2a.close(together=False)  # a member's object may have failed (the protocol is broken here)
        dist.barrier()
        return right


@pytest.mark.parametrize("which", ["wait", "check"])
def test_the_oracles_bite_without_the_wait_or_the_header_check(which):
    results = run(bitten, 2, which, timeout_s=120)
    assert not all(results), f"without the {which}, the oracle still passed: it cannot catch its absence"


# ---------------------------------------------------------------------- close after a failure
def close_after_a_death():
    with ss.SymmetricBuffer(1 << 16, backend="host") as buf:
        a2a = _made(buf)
        me, w = buf.rank, buf.world_size
        dist.barrier()
        if me == 1:
            os._exit(3)
        try:
            a2a(blocks(me, w))
            raised = None
        except ss.PeerAborted as e:
            raised = type(e).__name__
        t0 = time.monotonic()
        a2a.close()  # the view failed: this rank's part only, no barrier with a dead member
        return {"raised": raised, "close_s": time.monotonic() - t0, "closed": a2a.closed}


def test_close_after_a_member_died_releases_this_rank_s_part_without_a_collective_step():
    r0, died = run(close_after_a_death, 2, may_die=[1], timeout_s=120)
    assert died == Died(1, 3)
    assert r0["raised"] == "PeerAborted" and r0["closed"] and r0["close_s"] < 5, r0
