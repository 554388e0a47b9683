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
from symmsync.checks import int_problem, tensor_problem
from symmsync.core import agreement
from symmsync.core.consumer import Consumer
from symmsync.core.regions import Region
from symmsync.ops import handles
from symmsync.testing import is_main_process, run


class Broadcast(Consumer):
    """``bc(x)``: every member of ``view`` returns the root's ``x`` (``numel`` up to ``max_numel``)."""

    def __init__(self, view, max_numel, dtype, *, root=0, offset=0, channel=0, timeout_s=None):
        buf = view.buffer
        # 1. This rank's problem, if any: its arguments, then the bytes it would claim.
        problem = int_problem("max_numel", max_numel, minimum=1) or int_problem("root", root, minimum=0)
        if problem is None and not isinstance(dtype, torch.dtype):
            problem = f"dtype must be a torch.dtype, got {dtype!r}"
        nbytes = max_numel * dtype.itemsize if problem is None else 0
        region = Region(f"Broadcast (view {list(view.ranks)}, channel {channel})", offset, offset + nbytes)
        if problem is None and root >= view.size:
            problem = f"root must be a member's index below {view.size}, got {root}"
        problem = problem or buf.regions.problem(region)
        fence, failed, error = agreement.attempt(lambda: ss.Fence(view, channel, timeout_s=timeout_s), buf.rank)
        # 2. One exchange: every rank raises the first rank's problem, or a difference among the members.
        same = agreement.Same(among=tuple(view.ranks), hint="every member passes the same")
        mine = {"max_numel": max_numel, "dtype": str(dtype), "root": root, "offset": offset, "channel": channel}
        agreement.agree(
            buf.group, "Broadcast", mine, problem=problem or failed, error=error, same=dict.fromkeys(mine, same)
        )
        # 3. Made everywhere: claim the bytes (released by close()), name the object to its torch op.
        self._buffer, self._claims = buf, (buf.regions.claim(region, self),)
        self.view, self.fence, self.dtype, self.root, self.offset = view, fence, dtype, root, offset
        self.max_numel = max_numel
        self.op_handle = handles.register(self)

    def __call__(self, x):
        if torch.compiler.is_compiling():  # a graph holds no Python object: the op names it by an int
            return torch.ops.tutorial.broadcast(x, self.op_handle)
        return self.eager(x)

    def eager(self, x):
        if self.closed:
            raise ss.ClosedError(f"rank {self._buffer.rank}: Broadcast: used after close()")
        dev = self._buffer.device
        bad = tensor_problem(
            "x",
            x,
            dtype=self.dtype,
            device_index=dev.index if dev.type == "cuda" else -1,
            memory=f"the broadcast's memory on {dev}",
            no_grad="the broadcast has",
        ) or int_problem("x.numel()", x.numel(), maximum=self.max_numel)
        if bad is not None:  # fail closed: the members stop waiting for a call this rank will not make
            err = ss.InputError(f"rank {self._buffer.rank}: Broadcast: {bad}")
            self.fence.abort(str(err))
            raise err
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
