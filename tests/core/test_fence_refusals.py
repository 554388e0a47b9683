"""``Fence.refuse()`` and ``Fence.refusals()``: a member's refused part of an epoch, read by the others.

World 3 on the host backend: rank 2 refuses its part of the second fence and rank 1 of the third;
every other fence is plain. After the fences, each rank's ``refusals()`` lists exactly the other
members' refused parts, ``(rank, epoch)`` in epoch order (its own left out), once: a second call
lists nothing. The bite: with the marks taken out of the refusing launch (a plain fence in its
place), no member sees a refusal and the test fails.
"""

import helpers
import pytest
import torch.distributed as dist
import triton
import triton.language as tl

import symmsync as ss
import symmsync.language as ssl
from symmsync.core import fence as fence_module

REFUSED = {2: 2, 3: 1}  # epoch: the rank that refuses its part of it


@triton.jit
def unmarked(ptrs, cell, me, timeout_ns, record, refused, SIZE: tl.constexpr, TRAP: tl.constexpr):
    """The refusing launch without its marks: a plain fence (the bite)."""
    e = ssl.publish(ptrs, cell, me, SIZE)
    ssl.wait_or_trap(ptrs, cell, me, e, timeout_ns, record, SIZE, TRAP)


def refusing(variant):
    swap = helpers.replaced(fence_module, **({"_refuse_kernel": unmarked} if variant else {}))
    with swap, ss.SymmetricBuffer(1024, backend="host") as buf:
        fence = ss.Fence(buf.view(list(range(buf.world_size))), timeout_s=60)
        for epoch in range(1, 5):
            if REFUSED.get(epoch) == buf.rank:
                fence.refuse()
            else:
                fence.fence()
        first, again = fence.refusals(), fence.refusals()
        dist.barrier()
        return first, again, fence.epoch


def _check(results):
    for rank, (first, again, epoch) in enumerate(results):
        want = [(r, e) for e, r in sorted(REFUSED.items()) if r != rank]
        assert first == want, (rank, first)
        assert again == [] and epoch == 4, (rank, again, epoch)


def test_each_member_reads_the_others_refused_parts_once(host_ranks):
    _check(host_ranks(refusing, 3, None))


def test_the_refusal_marks_bite(host_ranks):
    results = host_ranks(refusing, 3, "unmarked")
    with pytest.raises(AssertionError):
        _check(results)
