"""A plain torchrun job (tests/core/test_refusals_torchrun.py runs it): a bad call on the last rank
fails that call on every rank, and the next calls go on. An all-reduce given float64, a MoE
dispatch given an expert id out of range (found on the device), and a PCP write given float32
rows, on the direct route and on the all-gather route (whose refusal travels in its exchange and
torch.distributed's store): the last rank raises its own error, the others ``PeerRefused`` naming
it; then every rank makes the good call, checked against plain torch. Each rank prints one line
per consumer.

    torchrun --nproc-per-node 2 tests/refusals_job.py
"""

import os

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives, moe, pcp
from symmsync.testing import is_main_process, run

E, M, H, K = 4, 4, 32, 2


def _raised(call, *args):
    try:
        call(*args)
        return "returned"
    except ss.PeerRefused as e:
        return f"PeerRefused(origin={e.origin})"
    except ss.SymmSyncError as e:
        return type(e).__name__


def rank_main() -> list[str]:
    world, rank = dist.get_world_size(), dist.get_rank()
    bad = rank == world - 1
    nbytes = moe.buffer_bytes(E * world, M, H, torch.bfloat16, K, world)
    per = collectives.workspace_bytes(64, torch.float32, world)
    layout = pcp.CacheLayout(num_blocks=1, num_layers=2, base=nbytes + per)
    gathered = pcp.CacheLayout(num_blocks=1, num_layers=2, base=layout.end)
    with ss.SymmetricBuffer(gathered.end) as buf:
        view = buf.view(list(range(world)))
        disp = moe.Dispatcher(view, E * world, M, H, torch.bfloat16, K)
        ar = collectives.AllReduce(view, 64, torch.float32, offset=nbytes, channel=1)
        writers = {
            "write": pcp.DirectKVWriter(view, layout, channel=2),
            "write (allgather)": pcp.DirectKVWriter(view, gathered, route="allgather", channel=3),
        }
        lines = []
        # the all-reduce
        x = torch.full((64,), float(rank + 1))
        got = _raised(ar, x.double() if bad else x)
        ok = bool((ar(x) == world * (world + 1) / 2).all())
        lines.append(f"rank {rank}: all-reduce: {got}; the next sums: {ok}")
        # the dispatch
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(M, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E * world, generator=g)[:K] for _ in range(M)])
        w = torch.rand(M, K, generator=g)
        wrong = ids.clone()
        wrong[0, 1] = E * world  # no expert has this id
        got = _raised(disp.dispatch, x, wrong if bad else ids)
        recv, _, handle = disp.dispatch(x, ids)
        y = disp.combine(recv, w, handle)  # every expert the identity: y = sum_k w[t, k] x[t]
        ok = torch.allclose(y.float(), (w.sum(1, keepdim=True) * x.float()).to(torch.bfloat16).float(), atol=2e-2)
        lines.append(f"rank {rank}: dispatch: {got}; the next layer right: {ok}")
        # the PCP write, on both routes
        rows = [torch.randn(2, d, generator=g).to(torch.bfloat16) for d in (512, 64, 128)]
        for name, writer in writers.items():
            batch = writer.prepare(torch.arange(2) + 2 * rank)
            got = _raised(writer.write, 0, rows[0].float() if bad else rows[0], *rows[1:], batch)
            writer.write(1, *rows, batch)
            writer.synchronize()
            dist.barrier()  # every member's write of layer 1 is over: every replica holds every row
            replicas = [None] * world
            dist.all_gather_object(replicas, writer.span(1).clone())
            ok = all(torch.equal(r, replicas[0]) for r in replicas) and all(
                bool(replicas[0][: 64 * 656].view(64, 656)[s].any()) for s in range(2 * world)
            )  # the main-KV region first (64 slots of 656 bytes): each row's bytes at its slot, in every replica
            lines.append(f"rank {rank}: {name}: {got}; the next layer in every replica alike: {ok}")
        return lines


if __name__ == "__main__":
    world = int(os.environ["WORLD_SIZE"])
    results = run(rank_main, world)
    if is_main_process():
        for lines in results:
            print("\n".join(lines))
