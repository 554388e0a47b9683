"""Tutorial 13: transformers' Mixtral sparse-MoE block, expert-parallel on symmsync.moe.

    python examples/13_mixtral_ep.py                  # host backend: 2 processes, no GPU needed
    python examples/13_mixtral_ep.py --backend cuda   # one GPU per rank (SYMMSYNC_SHARE_GPUS=1: ranks share one)
    torchrun --nproc-per-node 2 examples/13_mixtral_ep.py --backend cuda   # torchrun's processes are the ranks

transformers' ``MixtralSparseMoeBlock`` with its experts split over the ranks in blocks (rank
``r`` owns experts ``[r E / W, (r + 1) E / W)``), each rank routing its own tokens with the
block's router, sending each token's rows to its experts' owners (``dispatch``), running the
experts it owns on what it received, and bringing the outputs back weighted (``combine``).
A shared MLP (as DeepSeek- and Qwen-style MoE layers have) runs while the rows travel
(``wait=False``). Every rank checks each layer bit for bit against transformers' unsharded
block on the same tokens plus the shared MLP, eagerly and, on GPUs, replayed from a CUDA graph
on new tokens (so new routings); then one rank passes a bad routing and every rank recovers as
docs/moe.md prescribes, the next layer exact again. Needs ``pip install symmsync[models]``.
"""

# --8<-- [start:imports]
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import symmsync as ss
from symmsync import moe
from symmsync.testing import is_main_process, run, under_torchrun

TOKENS = 6  # a rank's tokens in a layer (each rank its own)
LAYERS = 3  # layers run eagerly, and replays of the captured layer on GPUs
# --8<-- [end:imports]


# --8<-- [start:model]
def make_block(world: int, device):
    """A small Mixtral MoE block (top-2 of 2 experts a rank), and a shared MLP; seeded: the same
    weights on every rank."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    config = MixtralConfig(
        hidden_size=64, intermediate_size=96, num_local_experts=2 * world, num_experts_per_tok=2,
        experts_implementation="eager",  # transformers' loop over experts, which the oracle is
    )  # fmt: skip
    block = MixtralSparseMoeBlock(config).to(device).eval()
    for p in block.parameters():  # transformers leaves these to its model's initializer: give them values
        torch.nn.init.normal_(p, std=0.2)
    shared = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 64)).to(device).eval()
    return block, shared


def reference(block, shared, x):
    """transformers' unsharded block on this rank's tokens, plus the shared MLP."""
    return block(x.unsqueeze(0))[0] + shared(x)
    # --8<-- [end:model]


# --8<-- [start:layer]
class ExpertParallel:
    """The block's experts over the ranks: route, dispatch, run my experts, combine."""

    def __init__(self, block, shared, disp: moe.Dispatcher, rank: int, world: int):
        self.block, self.shared, self.disp = block, shared, disp
        per_rank = block.experts.num_experts // world
        self.mine = range(rank * per_rank, (rank + 1) * per_rank)

    def experts(self, recv, handle, padded: bool):
        """My experts on their received rows, with transformers' expert arithmetic.

        A GEMM's row can round differently with the number of rows it is given (on CPUs, below 8
        rows), so to compare bit for bit each expert runs on each source's rows as that rank's
        unsharded block runs it: the same rows, in transformers' order (by top-k position, then
        token; ``handle.src`` says which). ``padded``: one GEMM per expert over its whole region,
        as a runtime runs it and a CUDA graph must (the counts stay on the device; rows past them
        are not read): the same up to that rounding."""
        ex, out = self.block.experts, torch.zeros_like(recv)

        def mlp(g, rows):
            gate, up = F.linear(rows, ex.gate_up_proj[g]).chunk(2, dim=-1)
            return F.linear(ex.act_fn(gate) * up, ex.down_proj[g])

        if padded:
            for e, g in enumerate(self.mine):
                out[e] = mlp(g, recv[e])
            return out
        per_source, offsets = handle.per_source.tolist(), handle.offsets.tolist()
        for e, g in enumerate(self.mine):
            for s, n in enumerate(per_source[e]):
                if n <= 0:
                    continue
                rows = torch.arange(offsets[e][s], offsets[e][s] + n, device=recv.device)
                k = handle.src[e, rows] % self.block.top_k  # the row's top-k position
                rows = rows[torch.sort(k, stable=True).indices]  # transformers' order
                out[e, rows] = mlp(g, recv[e, rows])
        return out

    def __call__(self, x, padded: bool = False):
        _, weights, ids = self.block.gate(x)  # transformers' router: top-k ids and their weights
        pending = self.disp.dispatch(x, ids, wait=False)  # the rows travel ...
        shared = self.shared(x)  # ... while the shared MLP runs
        recv, counts, handle = pending.wait()
        y = self.disp.combine(self.experts(recv, handle, padded), weights, handle)
        return y + shared
        # --8<-- [end:layer]


# --8<-- [start:recover]
def refused_layer(layer: ExpertParallel, x, bad: bool) -> str:
    """A dispatch that one member refuses, and the layer's combine made on every member anyway
    (docs/moe.md, "A refused dispatch and the layer after it"): every member in step after it."""
    _, weights, ids = layer.block.gate(x)
    if bad:
        ids = ids.clone()
        ids[0, 0] = layer.block.experts.num_experts  # no such expert: found on the device
    try:
        recv, counts, handle = layer.disp.dispatch(x, ids)
    except (ss.InputError, ss.PeerRefused) as e:  # the refusing member; on the host backend every member
        seen = e
        try:
            layer.disp.combine(None, None, None)  # the layer's combine, with nothing: refused, as it says
        except ss.InputError:
            pass
    else:  # on GPUs (an id is checked on the device) the dispatch returned, with no rows: the combine gives NaN
        y = layer.disp.combine(layer.experts(recv, handle, padded=False), weights, handle)
        assert torch.isnan(y).all(), "a refused layer's output must not look like data"
        seen = None
    try:
        layer.disp.synchronize()  # on GPUs: the refusal found on the device, on every member
    except (ss.InputError, ss.PeerRefused) as e:  # InputError on the refusing member, PeerRefused elsewhere
        seen = seen or e
    assert seen is not None, "every member must learn of the refused dispatch"
    return f"{type(seen).__name__} naming rank {getattr(seen, 'origin', dist.get_rank())}"
    # --8<-- [end:recover]


# --8<-- [start:main_fn]
def mixtral_ep(backend: str) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else torch.device("cpu")
    block, shared = make_block(world, device)
    hidden, experts, top_k = 64, block.experts.num_experts, block.top_k
    buf = ss.SymmetricBuffer(moe.buffer_bytes(experts, TOKENS, hidden, torch.float32, top_k, world), backend=backend)
    disp = moe.Dispatcher(buf.view(list(range(world))), experts, TOKENS, hidden, torch.float32, top_k)
    layer = ExpertParallel(block, shared, disp, rank, world)
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own tokens
    fresh = lambda: torch.randn(TOKENS, hidden, generator=g).to(device)  # noqa: E731
    lines = []
    with torch.no_grad():  # inference: symmsync's ops have no autograd formula
        for n in range(LAYERS):
            x = fresh()
            assert torch.equal(layer(x), reference(block, shared, x)), f"rank {rank}: layer {n} differs"
        lines.append(f"rank {rank}: {LAYERS} layers, top-{top_k} of {experts} experts: bit for bit transformers'")
        if device.type == "cuda":  # the layer captured once, replayed on new tokens: new routings
            x = fresh()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                layer(x, padded=True)  # warm up before the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = layer(x, padded=True)
            drift = 0.0
            for n in range(LAYERS):
                x.copy_(fresh())
                graph.replay()
                got = y.clone()
                assert torch.equal(got, layer(x, padded=True)), f"rank {rank}: replay {n} differs from eager"
                want = reference(block, shared, x)
                drift = max(drift, (got - want).abs().max().item())
                assert drift <= 1e-4 * want.abs().max().item(), (rank, n, drift)
            lines.append(f"rank {rank}: the layer in a CUDA graph, {LAYERS} replays on new tokens: the eager bits")
            lines.append(f"rank {rank}: replays (one GEMM an expert): at most {drift:.1e} from transformers'")
        said = refused_layer(layer, fresh(), bad=rank == world - 1)
        lines.append(f"rank {rank}: a bad routing on rank {world - 1}: {said}; every member in step")
        x = fresh()
        assert torch.equal(layer(x), reference(block, shared, x)), f"rank {rank}: the layer after differs"
        lines.append(f"rank {rank}: the next layer: bit for bit again")
    disp.synchronize()
    disp.close()
    buf.close()
    return lines
    # --8<-- [end:main_fn]


# --8<-- [start:main]
if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="symmsync tutorial 13: Mixtral expert-parallel")
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    parser.add_argument("--ranks", type=int, default=2, help="the processes run() starts (not under torchrun)")
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.ranks  # torchrun's ranks, or run()'s
    results = run(mixtral_ep, world, args.backend, backend=args.backend, timeout_s=900)
    if is_main_process():  # print once, also under torchrun
        for lines in results:
            print("\n".join(lines))
# --8<-- [end:main]
