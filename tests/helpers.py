"""Shared by the test modules (not a test module itself; test modules do not import each other).

* :func:`describe_error`: what a test reports about an error.
* Orderings between ranks without sleeps: :func:`wait_until` (a condition polled against a
  deadline), :func:`published` (what a member's slot in this rank's fence cell holds: it has
  published, and waits), :func:`announce` and :func:`await_announced` (a rank reached a step,
  through torch.distributed's store).
* :func:`need_gpus`: the skip of a ``cuda`` case that needs more GPUs than the ``backend``
  fixture's two; :func:`gpu_worlds`: the worlds a GPU test that scales with the world runs at.
* The GPU suite's CUDA-graph helper (:func:`capture`), its payload kernels, and the rank
  functions that the 2-GPU and the 4-GPU modules both run (:func:`graph_replay`,
  :func:`pcp_graph_replay`).
"""

import contextlib
import pickle
import time

import oracles
import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync import pcp
from symmsync.language import cells
from symmsync.testing import sharing_gpus


def describe_error(err: ss.FenceTimeout) -> dict:
    """A fence error's type, message and fields, picklable, to return from a rank process."""
    return {
        "type": type(err).__name__,
        "msg": str(err),
        "rank": err.rank,
        "epoch": err.epoch,
        "late": err.late,
        "aborted": err.aborted,
        "closed": err.closed,
        "is_timeout": isinstance(err, ss.FenceTimeout),
        "pickled": type(pickle.loads(pickle.dumps(err))).__name__,
    }


# ---------------------------------------------------------------------- orderings
def wait_until(condition, what: str, timeout_s: float = 60.0, poll_s: float = 0.002):
    """Poll ``condition()`` until it returns something true, and return that; fail after ``timeout_s``
    (an ``AssertionError`` saying it waited for ``what``), so that an ordering a test needs never hangs."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = condition()
        if got:
            return got
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}"
        time.sleep(poll_s)


def published(buf: ss.SymmetricBuffer, fence: ss.Fence, member: int) -> int:
    """How many times view member ``member`` has published to this rank on ``fence``'s channel: the
    count its slot in this rank's cell holds. A member whose count reached ``e`` is past the publish
    of its ``e``-th fence, so in (or entering) its wait for the others."""
    at = fence.cell + cells.SLOTS + 8 * member
    return int(buf.cell_memory()[at : at + 8].view(torch.int64).item()) & cells.COUNT_MASK


_ANNOUNCED: dict[str, int] = {}  # how many times this process announced or awaited each step


def _step_keys(step: str, ranks) -> list[str]:
    # Every rank counts its calls of a step (announcer and awaiter alike), so the n-th call on each
    # rank names the same keys: a pool's processes run one test after another without clearing the store.
    n = _ANNOUNCED[step] = _ANNOUNCED.get(step, 0) + 1
    return [f"tests/announced/{step}/{n}/{r}" for r in ranks]


def announce(step: str) -> None:
    """Tell the other ranks that this rank reached ``step`` (a key in torch.distributed's store)."""
    (key,) = _step_keys(step, [dist.get_rank()])
    dist.distributed_c10d._get_default_store().set(key, "1")


def await_announced(step: str, ranks, timeout_s: float = 60.0) -> None:
    """Wait until each of ``ranks`` has :func:`announce`-d ``step`` (failing after ``timeout_s``)."""
    store, keys = dist.distributed_c10d._get_default_store(), _step_keys(step, ranks)
    wait_until(lambda: store.check(keys), f"ranks {list(ranks)} to reach {step!r}", timeout_s)


# ---------------------------------------------------------------------- GPUs
def gpu_count() -> int:
    """NVIDIA GPUs torch sees (0 without a driver)."""
    try:
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no driver: no GPUs
        return 0


def need_gpus(backend: str, world: int) -> None:
    """Skip a ``cuda`` case of ``world`` ranks (one GPU each) where fewer GPUs exist.

    The ``backend`` fixture's ``cuda`` case needs 2 GPUs; a test at a larger world calls this."""
    if backend == "cuda" and gpu_count() < world and not sharing_gpus():
        pytest.skip(f"needs {world} NVIDIA GPUs, found {gpu_count()}: run `make test-gpu` on a {world}-GPU machine")


def need_nccl_in_capture(route: str, world: int) -> None:
    """Skip the PCP ``allgather`` route in a CUDA graph where ranks share a GPU: its all-gather is
    torch.distributed's, gloo there (NCCL refuses two ranks on one GPU), and gloo cannot be captured."""
    if route == "allgather" and gpu_count() < world:
        pytest.skip(
            "the allgather route captures torch.distributed's all-gather: with ranks sharing a GPU that is "
            "gloo, which a CUDA graph cannot hold (cudaErrorStreamCaptureInvalidated); needs a GPU per rank"
        )


def gpu_worlds(default: str = "2") -> list[int]:
    """The worlds a GPU test that scales with the world runs at: ``SYMMSYNC_GPU_WORLDS`` (for
    example ``2,4,8``; ``make test-gpu-shared`` sets it), else ``default``. A world larger than
    the GPUs there are skips unless the ranks share them (:func:`need_gpus`)."""
    import os

    return [int(w) for w in os.environ.get("SYMMSYNC_GPU_WORLDS", default).split(",") if w.strip()]


def capture(step, warmup=3):
    """Run ``step`` eagerly on a side stream (compiling everything), then capture it once in a
    CUDA graph (after a barrier, so every rank's warm-up is done); return the graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g


@contextlib.contextmanager
def replaced(module, **attrs):
    """``module``'s attributes replaced by ``attrs`` for the block, the shipped ones put back after
    (a kernel's protocol step swapped for a variant: Triton's interpreter resolves a kernel's module
    attributes when it runs, so the variant is what the kernels launched in the block run)."""
    shipped = {k: getattr(module, k) for k in attrs}
    for k, v in attrs.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in shipped.items():
            setattr(module, k, v)


def refusals_posted(posted=True):
    """The refusal records of the forms that span nodes (:class:`symmsync.spanning.refusals.Refusals`)
    as shipped, or with ``posted=False`` never posted (the bite: the members learn of no refusal)."""
    from symmsync.spanning.refusals import Refusals

    return replaced(Refusals) if posted else replaced(Refusals, post=lambda self, number, problem, note="": None)


def raised(call, *args):
    """What ``call(*args)`` did: ``("returned", "", None)``, or the symmsync error's type name,
    message and ``origin`` (the refusing member of a :class:`~symmsync.PeerRefused`)."""
    import symmsync as ss

    try:
        call(*args)
        return ("returned", "", None)
    except ss.SymmSyncError as e:
        return (type(e).__name__, str(e), getattr(e, "origin", None))


@triton.jit
def spin(ns):
    """Hold this program for ``ns`` nanoseconds of symmsync's clock (a late member, on either backend)."""
    start = ssl.clock_ns()
    now = start
    while now - start < ns:
        now = ssl.clock_ns()


@triton.jit
def stamp_next_epoch(ptrs, cell_ptrs, cell, payload, me, SIZE: tl.constexpr):
    """Write ``1000 e + me`` into slot ``me`` of every member's payload half ``e % 2``, where
    ``e`` is the epoch the next fence on ``cell`` publishes (read on the device: graph-safe)."""
    e = tl.load(ssl.epoch_ptr(cell_ptrs, cell, me)) + 1
    for p in tl.static_range(SIZE):
        dst = ssl.peer_ptr(ptrs, p, payload, tl.int64)
        tl.store(dst + (e % 2) * SIZE + me, e * 1000 + me)


@triton.jit
def check_current_epoch(ptrs, cell_ptrs, cell, payload, me, errors, SIZE: tl.constexpr):
    """Add to ``errors`` the slots of this rank's payload half ``e % 2`` that do not hold
    ``1000 e + slot`` for the current epoch ``e``."""
    e = tl.load(ssl.epoch_ptr(cell_ptrs, cell, me))
    idx = tl.arange(0, 32)
    own = ssl.peer_ptr(ptrs, me, payload, tl.int64)
    got = tl.load(own + (e % 2) * SIZE + idx, mask=idx < SIZE, other=0)
    bad = tl.sum(((got != e * 1000 + idx) & (idx < SIZE)).to(tl.int32), axis=0)
    tl.atomic_add(errors, bad)


def graph_replay(batches, per_batch):
    """Rank function (cuda backend): capture stamp, fence, check once; replay it
    ``batches`` x ``per_batch`` times; return per batch (epochs advanced, wrong reads so far)."""
    buf = ss.SymmetricBuffer(1 << 16, backend="cuda")
    view = buf.view(list(range(buf.world_size)))
    fence = ss.Fence(view, timeout_s=30)
    errors = torch.zeros(1, dtype=torch.int32, device=buf.device)
    args = (view.ptrs, view.cell_ptrs, fence.cell, 0, view.local_index)

    def step():
        stamp_next_epoch[(1,)](*args, SIZE=view.size)
        fence.fence()
        check_current_epoch[(1,)](*args, errors, SIZE=view.size)

    g = capture(step)
    log = []
    for _b in range(batches):
        before = fence.epoch
        for _ in range(per_batch):
            g.replay()
        fence.synchronize()
        log.append((fence.epoch - before, int(errors.item())))
    buf.close()
    return log


def pcp_graph_replay(route, fused, replays, tp=1):
    """Rank function (cuda backend): capture one prefill step (every layer's write) once,
    replay it on fresh inputs, one PCP member late each replay, and check every replica's
    raw bytes against the references right after the replay (no barrier before the check);
    return (per replay and layer: equal?, the writer's fence epoch or ``None``).

    With ``tp`` > 1 the ranks form TP×PCP: each TP rank writes only inside its PCP subgroup, and every
    subgroup gets a different prompt, so a byte that crossed subgroups would fail the oracle."""
    tokens, layers = 700, 2
    cache = oracles.Cache(num_blocks=tokens // 64 + 2, num_layers=layers, base=128)
    buf = ss.SymmetricBuffer(cache.end + 128, backend="cuda")
    buf.tensor(0, (buf.nbytes,), torch.uint8).fill_(oracles.POISON)
    view = ss.pcp_view(buf, tp=tp)
    world = dist.get_world_size()
    groups = [[k * tp + t for k in range(world // tp)] for t in range(tp)]
    group = dist.new_subgroups_by_enumeration(groups)[0] if tp > 1 else None
    writer = pcp.DirectKVWriter(view, cache.layout, route=route, fused=fused, group=group, timeout_s=30)
    split = pcp.pcp_split(tokens, view.size)
    me = view.local_index
    salt = 10_000 * view.ranks[0]  # one prompt per PCP subgroup
    static = [torch.zeros(split.tokens_per_rank, w, dtype=torch.bfloat16, device=buf.device) for w in (512, 64, 128)]
    _, _, _, slots = oracles.prompt(salt, tokens, cache.num_slots)
    batch = writer.prepare(split.local_slots(slots, me).to(buf.device))

    def step():
        for layer in range(layers):
            writer.write(layer, *static, batch)

    g = capture(step, warmup=1)
    ok = []
    for rep in range(replays):
        kv, pe, ix, _ = oracles.prompt(salt + 100 + rep, tokens, cache.num_slots, special=True)
        for dst, src in zip(static, (kv, pe, ix)):
            dst.copy_(split.local_rows(src, me))
        torch.cuda.synchronize()
        dist.barrier()  # every rank's inputs are in place, and every check of the last replay done
        if route == "direct" and me == oracles.delayed_writer(rep, 0, view.size):
            time.sleep(oracles.DELAY_S)  # a late peer: the others' replay must wait for its rows
        g.replay()
        if writer.fence is not None:
            writer.fence.synchronize()
        torch.cuda.synchronize()
        want = cache.expected_layer(kv, pe, ix, slots)  # the warm-up and every replay write the same slots
        for layer in range(layers):
            ok.append(torch.equal(cache.raw_layer(buf, layer), want))
    dist.barrier()  # nobody closes while a peer still checks
    epoch = writer.fence.epoch if writer.fence is not None else None
    buf.close()
    return ok, epoch


# ---------------------------------------------------------------------- planted failures
def grow_with_a_planted_failure(buf, nbytes: int, step: str = "map_chunk", failing_rank: int = 1) -> str | None:
    """``buf.grow(nbytes)`` with the backend's ``step`` raising on ``failing_rank``; the
    message of the :class:`~symmsync.BackendError` every rank must raise (``None`` if none did)."""
    be = buf._memory.data.backend
    real = getattr(be, step)

    def fail(*a, **k):
        raise OSError("planted failure")

    if buf.rank == failing_rank:
        setattr(be, step, fail)
    try:
        buf.grow(nbytes)
        return None
    except ss.BackendError as e:
        return str(e)
    finally:
        setattr(be, step, real)
