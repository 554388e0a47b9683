"""Tutorial 9: one job as 2 nodes x 2 ranks: the node layout, a fence within a node, an exchange across nodes.

    python examples/09_nodes.py                   # host backend: 4 processes as 2 simulated nodes, no GPU needed
    python examples/09_nodes.py --backend cuda    # 4 ranks on the GPUs there are (2 per GPU on 2 GPUs)
    SYMMSYNC_NODE_SIZE=2 torchrun --nproc-per-node 4 examples/09_nodes.py   # torchrun's processes are the ranks

SYMMSYNC_NODE_SIZE=2 splits the job into nodes of 2 consecutive ranks (run() sets it for the
ranks it starts). Each rank writes into its node peer's memory and fences on its node's view;
an off-node peer's memory is refused; every rank's square crosses the nodes through OffNode;
an all-reduce over all 4 ranks sums within each node over peer memory, then across the nodes.
"""

# --8<-- [start:example]
import argparse
import os

import torch

import symmsync as ss
from symmsync import collectives as C
from symmsync.core.nodes import NODE_SIZE_ENV
from symmsync.spanning.exchange import OffNode
from symmsync.testing import is_main_process, run


def two_nodes(backend: str) -> list[str]:  # runs on every rank, with torch.distributed initialized
    room = C.workspace_bytes(4, torch.float32, 4, "all_reduce", nodes=2)  # an all-reduce's, over 2 nodes
    plan = ss.carve(notes=16, all_reduce=room)  # each owner its own bytes, aligned
    with ss.SymmetricBuffer(plan.nbytes, backend=backend) as buf:  # maps only the peers of this rank's node
        me, nodes = buf.rank, buf.nodes
        mine = list(nodes.members_of(me))
        node = buf.view(mine)  # collective: every rank passes its own node's ranks
        peer = mine[1 - mine.index(me)]
        buf.tensor(0, (2,), torch.int64, rank=peer).fill_(10 * me + peer)  # into my node peer's memory
        ss.Fence(node, timeout_s=60).fence()  # its stores into mine are visible now
        got = int(buf.tensor(0, (2,), torch.int64)[0])
        far = (me + len(mine)) % buf.world_size  # my counterpart on the other node
        try:
            buf.tensor(0, (2,), torch.int64, rank=far)
            refused = "mapped?!"
        except ss.ViewError:
            refused = "refused (ViewError): not mapped here"
        spanning = buf.view(list(range(buf.world_size)))  # every rank: a view over both nodes
        everyone = OffNode(spanning, timeout_s=60)  # crosses nodes
        squares = [int(t) for t in everyone.all_gather(torch.tensor([me * me]))]  # gloo: CPU tensors
        ar = C.AllReduce(
            spanning, 4, torch.float32, offset=plan["all_reduce"], timeout_s=60
        )  # collective, like every constructor
        total = ar(torch.full((4,), float(me + 1), device=buf.device))  # (1 + 2) on node 0, (3 + 4) on node 1
        return [
            f"rank {me}: {nodes}; my node is {mine}",
            f"rank {me}: node peer {peer} wrote {got} into my memory",
            f"rank {me}: rank {far}'s memory is on node {nodes.node_of(far)}: {refused}",
            f"rank {me}: all_gather across the nodes: {squares}",
            f"rank {me}: all_reduce over 2 nodes: {total.tolist()}",
        ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="symmsync tutorial 9: 2 nodes x 2 ranks")
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 4))  # torchrun's ranks, else 4 processes that run() starts
    env = {NODE_SIZE_ENV: "2", "SYMMSYNC_SHARE_GPUS": "1"}  # 2 ranks per node; ranks may share a GPU
    results = run(two_nodes, world, args.backend, backend=args.backend, env=env, dist_backend="gloo")
    if is_main_process():  # under torchrun every rank gets the results: print them once
        for lines in results:
            print("\n".join(lines))
# --8<-- [end:example]
