"""Fences on the host backend: the payload oracle, split phase, channels, epochs, timeouts.

The payload oracle: before fence ``e`` every rank writes ``stamp(e, i) = 1000 e + i``
into its slot ``i`` of every member's payload (double-buffered by epoch parity,
written by a Triton kernel through the view's pointer table); after the fence
every rank checks every slot of that epoch. Payload writes are delayed on some
ranks and fences, so a fence that did not wait would be caught reading stale slots
(``test_the_oracle_bites_without_the_wait`` proves it does get caught).
"""

import time
import types

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl
from helpers import need_gpus

import symmsync as ss
import symmsync.language as ssl
from symmsync.errors import BackendError
from symmsync.testing import run

N_FENCES = 200


@triton.jit
def stamp_kernel(ptrs, payload, me, epoch, SIZE: tl.constexpr):
    parity = epoch % 2
    for p in tl.static_range(SIZE):
        dst = ssl.peer_ptr(ptrs, p, payload, tl.int64)
        tl.store(dst + parity * SIZE + me, epoch * 1000 + me)


def _stamp(view, payload, epoch):
    stamp_kernel[(1,)](view.ptrs, payload, view.local_index, epoch, SIZE=view.size)


def _check(view, payload, epoch):
    got = view.tensor(payload, (2, view.size), torch.int64)[epoch % 2]
    want = torch.arange(view.size, dtype=torch.int64, device=got.device) + 1000 * epoch
    return int((got != want).sum())


def _delay(view, epoch):
    # Make one member late on some fences, so a fence that does not wait reads stale slots.
    if view.local_index == (epoch // 7) % view.size and epoch % 7 == 3:
        time.sleep(0.05)


def payload_oracle(n, mode, tp=None, backend="host"):
    """mode: 'fence' (one launch), 'split' (arrive, work, wait), 'overlap' (Fence.overlap around
    the work), 'nowait' (arrive only)."""
    buf = ss.SymmetricBuffer(1 << 14, backend=backend)
    view = ss.pcp_view(buf, tp=tp) if tp else buf.view(list(range(buf.world_size)))
    fence = ss.Fence(view, timeout_s=60)
    payload = 0
    errors = 0
    work = torch.zeros(64, device=buf.device)
    for e in range(1, n + 1):
        _delay(view, e)
        _stamp(view, payload, e)
        if mode == "fence":
            fence.fence()
        elif mode == "split":
            fence.arrive()
            work += torch.randn(64, device=buf.device)  # independent work between arrive and wait
            fence.wait()
        elif mode == "overlap":
            with fence.overlap():
                work += torch.randn(64, device=buf.device)
        else:
            fence.arrive()
        errors += _check(view, payload, e)
    dist.barrier()
    epoch = fence.epoch
    path = fence.launch_path
    buf.close()
    return {"errors": errors, "epoch": epoch, "ranks": list(view.ranks), "path": path}


def _on(backend, host_ranks, fn, world, *args):
    """``fn(*args, backend)`` on ``world`` ranks: the session's kept host ranks, or fresh GPU ranks."""
    if backend == "host":
        return host_ranks(fn, world, *args, backend)
    return run(fn, world, *args, backend, backend=backend)


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_sees_every_peers_payload_after_each_fence(world, backend, host_ranks):
    need_gpus(backend, world)
    for res in _on(backend, host_ranks, payload_oracle, world, N_FENCES, "fence", None):
        assert res["errors"] == 0
        assert res["epoch"] == N_FENCES
        if backend == "cuda":
            assert res["path"] == "cuda-python"  # the fast launch path, not Triton's launcher


def test_disjoint_subgroups_fence_independently_on_one_buffer(backend, host_ranks):
    need_gpus(backend, 4)
    results = _on(backend, host_ranks, payload_oracle, 4, N_FENCES, "fence", 2)
    for rank, res in enumerate(results):
        assert res["ranks"] == [rank % 2, rank % 2 + 2]
        assert res["errors"] == 0 and res["epoch"] == N_FENCES


@pytest.mark.parametrize("mode", ["split", "overlap"])
@pytest.mark.parametrize("world", [2, 4])
def test_split_phase_with_work_between_arrive_and_wait(mode, world, backend, host_ranks):
    if backend == "host" and world == 4:
        pytest.skip("on the host backend split phase runs at world 2 (fences at world 4: above)")
    need_gpus(backend, world)
    for res in _on(backend, host_ranks, payload_oracle, world, N_FENCES, mode, None):
        assert res["errors"] == 0 and res["epoch"] == N_FENCES


def test_the_oracle_bites_without_the_wait(host_ranks):
    results = host_ranks(payload_oracle, 2, 60, "nowait")
    assert sum(r["errors"] for r in results) > 0


def interleaved_channels(n, backend="host"):
    buf = ss.SymmetricBuffer(1 << 14, backend=backend, channels=2)
    view = buf.view(list(range(buf.world_size)))
    fences = [ss.Fence(view, channel=c, timeout_s=60) for c in (0, 1)]
    payloads = [0, 256]
    errors = 0
    for e in range(1, n + 1):
        for c in (0, 1):
            _delay(view, e + c)
            _stamp(view, payloads[c], e)
        fences[0].arrive()
        fences[1].fence()  # channel 1 completes while channel 0 is still open
        fences[0].wait()
        errors += _check(view, payloads[0], e) + _check(view, payloads[1], e)
    epochs = [f.epoch for f in fences]
    buf.close()
    return errors, epochs


@pytest.mark.parametrize("world", [2, 4])
def test_channels_interleave_without_interference(world, backend, host_ranks):
    if backend == "host" and world == 4:
        pytest.skip("on the host backend channels interleave at world 2")
    need_gpus(backend, world)
    for errors, epochs in _on(backend, host_ranks, interleaved_channels, world, 100):
        assert errors == 0 and epochs == [100, 100]


def one_rank_never_arrives(budget, absent, backend="host"):
    buf = ss.SymmetricBuffer(4096, backend=backend)
    view = buf.view(list(range(buf.world_size)))
    fence = ss.Fence(view, timeout_s=budget)
    fence.fence()  # everybody arrives once
    if buf.rank == absent:
        dist.barrier()  # never reaches the second fence; waits for the others to give up
        return None
    t0 = time.monotonic()
    try:
        fence.fence()
        fence.synchronize()  # GPU: the trap surfaces here, as a FenceTimeout
    except ss.FenceTimeout as e:
        elapsed = time.monotonic() - t0
        try:
            fence.fence()
        except ss.FenceTimeout as again:
            repeated = again is e
        dist.barrier()
        return {
            "elapsed": elapsed,
            "msg": str(e),
            "rank": e.rank,
            "late": e.late,
            "epoch": e.epoch,
            "repeated": repeated,
        }
    dist.barrier()
    return "no timeout"


@pytest.mark.traps  # the cuda case: the waiting kernels trap
@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_never_arrives_makes_the_others_time_out_naming_it(world, backend):
    # On GPUs the waiting kernels trap (raised as FenceTimeout at synchronize()), which
    # leaves their CUDA contexts unusable: the run's collectives stay on gloo.
    need_gpus(backend, world)
    budget = 2.0
    absent = world - 1
    results = run(
        one_rank_never_arrives, world, budget, absent, backend, backend=backend, dist_backend="gloo", timeout_s=180
    )
    assert results[absent] is None
    for rank in range(world - 1):
        r = results[rank]
        assert isinstance(r, dict), r
        assert budget <= r["elapsed"] < budget + 10
        assert r["rank"] == rank and r["epoch"] == 2 and r["late"] == {absent: 1}
        assert f"rank {absent} (its slot holds epoch 1)" in r["msg"] and "epoch 2" in r["msg"]
        assert r["repeated"]  # a timed-out fence stays failed: it never runs on stale data


# ---------------------------------------------------------------------- what a kernel is handed
@triton.jit
def _publish_wait_kernel(ptrs, cell, me, timeout_ns, record, status, SIZE: tl.constexpr):
    e = ssl.publish(ptrs, cell, me, SIZE)
    tl.store(status, ssl.wait_or_trap(ptrs, cell, me, e, timeout_ns, record, SIZE, False))


def kernel_args_drive_a_kernel(rounds, backend="host"):
    buf = ss.SymmetricBuffer(4096, backend=backend)
    view = buf.view(list(range(buf.world_size)))
    fence = ss.Fence(view)
    ptrs, *rest = fence.kernel_args
    same = ptrs is view.cell_ptrs and rest == [fence.cell, view.local_index, fence.timeout_ns, fence.record]
    status = torch.full((1,), -1, dtype=torch.int32, device=buf.device)
    statuses = []
    for _ in range(rounds):
        _publish_wait_kernel[(1,)](*fence.kernel_args, status, SIZE=view.size)
        statuses.append(int(status.item()))
    fence.fence()  # the kernel's epochs and the Fence's are one counter
    try:
        ss.Fence(view, timeout_s=True)
        refused = "accepted"
    except ss.ConfigError as e:
        refused = str(e)
    out = {
        "same": same,
        "statuses": statuses,
        "epoch": fence.epoch,
        "default_budget": fence.timeout_s == buf.capabilities.default_timeout_s,
        "refused": refused,
    }
    buf.close()
    return out


def test_fence_kernel_args_are_what_a_kernel_that_fences_takes(host_ranks):
    for rank, r in enumerate(host_ranks(kernel_args_drive_a_kernel, 2, 3)):
        assert r["same"] and r["statuses"] == [0, 0, 0] and r["epoch"] == 4, r
        assert r["default_budget"], r  # the default budget is the backend's capability
        assert r["refused"].startswith(f"rank {rank}: Fence: timeout_s must be"), r["refused"]


@triton.jit
def _clock_kernel(out):
    tl.store(out, ssl.clock_ns())
    tl.store(out + 1, ssl.clock_ns())


def test_clock_ns_is_the_public_monotonic_clock_of_the_budget():
    out = torch.zeros(2, dtype=torch.int64)
    before = time.monotonic_ns()
    _clock_kernel[(1,)](out)
    after = time.monotonic_ns()
    first, second = out.tolist()
    assert before <= first <= second <= after


@triton.jit
def _count_programs(out):
    tl.atomic_add(out, 1)


def test_a_launchers_grid_is_fixed_and_a_launch_may_pass_its_own():
    from symmsync.core.launch import Launcher

    out = torch.zeros(1, dtype=torch.int32)
    launcher = Launcher(_count_programs, (2,))
    launcher(out)
    launcher(out, grid=(3,))
    launcher.bind(out, grid=(4, 1))()
    bound = launcher.bind(out)
    bound()
    assert out.item() == 2 + 3 + 4 + 2
    assert launcher.grid == (2, 1, 1) and bound.grid == (2, 1, 1)
    with pytest.raises(AttributeError):
        launcher.grid = (5,)


@triton.jit
def _store_value(out, value):
    tl.store(out, value)


def test_a_bound_launch_passes_each_calls_arguments():
    from symmsync.core.launch import Launcher

    a, b = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    bound = Launcher(_store_value, (1,)).bind(a, 5, per_call=("out", "value"))
    assert bound.per_call == ("out", "value")
    bound(a, 5)
    bound(b, 7)
    bound(b, 7)  # nothing changed: the launch is the same
    assert (a.item(), b.item()) == (5, 7)
    fixed = Launcher(_store_value, (1,)).bind(a, 9, per_call=("value",))  # out is bound, value is passed
    fixed(11)
    assert a.item() == 11
    with pytest.raises(BackendError, match="a call passes 1 values"):
        fixed(11, 12)
    with pytest.raises(BackendError, match="per_call names"):
        Launcher(_store_value, (1,)).bind(a, 5, per_call=("nope",))


def test_a_bound_launch_keeps_no_tensor_a_call_passed():
    # What a call passes is not held once it returns (torch's CUDA graph trees refuse a recording
    # whose pool memory something outside the graph holds); what bind() fixed is.
    import gc
    import weakref

    from symmsync.core.launch import Launcher

    table = torch.zeros(1, dtype=torch.int64)
    bound = Launcher(_store_value, (1,)).bind(table, 5, per_call=("value",))
    out = torch.zeros(1, dtype=torch.int64)
    per_call = Launcher(_store_value, (1,)).bind(out, 5, per_call=("out", "value"))
    refs = [weakref.ref(out)]
    for _ in range(3):
        t = torch.zeros(1, dtype=torch.int64)
        refs.append(weakref.ref(t))
        per_call(t, 3)
        assert t.item() == 3
    del out, t
    gc.collect()
    assert [r() for r in refs] == [None] * 4
    bound(6)
    assert table.item() == 6


def _recording_packer(packings, launched):
    # The packing of the compiled path, stood in for by its seam (Launcher._packer): each
    # packed parameter records what it is set to, each packing is counted, and its launch
    # (cuLaunchKernel, stood in for) is recorded.
    class Cell:
        def __init__(self):
            self.writes = []

        value = property(lambda self: self.writes[-1], lambda self, v: self.writes.append(v))

    def packer(self, classes, raw):
        packings.append(list(raw))
        entry = types.SimpleNamespace(
            device_index=0,
            launch=lambda *args: launched.append(args) or (0,),
            function=None,
            block=32,
            shared=0,
            success=0,
        )
        return types.SimpleNamespace(cells={0: Cell(), 1: Cell()}, entry=entry, address=0)

    return packer


def test_a_bound_launch_repacks_only_the_arguments_that_changed(monkeypatch):
    from symmsync.core import launch
    from symmsync.core.launch import Launcher

    packings, launched = [], []
    monkeypatch.setattr(Launcher, "_packer", _recording_packer(packings, launched))
    monkeypatch.setattr(launch, "_cu_streams", {0: "stream"})
    a, b = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    bound = Launcher(_store_value, (1,)).bind(a, 5, per_call=("out", "value"))
    cells = bound._packed.cells
    bound(a[:2], 5, stream=0)  # the same address, dtype and int: nothing is repacked
    bound(a, 6, stream=0)  # a new int of the same class: only its cell
    bound(b, 6, stream=0)  # a new tensor of the same class: only its cell
    assert [c.writes for c in cells.values()] == [[b.data_ptr()], [6]] and len(packings) == 1
    assert len(launched) == 3
    bound(b, 2**40, stream=0)  # an int of another width selects another compiled variant
    assert len(packings) == 2 and packings[1] == [b.data_ptr(), 2**40] and len(launched) == 4


def test_a_bound_launch_packs_binds_and_launches_against_a_stub_compiled_kernel(monkeypatch):
    # The compiled path on a CPU: a stub stands for Triton's compiled kernel (its signature,
    # metadata and function handle) and for cuda-python's driver (cuLaunchKernel records the
    # parameters it is handed, read back from the packed ctypes array). Everything between
    # them is symmsync's own: _Compiled, _Packed, bind, a call's repacking, the launch.
    import ctypes

    from symmsync.core import launch

    def compiled_for(args):  # what Triton compiles: the int's width picks the variant (and its handle)
        bits = 32 if -(2**31) <= args[1] < 2**31 else 64
        return types.SimpleNamespace(
            metadata=types.SimpleNamespace(num_warps=2, shared=64, num_ctas=1),
            src=types.SimpleNamespace(signature={"out": "*i64", "value": f"i{bits}"}),
            function=bits,
        )

    triton_launches, launches = [], []

    def triton_launch(self, args, grid):
        triton_launches.append((list(args), grid))
        return compiled_for(args)

    def cu_launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        array = (ctypes.c_void_p * 4).from_address(params)  # out, value, the two scratch pointers
        out = ctypes.c_uint64.from_address(array[0]).value
        value = (ctypes.c_int32 if function == ("function", 32) else ctypes.c_int64).from_address(array[1]).value
        launches.append(((gx, gy, gz), (bx, by, bz), shared, stream, function, out, value))
        return (0,)

    drv = types.SimpleNamespace(
        CUfunction=lambda init_value: ("function", init_value),
        cuLaunchKernel=cu_launch,
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=0),
        CUstream=lambda init_value: ("stream", init_value),
    )
    monkeypatch.setattr(launch, "driver", lambda: drv)
    monkeypatch.setattr(launch.Launcher, "_triton_launch", triton_launch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launcher = launch.Launcher(_store_value, (3,), num_warps=2)
    launcher.interpreted = False  # as on a GPU: the first launch compiles, the next ones are packed
    a, b = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    bound = launcher.bind(a, 5, per_call=("out", "value"))
    assert not bound.packed
    bound(a, 5, stream=7)  # the first launch goes through Triton's launcher (it compiles) ...
    assert triton_launches == [([a, 5], (3, 1, 1))] and bound.packed and launcher.path == "triton"
    bound(a, 5, stream=7)  # ... the next one is cuLaunchKernel with the packed parameters
    assert launcher.path == "cuda-python" and launcher.fallback_reason == ""
    assert launches[-1] == ((3, 1, 1), (64, 1, 1), 64, ("stream", 7), ("function", 32), a.data_ptr(), 5)
    bound(a[:2], 5, stream=7)  # packs as before: nothing changes
    bound(b, 6, stream=7)  # the same classes: only the two cells change
    assert launches[-1][4:] == (("function", 32), b.data_ptr(), 6) and len(triton_launches) == 1
    bound(b, 2**40, stream=7)  # another int width: another compiled variant, through Triton once
    assert len(triton_launches) == 2 and triton_launches[1][0] == [b, 2**40] and len(launches) == 3
    bound(b, 2**40, stream=7)
    assert launches[-1][4:] == (("function", 64), b.data_ptr(), 2**40)
    bound(b, 6, stream=7)  # back to the first variant: packed again, no compile
    assert launches[-1][4:] == (("function", 32), b.data_ptr(), 6) and len(triton_launches) == 2
