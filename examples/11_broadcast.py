"""Tutorial 11: a consumer of your own, a broadcast, built from symmsync's building blocks.

    python examples/11_broadcast.py                  # host backend: 2 processes, no GPU needed
    python examples/11_broadcast.py --backend cuda   # one GPU per rank (or SYMMSYNC_SHARE_GPUS=1)
    torchrun --nproc-per-node 2 examples/11_broadcast.py

Every member gets the root's tensor. Made collectively (checked, agreed, its bytes claimed),
called eagerly and compiled, closed, and failing closed: a bad input on one member raises there
and reaches every other member as PeerAborted naming it.
"""

# --8<-- [start:consumer]
import argparse

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync.core.consumer import Consumer, Making
from symmsync.ops import handles
from symmsync.testing import is_main_process, run


class Broadcast(Consumer):
    """``bc(x)``: every member of ``view`` returns the root's ``x`` (``numel`` up to ``max_numel``)."""

    _NAME = "Broadcast"

    def __init__(self, view, max_numel, dtype, *, root=0, offset=0, channel=0, timeout_s=None):
        # 1. This rank's problems (the first one counts): its arguments, its fence, the bytes it claims.
        make = Making(self._NAME, view)
        make.ints(max_numel=(max_numel, 1, None), root=(root, 0, view.size - 1))
        if make.ok and not isinstance(dtype, torch.dtype):
            make.check(f"dtype must be a torch.dtype, got {dtype!r}")
        if make.offset(offset):
            nbytes = max_numel * dtype.itemsize
            make.fits(offset, nbytes, "pass a larger SymmetricBuffer, or lower max_numel")
            make.claim(f"Broadcast (view {list(view.ranks)}, channel {channel})", offset, offset + nbytes)
        fence = make.fence(channel, timeout_s)
        # 2. One exchange: every rank raises the first rank's problem, or a difference among the members.
        make.agree({"max_numel": max_numel, "dtype": str(dtype), "root": root, "offset": offset, "channel": channel})
        # 3. Made everywhere: claim the bytes (released by close()), register its failures, name it to its op.
        self._made(make, f"Broadcast (channel {channel})", memory=f"the broadcast's memory on {view.buffer.device}",
                   no_grad="the broadcast has")  # fmt: skip
        self.fence, self.dtype, self.root, self.offset, self.max_numel = fence, dtype, root, offset, max_numel

    def __call__(self, x):
        if torch.compiler.is_compiling():  # a graph holds no Python object: the op names it by an int
            return torch.ops.tutorial.broadcast(x, self.op_handle)
        return self.eager(x)

    def eager(self, x):
        self.check_usable()  # closed, failed, or its view aborted: raise before any wait
        bad = self.tensor_problem("x", x, dtype=self.dtype)
        if bad is None and x.numel() > self.max_numel:
            bad = f"x has {x.numel()} elements, more than max_numel={self.max_numel}"
        if bad is not None:  # fail closed: InputError here, PeerAborted naming this rank on the members
            self.refuse(bad)
        slot = self._buffer.tensor(self.offset, (x.numel(),), self.dtype, rank=self.view.ranks[self.root])
        if self.view.local_index == self.root:
            slot.copy_(x.reshape(-1))  # the root writes its own slot
        self.fence.fence()  # ... visible to every member once it returns
        out = slot.clone().view(x.shape)  # every member reads the root's slot
        self.fence.fence()  # every read is over before the root's next call overwrites the slot
        return out


@torch.library.custom_op("tutorial::broadcast", mutates_args=())
def _broadcast_op(x: torch.Tensor, handle: int) -> torch.Tensor:
    return handles.lookup(handle, Broadcast).eager(x)


@_broadcast_op.register_fake
def _(x, handle):
    return torch.empty_like(x)
    # --8<-- [end:consumer]


# --8<-- [start:use]
def main(backend):
    with ss.SymmetricBuffer(4096, backend=backend) as buf:
        view = buf.view(list(range(buf.world_size)))
        me, lines = buf.rank, []
        with Broadcast(view, 256, torch.float32, root=1, channel=0) as bc:
            x = torch.arange(8, dtype=torch.float32, device=buf.device) + 100 * me
            assert torch.equal(bc(x).cpu(), torch.arange(8.0) + 100), bc(x)  # the root's x
            compiled = torch.compile(lambda t: bc(t * 2), fullgraph=True, backend="aot_eager")
            assert torch.equal(compiled(x).cpu(), 2 * (torch.arange(8.0) + 100))
            lines.append(f"rank {me}: the root's 8 values, eagerly and compiled")
        # Closed: its bytes are free at once; a new broadcast of another dtype takes them.
        bc = Broadcast(view, 256, torch.float16, root=0)
        try:
            bc(torch.ones(4, dtype=torch.float64 if me == 1 else torch.float16, device=buf.device))
        except ss.InputError as e:  # the member whose input was bad
            lines.append(f"rank {me}: InputError: {str(e).split(': ', 2)[2]}")
        except ss.PeerAborted as e:  # every other member, at once: it names that member
            lines.append(f"rank {me}: PeerAborted naming rank {sorted(e.aborted)}")
        dist.barrier()
        return lines
    # --8<-- [end:use]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="host", choices=["host", "cuda"])
    results = run(main, 2, parser.parse_args().backend, backend=parser.parse_args().backend)
    if is_main_process():
        print("\n".join(line for lines in results for line in lines))
