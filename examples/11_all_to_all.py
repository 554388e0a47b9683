"""Tutorial 11: a consumer of your own, an all-to-all of equal blocks, on symmsync's consumer kit.

    python examples/11_all_to_all.py                  # host backend: 2 processes, no GPU needed
    python examples/11_all_to_all.py --backend cuda   # one GPU per rank (or SYMMSYNC_SHARE_GPUS=1)
    torchrun --nproc-per-node 2 examples/11_all_to_all.py

Member i's block j lands in member j's output as block i. One kernel launch per call: the stores
to the peers, the call header, the fence and the reads. A bad input on one member fails that call
on every member (InputError there, PeerRefused naming it elsewhere, NaN in every output) and the
next call goes on; members whose sizes differ raise CallMismatch; it runs compiled, and closes.
"""

# --8<-- [start:consumer]
import argparse

import torch
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync.testing import is_main_process, run

ALL_TO_ALL = tl.constexpr(0)  # the kind of call this consumer's header carries (it has one)


@triton.jit
def all_to_all_kernel(
    x, out, n, refused, calls, data, cells, cell, me, timeout_ns, record, slots, stride,
    SIZE: tl.constexpr, BLOCK: tl.constexpr, TRAP: tl.constexpr,
):  # fmt: skip
    c = ssl.call_number(calls)  # this call's number: its slots' parity
    q = c % 2
    lanes = tl.arange(0, BLOCK)
    for p in tl.static_range(SIZE):  # my block p into member p's slot [q][me]
        dst = ssl.peer_ptr(data, p, slots + (q * SIZE + me) * stride, tl.float32)
        for i in range(0, n, BLOCK):
            tl.store(dst + i + lanes, tl.load(x + p * n + i + lanes, mask=i + lanes < n), mask=i + lanes < n)
    ssl.post_call(calls, me, c, ALL_TO_ALL, n, 0, 0, 0, refused, 0, 0, SIZE)  # my header, to every member
    tl.debug_barrier()  # every thread's stores before the release
    e = ssl.publish(cells, cell, me, SIZE)
    waited = ssl.wait_or_trap(cells, cell, me, e, timeout_ns, record, SIZE, TRAP)
    status, who = ssl.check_call(calls, me, c, ALL_TO_ALL, n, 0, 0, 0, refused, SIZE)
    good = (waited == 0) & (status == ssl.CALL_OK)
    for p in tl.static_range(SIZE):  # member p's block, from my slot [q][p]; NaN for a failed call
        src = ssl.peer_ptr(data, me, slots + (q * SIZE + p) * stride, tl.float32)
        for i in range(0, n, BLOCK):
            v = tl.load(src + i + lanes, mask=i + lanes < n)
            tl.store(out + p * n + i + lanes, tl.where(good, v, float("nan")), mask=i + lanes < n)
    ssl.end_call(calls, me, c, ALL_TO_ALL, status, who, SIZE, False)  # keep a failure, count the call


class AllToAll(ss.Consumer):
    """``a2a(x)``: ``x`` is ``view.size`` equal blocks (float32); block j goes to member j, and
    member i's block lands at block i of every member's result."""

    NAME = "AllToAll"
    KINDS = ("call",)
    WORDS = ("block",)

    def __init__(self, view, max_block, *, offset=0, channel=0, timeout_s=None):
        make = ss.Making(self.NAME, view)  # this rank's problems; the first one counts
        make.ints(max_block=(max_block, 1, None))
        stride = max_block * 4
        if make.offset(offset):  # two parities of one slot per member
            make.fits(offset, 2 * view.size * stride, "pass a larger SymmetricBuffer, or lower max_block")
            make.claim(f"AllToAll (view {list(view.ranks)})", offset, offset + 2 * view.size * stride)
        fence = make.fence(channel, timeout_s)
        make.agree({"max_block": max_block, "offset": offset, "channel": channel})  # every rank raises, or none
        self.made(make, memory=f"the all-to-all's memory on {view.buffer.device}", no_grad="the all-to-all has")
        self.max_block, self.fence = max_block, fence
        self.nothing = torch.empty(0, device=view.buffer.device)  # what a refused call sends
        self.launch = self.bind(  # packed once; a call passes x, out, n (and its refusal, last)
            all_to_all_kernel,
            per_call=("x", "out", "n"),
            data=view.ptrs,
            **fence.kernel_kwargs,
            slots=offset,
            stride=stride,
            SIZE=view.size,
            BLOCK=128,
            TRAP=view.buffer.capabilities.traps,
        )

    def __call__(self, x, out=None):
        if torch.compiler.is_compiling():  # a graph names the object by an int
            if out is not None:  # the op returns a new tensor: never drop an out= silently
                raise ss.ConfigError(f"rank {self.rank}: AllToAll under torch.compile: out= is eager-only")
            return all_to_all_op(x, self.op_handle)
        return self.eager(x, out)

    def eager(self, x, out=None):
        bad = self.tensor_problem("x", x, dtype=torch.float32)
        if bad is None and (x.numel() % self.view.size or x.numel() > self.view.size * self.max_block):
            bad = f"x has {x.numel()} elements: not {self.view.size} blocks of at most {self.max_block}"
        if bad is None and out is not None:
            bad = self.tensor_problem("out", out, dtype=torch.float32, numel=x.numel(), apart=dict(x=x))
        if bad is not None:  # the call is made all the same: it sends nothing, and fails on every member
            return self.run(self.launch, self.nothing, self.nothing, 0, problem=bad)
        out = torch.empty_like(x) if out is None else out
        self.run(self.launch, x, out, x.numel() // self.view.size)
        return out


all_to_all_op = ss.define_op(  # side-effecting: a compiled graph never drops it
    "tutorial::all_to_all",
    "(Tensor x, int handle) -> Tensor",
    lambda x, handle: AllToAll.from_handle(handle).eager(x),
    lambda x, handle: torch.empty_like(x),
)
# --8<-- [end:consumer]


# --8<-- [start:use]
def main(backend):
    with ss.SymmetricBuffer(1 << 16, backend=backend) as buf:
        view = buf.view(list(range(buf.world_size)))
        me, w, lines = buf.rank, buf.world_size, []
        with AllToAll(view, 64) as a2a:
            x = torch.arange(4.0 * w, device=buf.device) + 100 * me  # w blocks of 4
            want = torch.cat([torch.arange(4.0 * me, 4.0 * me + 4) + 100 * p for p in range(w)])
            assert torch.equal(a2a(x).cpu(), want)
            compiled = torch.compile(lambda t: a2a(t * 1), fullgraph=True, backend="aot_eager")
            assert torch.equal(compiled(x).cpu(), want)
            lines.append(f"rank {me}: block {me} of every member, eagerly and compiled")
            bad = x.double() if me == 1 else x  # a bad input on rank 1 fails this call on every member
            try:
                a2a(bad)
            except ss.InputError as e:
                lines.append(f"rank {me}: InputError: {str(e).split(': ', 2)[2].split(';')[0]}")
            except ss.PeerRefused as e:
                lines.append(f"rank {me}: PeerRefused: rank {e.origin} refused: {e.reason}")
            assert torch.equal(a2a(x).cpu(), want)  # the next call goes on
            lines.append(f"rank {me}: the next call is right")
        return lines
    # --8<-- [end:use]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="host", choices=["host", "cuda"])
    backend = parser.parse_args().backend
    results = run(main, 2, backend, backend=backend)
    if is_main_process():
        print("\n".join(line for lines in results for line in lines))
