"""The call header's host half: a consumer's header memory, its state on the device, and the
one reader of both. The device half, and the layout, are :mod:`symmsync.language.calls`.

A :class:`Calls` object is made by :meth:`symmsync.core.consumer.Consumer.made` for every
consumer over a view within one node, collectively (it allocates a little memory of its own
over the view's buffer group, as :class:`~symmsync.Signals` does). A consumer's kernels take
``calls.kernel_args`` (the handle) and call the header's device functions; its host reads what
they kept with :meth:`Calls.take` (after each launch on the host backend, at ``synchronize()``
on GPUs), and a runtime may read :attr:`Calls.status` on the device at any time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .. import language as ssl
from ..language import calls as L
from ..language import cells
from .agreement import barrier
from .memory import keep_alive


def own_memory(view: Any, nbytes: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A little memory of an object's own (its signal slots, its call headers), made over the
    view's buffer group (collective over it, as the object's construction) and zeroed on every
    member before any kernel can use it: ``(the SymmetricBuffer, its pointer table, the view's
    members' base addresses in view order, on the CPU)``. The view's members are on this rank's
    node (the caller refuses a view that spans nodes), so each base names mapped memory."""
    from .buffer import SymmetricBuffer  # the buffer module imports views, which this module's callers need first

    buf = view.buffer
    mem = SymmetricBuffer(nbytes, group=buf.group, device=buf.device, backend=buf.backend, max_views=1, channels=1)
    mem.local_memory()[:nbytes].zero_()  # CUDA memory starts undefined; nobody stores before the barrier
    if buf.capabilities.streams:
        torch.cuda.synchronize(buf.device)
    table = mem._ptrs
    return mem, table, table.cpu()[list(view.ranks)]


@dataclass(frozen=True)
class CallRecord:
    """The earliest failed call a consumer's state kept, read back (:meth:`Calls.take`).

    Attributes:
        status: :data:`~symmsync.language.calls.REFUSED`, ``MISMATCH`` or ``WAIT_FAILED``.
        number: the call's number (the calls this member made before it).
        kind: the consumer's kind of call (its ``KIND``).
        who: the member (view index) that refused first, or whose call differed first (-1: none).
        later: failed calls after it, before the host read it.
        headers: every member's header of the call, in view order (``HEADER_WORDS`` words each).
    """

    status: int
    number: int
    kind: int
    who: int
    later: int
    headers: list[list[int]]

    def words(self, member: int) -> list[int]:
        """Member ``member``'s size words (``a`` .. ``d``) of the call."""
        return self.headers[member][L.H_A : L.H_D + 1]

    def refusal(self, member: int) -> tuple[int, int, int, str]:
        """Member ``member``'s refusal: ``(code, where, value, reason)``; ``reason`` is the text its
        host staged (``REFUSED_HOST``), else empty."""
        h = self.headers[member]
        code = h[L.H_REFUSED]
        text = cells.decode_reason(h[L.H_REASON : L.H_REASON + cells.REASON_WORDS]) if code == L.REFUSED_HOST else ""
        return code, h[L.H_WHERE], h[L.H_VALUE], text


class Calls:
    """A consumer's call headers and its state (the kit's call protocol, host half).

    Args:
        view: the consumer's view (within one node). Collective over the view's buffer group.
        pinned: stage refusal reasons in pinned host memory (GPUs: a kernel reads them there).

    Attributes:
        state: this member's state words (device memory; :mod:`symmsync.language.calls`).
    """

    def __init__(self, view: Any, pinned: bool):
        size = view.size
        self.size = size
        self._memory, table, bases = own_memory(view, L.header_memory_bytes(size))
        device = view.buffer.device
        self.state = torch.zeros(L.state_words(size), dtype=torch.int64, device=device)
        self._reason = torch.zeros(cells.REASON_WORDS, dtype=torch.int64, pin_memory=pinned)
        head = torch.tensor([self.state.data_ptr(), self._reason.data_ptr()], dtype=torch.int64)
        self._handle = keep_alive(torch.cat([head, bases]).to(device), table, self.state, self._reason)
        assert self._handle.numel() == L.handle_words(size)
        self.status = self.state[L.S_STATUS : L.S_STATUS + 1]
        """This member's status word, on the device: 0 (:data:`~symmsync.language.calls.OK`) while every
        call since the host last settled went well, else the status of the earliest one that failed
        (1 refused, 2 the members' calls differed, 3 a wait failed): read it with a runtime's own
        device-to-host copy (of its sampled tokens, say) to know, without a synchronization, whether
        the outputs it holds are good."""
        self._read_status = self.status if self.state.is_cpu else None  # the host backend's cheap read
        barrier(view.buffer.group)  # every member's headers are zeroed before any member posts one

    @property
    def kernel_args(self) -> tuple[torch.Tensor]:
        """What a kernel takes: ``(calls,)``, the handle (:mod:`symmsync.language.calls`)."""
        return (self._handle,)

    def stage(self, problem: str) -> None:
        """Keep ``problem`` as this member's refusal reason: the next header posted with
        ``REFUSED_HOST`` carries it (host memory the kernel reads; a later stage before that kernel
        ran replaces it)."""
        self._reason.copy_(torch.tensor(cells.encode_reason(cells.REASON_ERROR, problem), dtype=torch.int64))

    def failed(self) -> bool:
        """Whether the state holds a failed call (host backend: one word read; GPUs: a copy that
        waits for the device)."""
        word = self._read_status if self._read_status is not None else self.status
        return int(word) != L.OK

    def take(self) -> CallRecord | None:
        """The earliest failed call kept (and the count of those after it), or ``None``; the state
        is cleared of it, so the next failure is kept anew (GPUs: call it after the device is
        synchronized)."""
        words = self.state.tolist()
        if words[L.S_STATUS] == L.OK:
            return None
        self.state[L.S_STATUS : L.S_LATER + 1].zero_()
        hw = L.HEADER_WORDS
        headers = [words[L.S_HEADERS + m * hw : L.S_HEADERS + (m + 1) * hw] for m in range(self.size)]
        return CallRecord(
            status=words[L.S_STATUS],
            number=words[L.S_NUMBER],
            kind=words[L.S_KIND],
            who=words[L.S_WHO],
            later=words[L.S_LATER],
            headers=headers,
        )

    @property
    def calls(self) -> int:
        """The calls made so far (GPUs: waits for the device)."""
        return int(self.state[L.S_CALLS])

    def close(self) -> None:
        """Release the header memory on this rank (needs no other rank). Idempotent."""
        self._memory.close()

    @property
    def closed(self) -> bool:
        return self._memory.closed


@triton.jit
def call_fence_kernel(
    calls, cells, cell, me, timeout_ns, record, a, b, c, d, refused,
    KIND: tl.constexpr, SIZE: tl.constexpr, TRAP: tl.constexpr,
):  # fmt: skip
    """A call's header and a whole fence, one program (:func:`symmsync.language.fence_call`): the
    fence of a call whose kernels fence apart (a consumer's unfused path), and what a member whose
    call is refused launches instead of its call's kernels (its header refused, nothing stored)."""
    ssl.fence_call(calls, cells, cell, me, timeout_ns, record, KIND, a, b, c, d, refused, SIZE, TRAP)
