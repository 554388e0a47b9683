"""Nodes in a plain torchrun job: 4 processes split into 2 simulated nodes by the documented setting.

The job is started as users start theirs (``python -m torch.distributed.run
--nproc-per-node 4``, ``SYMMSYNC_NODE_SIZE=2`` in its environment, Triton's interpreter
left for ``import symmsync`` to turn on) and checked by its exit status and what each
rank printed: the layout, a fence on its node's view, and an exchange across nodes.
"""

import os

import pytest
from jobs import torchrun

JOB = """
import torch
import torch.distributed as dist

import symmsync as ss
from symmsync.spanning.exchange import OffNode

dist.init_process_group("gloo")
buf = ss.SymmetricBuffer(4096)
me = buf.rank
node = buf.view(list(buf.nodes.members_of(me)))
fence = ss.Fence(node, timeout_s=60)
peer = node.ranks[1 - node.local_index]
buf.tensor(0, (4,), torch.int32, rank=peer).fill_(10 + me)
fence.fence()
from_peer = buf.tensor(0, (4,), torch.int32).tolist()
off = OffNode(buf.view([0, 1, 2, 3]), timeout_s=60)
every = [int(t[0]) for t in off.all_gather(torch.tensor([me * me]))]
print(f"rank {me}: {buf.nodes}; node peer {peer} wrote {from_peer[0]}; all_gather {every}", flush=True)
buf.close()
dist.destroy_process_group()
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="the host backend needs /dev/shm")
def test_a_torchrun_job_runs_as_two_nodes_of_two_ranks(tmp_path):
    script = tmp_path / "nodes_job.py"
    script.write_text(JOB)
    proc = torchrun(script, nproc=4, timeout=280, SYMMSYNC_NODE_SIZE="2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(4):  # the ranks print into one pipe, unbuffered: look for each text (tests/jobs.py)
        said = f"rank {r}: 2 nodes: [0, 1] [2, 3]; node peer {r ^ 1} wrote {10 + (r ^ 1)}; all_gather [0, 1, 4, 9]"
        assert proc.stdout.count(said) == 1, proc.stdout
    assert proc.stdout.count("rank ") == 4, proc.stdout
