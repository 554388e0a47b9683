"""Tutorial 14: a sequence-parallel tensor-parallel MLP on symmsync.gemm, tile-signalled.

    python examples/14_tp_mlp.py                  # host backend: 2 processes, no GPU needed
    python examples/14_tp_mlp.py --backend cuda   # one GPU per rank (or SYMMSYNC_SHARE_GPUS=1)
    torchrun --nproc-per-node 2 examples/14_tp_mlp.py

Each member holds ``rows`` tokens of the sequence and a shard of the MLP's weights: the up
projection's columns, the down projection's rows. ``AllGatherMatmul`` gathers every member's
tokens and multiplies them by its columns in one launch; ``MatmulReduceScatter`` multiplies by
its rows and sums the partial products into the token owner's rows in one launch. Checked bit
for bit against plain torch on the whole sequence (integer-valued inputs: every sum is exact),
eagerly and compiled; then one member's bad input fails that call on every member and the next
call is right.
"""

# --8<-- [start:mlp]
import argparse

import torch

import symmsync as ss
from symmsync import gemm
from symmsync.testing import is_main_process, run


def weights(hidden, inter, size, dtype):
    """The whole MLP (the same on every member: one seed), and how it is split over the members."""
    g = torch.Generator().manual_seed(0)
    up = torch.randint(-1, 2, (hidden, inter), generator=g).to(dtype)
    down = torch.randint(-1, 2, (inter, hidden), generator=g).to(dtype)
    return up, down, up.chunk(size, dim=1), down.chunk(size, dim=0)


def reference(x_all, up_parts, down_parts, size, me):
    """The sharded MLP in plain torch, in the documented order: each member's partial product
    rounded to the dtype, the partials summed in float32 in member order, this member's rows."""
    dtype = x_all.dtype
    h = [torch.relu((x_all.float() @ u.float()).to(dtype)) for u in up_parts]
    partials = [(h_s.float() @ d.float()).to(dtype).float() for h_s, d in zip(h, down_parts)]
    total = partials[0]
    for p in partials[1:]:
        total = total + p
    return total.to(dtype).chunk(size)[me]


def main(backend, rows=16, hidden=64, inter=128, dtype=torch.bfloat16):
    w = torch.distributed.get_world_size()
    plan = ss.carve(  # each consumer's bytes, aligned: the buffer holds plan.nbytes
        ag=gemm.all_gather_matmul_bytes(w, rows, hidden, dtype),
        rs=gemm.matmul_reduce_scatter_bytes(w, rows, hidden, dtype),
    )
    with ss.SymmetricBuffer(plan.nbytes, backend=backend) as buf:
        view = buf.view(list(range(buf.world_size)))
        size, me, lines = view.size, buf.rank, []
        up, down, up_parts, down_parts = weights(hidden, inter, size, dtype)
        w1, w2 = up_parts[me].contiguous().to(buf.device), down_parts[me].contiguous().to(buf.device)
        ag_mm = gemm.AllGatherMatmul(view, rows, hidden, dtype, offset=plan["ag"])
        mm_rs = gemm.MatmulReduceScatter(view, rows, hidden, dtype, offset=plan["rs"])
        with ag_mm, mm_rs:

            def mlp(x):  # this member's tokens in, this member's tokens out
                return mm_rs(torch.relu(ag_mm(x, w1)), w2)

            g = torch.Generator().manual_seed(1)
            x_all = torch.randint(-2, 3, (size * rows, hidden), generator=g).to(dtype)
            x = x_all.chunk(size)[me].contiguous().to(buf.device)
            want = reference(x_all, up_parts, down_parts, size, me)
            assert torch.equal(mlp(x).cpu(), want)
            compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
            assert torch.equal(compiled(x).cpu(), want)
            lines.append(f"rank {me}: {size} x {rows} tokens through the MLP: bit for bit, eagerly and compiled")
            try:
                ag_mm(x.float() if me == 1 else x, w1)  # a bad input on rank 1 fails this call on every member
            except ss.InputError as e:
                lines.append(f"rank {me}: InputError: {str(e).split(': ', 2)[2].split(';')[0]}")
            except ss.PeerRefused as e:
                lines.append(f"rank {me}: PeerRefused: rank {e.origin} refused: {e.reason}")
            assert torch.equal(mlp(x).cpu(), want)  # the next call goes on
            lines.append(f"rank {me}: the next call is right")
        return lines
    # --8<-- [end:mlp]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="host", choices=["host", "cuda"])
    backend = parser.parse_args().backend
    results = run(main, 2, backend, backend=backend)
    if is_main_process():
        print("\n".join(line for lines in results for line in lines))
