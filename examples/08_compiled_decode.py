"""Tutorial 8: a compiled decode loop: the fused all-reduce + norm, the direct-KV writer and a fence.

    python examples/08_compiled_decode.py                  # host backend: 2 processes, no GPU needed
    python examples/08_compiled_decode.py --backend cuda   # one GPU per rank (needs 2 GPUs)
    torchrun --nproc-per-node 2 examples/08_compiled_decode.py   # torchrun's processes are the ranks

A decode step of a 2-layer model stand-in, compiled whole with
``torch.compile(fullgraph=True)`` (Inductor, the default backend). Each layer sums the
ranks' partial outputs with the fused all-reduce + residual add + RMS norm, writes this
rank's share of the step's keys and values into every rank's cache replica (the PCP
direct-KV writer), lets an attention stand-in read the local replica, and fences. The
same loop then runs eagerly from the same start, and every rank checks that each step's
output and the whole cache at the end are the same bits.
"""

# --8<-- [start:imports]
import argparse
import os

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives, pcp
from symmsync.testing import is_main_process, run

HIDDEN, LAYERS = 512, 2  # the writer's kv_c row is 512 values: a layer's normed output is its K/V stand-in
ROWS = (2, 3)  # tokens per rank in a step, changing from step to step (never 1: Dynamo specializes it)
STEPS = 6
# --8<-- [end:imports]


# --8<-- [start:setup]
class Model:
    """Everything the compiled step calls, made once, before anything is compiled."""

    def __init__(self, backend: str, steps: int):
        world = dist.get_world_size()
        numel = max(ROWS) * world * HIDDEN  # the largest step's all-reduce
        slots = steps * max(ROWS) * world  # every step's tokens take fresh slots
        caches = pcp.CacheLayout(num_blocks=-(-slots // 64), num_layers=LAYERS)  # its size: caches.nbytes
        # Each owner its own bytes, aligned: the all-reduce's workspace, then the caches.
        plan = ss.carve(all_reduce=collectives.workspace_bytes(numel, torch.float32, world), caches=caches.nbytes)
        self.layout = pcp.CacheLayout(num_blocks=caches.num_blocks, num_layers=LAYERS, base=plan["caches"])
        self.buf = ss.SymmetricBuffer(plan.nbytes, backend=backend)
        view = self.buf.view(list(range(world)))
        # Collective constructors: every rank, same order, before compiling (or capturing). The
        # budget of a wait covers a peer still compiling: the first compiled call waits for it.
        self.ar = collectives.AllReduce(
            view, numel, torch.float32, offset=plan["all_reduce"], channel=0, timeout_s=120.0
        )
        self.writer = pcp.DirectKVWriter(view, self.layout, channel=1, timeout_s=120.0)
        g = torch.Generator().manual_seed(0)  # the same norm weights on every rank
        self.norm = [(1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(self.buf.device) for _ in range(LAYERS)]
        self.start = ss.Fence(view, channel=2)  # for the eager start of a loop

    def clear(self) -> None:
        """Zero this rank's replica of every layer, then fence: every replica starts empty."""
        for layer in range(LAYERS):
            self.layout.layer_backing(self.buf, layer).zero_()
        self.start.fence()
        # --8<-- [end:setup]


# --8<-- [start:step]
def decode_step(model: Model, hidden, residual, batch: pcp.Batch, every_slot):
    """One decode step of every layer. ``hidden``: this rank's partial output of the step's
    tokens (rank r owns the r-th equal share of them); ``every_slot``: the step's slots."""
    world, rank = model.buf.world_size, model.buf.rank
    for layer in range(LAYERS):
        # The tensor-parallel sum of the partial outputs, the residual add and the RMS norm: one launch.
        y, residual = model.ar(hidden, residual=residual, norm_weight=model.norm[layer], eps=1e-6)
        kv = y.unflatten(0, (world, -1))[rank].to(torch.bfloat16)  # my tokens' K/V (stand-in: the normed output)
        model.writer.write(layer, kv, kv[:, :64].contiguous(), kv[:, :128].contiguous(), batch)
        main_kv, _indexer_k = model.writer.caches(layer)  # my replica, as attention reads it
        seen = main_kv.view(-1, main_kv.shape[-1])[every_slot]  # every rank's rows of this step, as stored
        context = seen[:, :HIDDEN].float().sum(dim=0)  # attention stand-in: exact (sums of small integers)
        model.writer.fence.fence()  # every member has read this layer's rows before any goes on
        hidden = y + context * 2.0**-16  # the next layer's partial output (a product by a power of two: exact)
    return hidden, residual
    # --8<-- [end:step]


# --8<-- [start:loop]
def decode_loop(model: Model, step_fn, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``steps`` decode steps through ``step_fn``; returns every step's output and the final caches."""
    rank, world, dev = model.buf.rank, model.buf.world_size, model.buf.device
    model.clear()
    outputs = []
    for step in range(steps):
        rows = ROWS[step % len(ROWS)]
        tokens = rows * world
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank's own partial output
        hidden = torch.randn(tokens, HIDDEN, generator=g).to(dev)
        residual = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(step)).to(dev)
        every_slot = torch.arange(step * max(ROWS) * world, step * max(ROWS) * world + tokens, device=dev)
        # Collective, once per batch, outside the compiled code: rank r owns the r-th share of the tokens.
        batch = model.writer.prepare(every_slot[rank * rows : (rank + 1) * rows])
        for t in (hidden, residual, batch.slots, every_slot):
            torch._dynamo.mark_dynamic(t, 0)  # the token count changes: compile once for every count
        out, _ = step_fn(model, hidden, residual, batch, every_slot)
        outputs.append(out.cpu())
    caches = [cache.cpu().clone() for layer in range(LAYERS) for cache in model.writer.caches(layer)]
    return outputs, caches
    # --8<-- [end:loop]


# --8<-- [start:compare]
def compiled_against_eager(backend: str, steps: int = STEPS) -> list[str]:
    model = Model(backend, steps)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(decode_step, fullgraph=True)  # Inductor
    with torch.no_grad():  # inference: the ops have no autograd formula
        got, got_caches = decode_loop(model, compiled, steps)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        want, want_caches = decode_loop(model, decode_step, steps)  # the same loop, eagerly
    same = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, want))
    same_caches = all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))
    assert same and same_caches, (model.buf.rank, same, same_caches)
    assert graphs == 1, graphs  # one graph for every token count
    model.writer.fence.fence()  # nobody closes while a member still reads its replica
    model.buf.close()
    tokens = "/".join(str(r * dist.get_world_size()) for r in ROWS)
    return [
        f"rank {dist.get_rank()}: {steps} compiled decode steps of {LAYERS} layers ({tokens} tokens), "
        "one graph: outputs and caches bit for bit the eager loop's"
    ]
    # --8<-- [end:compare]


# --8<-- [start:main]
if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="symmsync tutorial 8: a compiled decode loop")
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 2))  # torchrun's ranks, else 2 processes that run() starts
    results = run(compiled_against_eager, world, args.backend, args.steps, backend=args.backend, timeout_s=900)
    if is_main_process():  # print once, also under torchrun
        for lines in results:
            print("\n".join(lines))
# --8<-- [end:main]
