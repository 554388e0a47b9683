"""Where the cells and the signals' handle keep each field: the one source.

The buffer places cells with :class:`CellLayout`, and the kernels of
:mod:`symmsync.language` address their fields with the offsets below. The records a
failed wait writes are :mod:`symmsync.language.records`'. docs/fences.md and docs/signals.md show
the blocks below as written here.

A cell (the same byte offset in every member's memory, one per view and channel;
``view.cell_offset(channel)``)::

    --8<-- [start:cell]
    cell + EPOCH      (0)    int64 epoch      this rank's epoch counter for the channel
    cell + ARRIVALS   (8)    int64 arrivals   grid_fence(): programs of the current launch
                                              that arrived
    cell + REASON     (16)   int64 reason[REASON_WORDS]
                                              this rank's abort reason: code, text length,
                                              then REASON_TEXT_BYTES of UTF-8 (14 words,
                                              96 bytes of text; written once, before its
                                              abort flags). Code CLOSED, ERROR, or
                                              RELAYED + r: it gave up on rank r's abort,
                                              and the text is r's reason
    cell + SLOTS      (128)  int64 slot[n]    slot j: how many times member j published to
                                              this rank (its epoch, bits 0..62), bit 63
                                              (ABORT_FLAG) set once member j aborted
    cell + refused_offset(n) int64 refused[n][2]
                                              refused[j][e % 2] = e: member j refused its
                                              part of epoch e (Fence.refuse: stored before
                                              it publishes e, so a member whose wait for e
                                              passed reads it)
    --8<-- [end:cell]

``n`` is the buffer's world size (a view's member ``j`` uses slot ``j``). The first line
(``LINE`` bytes) is written by its own rank only; the slots, then the refusal marks, follow
on their own lines, so a peer's reduction never shares a cache line with the epoch. Two
refusal words per member suffice: a member is never more than one epoch ahead of a member
that has not published (its fence waits for it), so the marks of the epoch a reader has
waited for and of the next one never share a word.

The point-to-point signals of :class:`~symmsync.Signals` (symmsync/core/signals.py and the
signal primitives of :mod:`symmsync.language`) touch no fence cell: their slots live in a
buffer of their own. The handle a kernel takes (``Signals.kernel_args[0]``, int64 words, on
the buffer's device), and each member's signal memory::

    --8<-- [start:handle]
    handle     [nbytes, rank, size, slots, bases, record, state, inbox[size], data[size], cell[size]]
      nbytes     bytes of the view's user region (what debug mode checks peer offsets against)
      rank       this rank's global rank (what a failed check reports)
      bases      address of this member's own base array
      record     address of the Signals object's record: where a primitive that takes no
                 record argument (signal, read_signal, data_ptr, put_signal) reports a bad index
      state      0 while the object is usable; REASON_CLOSED once it (or its buffer) closed,
                 REASON_ERROR once this rank aborted the view (set by the host, in stream
                 order): every wait then fails at once, and signal and put_signal store nothing
      inbox[p]   member p's slot array (in its signal memory); first after the header, so
                 a signal or a wait finds a slot with one load from the handle
      data[p]    member p's user-region base (view.ptrs[p])
      cell[p]    member p's channel-0 cell of the view (its abort flags and reasons)
    memory     three int64 arrays per member, each padded to whole lines:
      inbox[q][s]  what member q signalled to this member on slot s (peers update it)
      base[q][s]   how much of inbox[q][s] this member's wait_count consumed (only it writes)
      kind[q][s]   debug mode only: 1 once member q SET slot s (wait_count refuses such a slot)
    --8<-- [end:handle]

A failed signal wait's record is :mod:`symmsync.language.records`'.
"""

from __future__ import annotations

#: Bytes of one line; cells and their slot arrays are padded to whole lines, and
#: :func:`symmsync.carve` aligns regions to it by default (what every consumer takes).
LINE = 128

#: Byte offsets inside a cell.
EPOCH = 0
ARRIVALS = 8
REASON = 16
SLOTS = LINE

#: int64 words of an abort reason: code, text length in bytes, then the UTF-8 text.
REASON_WORDS = 14
#: Bytes of reason text a cell holds (the words after the code and the length).
REASON_TEXT_BYTES = 8 * (REASON_WORDS - 2)
#: Reason codes (word 0 of a reason): the member closed its buffer; it failed (any other cause).
REASON_CLOSED, REASON_ERROR = 1, 2
#: Reason codes at or past it relay another member's abort: ``REASON_RELAYED + r`` is written by a
#: member that gave up on the view because it saw global rank ``r``'s abort, and its text is ``r``'s
#: reason as that member read it. A reader names ``r`` and that reason, never the relaying member
#: (which of several flagged members a wait reads is a race: the origin's news must not depend on it).
REASON_RELAYED = 1 << 16

#: The epoch ``close()`` stores in each of this rank's cells (``symmsync.core.memory.close_cells``):
#: a fence wait for an epoch at or past it is a wait through arguments kept past close, and
#: fails at once (status 2) whatever the slots hold. No real epoch gets there (2**62 fences).
CLOSED_EPOCH = 1 << 62

#: The abort flag of a slot: its sign bit. A slot that carries it is negative, so a plain
#: ``slot >= e`` never takes an abort for an arrival; the count is ``slot & COUNT_MASK``.
ABORT_FLAG = -(2**63)
#: The bits of a slot that count publishes.
COUNT_MASK = 2**63 - 1

assert REASON + 8 * REASON_WORDS <= LINE, "the reason must fit the cell's own line"


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m``."""
    return (x + m - 1) // m * m


def refused_offset(members: int) -> int:
    """Byte offset of the refusal marks in a cell of a group of ``members`` ranks (after the slots)."""
    return SLOTS + round_up(members * 8, LINE)


def cell_bytes(members: int) -> int:
    """Bytes of one cell in a group of ``members`` ranks (the epoch line, the slots, the refusal marks)."""
    return refused_offset(members) + round_up(members * 16, LINE)


class CellLayout:
    """Where the cell of each (view region, channel) lives in every rank's allocation.

    Args:
        base: byte offset of the first cell from the start of each rank's allocation.
        world_size: ranks of the buffer's group (a cell has one slot per rank).
        max_views: view regions.
        channels: cells per region.
    """

    def __init__(self, base: int, world_size: int, max_views: int, channels: int):
        self.base = base
        self.max_views = max_views
        self.channels = channels
        self.cell_bytes = cell_bytes(world_size)
        self.size = max_views * channels * self.cell_bytes
        self._taken = 0

    @property
    def regions_taken(self) -> int:
        """Regions handed out by :meth:`take_region` so far."""
        return self._taken

    def take_region(self) -> int | None:
        """The next free view region, or ``None`` when all are taken."""
        if self._taken >= self.max_views:
            return None
        self._taken += 1
        return self._taken - 1

    def cell(self, region: int, channel: int) -> int:
        """Byte offset of the cell, from the start of each rank's allocation."""
        return self.base + (region * self.channels + channel) * self.cell_bytes


def encode_reason(code: int, text: str) -> list[int]:
    """The :data:`REASON_WORDS` int64 words of an abort reason.

    ``text`` is kept to :data:`REASON_TEXT_BYTES` bytes of UTF-8: a longer one is cut at
    a character boundary and ends in "…", so a reader sees it was cut.
    """
    raw = text.encode("utf-8", "replace")
    if len(raw) > REASON_TEXT_BYTES:
        ellipsis = "…".encode()
        raw = raw[: REASON_TEXT_BYTES - len(ellipsis)].decode("utf-8", "ignore").encode("utf-8") + ellipsis
    padded = raw.ljust(REASON_TEXT_BYTES, b"\0")
    words = [int.from_bytes(padded[i : i + 8], "little", signed=True) for i in range(0, len(padded), 8)]
    return [code, len(raw), *words]


def decode_reason(words: list[int], closed: str = "closed") -> str:
    """The reason text of :func:`encode_reason`'s words (``closed`` for a closed buffer); for a
    relay (:data:`REASON_RELAYED`), the origin's reason (:func:`reason_origin` names the origin)."""
    code, n = words[0], words[1]
    if code == REASON_CLOSED:
        return closed
    if code not in (REASON_ERROR, REASON_CLOSED) and code < REASON_RELAYED or not 0 <= n <= REASON_TEXT_BYTES:
        return f"(no reason recorded: code {code})"
    raw = b"".join(w.to_bytes(8, "little", signed=True) for w in words[2:REASON_WORDS])
    text = raw[:n].decode("utf-8", "replace") or "(no reason given)"
    return closed if code >= REASON_RELAYED and text == "closed" else text


def reason_origin(words: list[int]) -> int | None:
    """The global rank whose abort the reason ``words`` relay (:data:`REASON_RELAYED`), or ``None``
    for a member's own reason."""
    return words[0] - REASON_RELAYED if words[0] >= REASON_RELAYED else None


# ---------------------------------------------------------------------- point-to-point signals
# The handle's and the signal memory's geometry: the module docstring has the layout.

#: Word indices of the handle's header, and where its first table starts (plus the member index).
HANDLE_NBYTES, HANDLE_RANK, HANDLE_SIZE, HANDLE_SLOTS, HANDLE_BASES, HANDLE_RECORD, HANDLE_STATE = 0, 1, 2, 3, 4, 5, 6
HANDLE_INBOX = 7


def handle_data(size: int) -> int:
    """Word index of ``data[0]`` in the handle of a view of ``size`` members."""
    return HANDLE_INBOX + size


def handle_cell(size: int) -> int:
    """Word index of ``cell[0]`` in the handle of a view of ``size`` members."""
    return HANDLE_INBOX + 2 * size


def handle_words(size: int) -> int:
    """int64 words of the handle of a view of ``size`` members."""
    return HANDLE_INBOX + 3 * size


def inbox_bytes(size: int, slots: int) -> int:
    """Bytes of one of a member's two signal arrays (``size`` peers × ``slots``), line padded."""
    return round_up(size * slots * 8, LINE)


def signal_memory_bytes(size: int, slots: int) -> int:
    """Bytes of a member's signal memory: the inbox, the bases, then the kinds (debug mode)."""
    return 3 * inbox_bytes(size, slots)


#: The primitives an index record names (``symmsync.language.records``' misuse record), in this order,
#: and the kinds of index they check.
PRIMITIVES = (
    "signal",
    "wait_signal",
    "wait_count",
    "read_signal",
    "put_signal",
    "data_ptr",
    "publish",
    "pending",
    "wait",
    "mark_abort",
    "publish_and_wait",
    "wait_or_trap",
    "grid_fence",
    "grid_sync",
)
INDEX_NAMES = ("peer", "slot", "member")

#: Comparisons of a signal wait (``CMP``), in this order.
CMP_NAMES = ("EQ", "NE", "GE", "GT", "LE", "LT")
CMP_SYMBOLS = ("==", "!=", ">=", ">", "<=", "<")
