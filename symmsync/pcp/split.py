"""How prefill context parallelism splits a prompt over P ranks.

The prompt's T tokens are cut into 2P chunks of ``ceil(T / 2P)`` tokens (the last
ones shorter or empty); rank r takes chunks r and 2P-1-r, which balances causal
attention work. Each chunk is padded to the full chunk length, so every rank has
the same number of local rows, ``2 * chunk``; padding rows carry slot -1.

"Rank-major" order is the order of an all-gather over the PCP group: rank 0's
local rows, then rank 1's, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import index_problem, int_problem, is_int
from ..errors import BoundsError, ConfigError


@dataclass(frozen=True)
class PCPSplit:
    """The split of ``num_tokens`` over ``pcp`` ranks.

    Attributes:
        num_tokens: tokens in the prompt.
        pcp: ranks in the PCP group.
        chunk: tokens per chunk (``ceil(num_tokens / (2 * pcp))``).
        token_index: int64 ``[pcp, 2 * chunk]``: the prompt position of each local row of
            each rank, -1 for padding.
    """

    num_tokens: int
    pcp: int
    chunk: int
    token_index: torch.Tensor

    @property
    def tokens_per_rank(self) -> int:
        """Local rows per rank, padding included (the same on every rank)."""
        return 2 * self.chunk

    def local_rows(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """The rows of a ``[num_tokens, ...]`` tensor that ``rank`` owns, zeros for padding.

        Raises:
            BoundsError: ``rank`` is not a rank of the PCP group.
            ConfigError: ``rank`` is not an int, or ``x`` is not ``[num_tokens, ...]``.
        """
        self._check_rank(rank, "PCPSplit.local_rows")
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != self.num_tokens:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ConfigError(f"PCPSplit.local_rows: x must be a tensor of shape ({self.num_tokens}, ...), got {got}")
        idx = self.token_index[rank].to(x.device)
        out = x.new_zeros((self.tokens_per_rank,) + tuple(x.shape[1:]))
        keep = idx >= 0
        out[keep] = x[idx[keep]]
        return out

    def local_slots(self, slot_mapping: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s slot mapping: the slot of each local row, -1 for padding.

        Raises:
            BoundsError: ``rank`` is not a rank of the PCP group.
            ConfigError: ``rank`` is not an int, or ``slot_mapping`` is not ``[num_tokens]``.
        """
        self._check_rank(rank, "PCPSplit.local_slots")
        return self._slots(slot_mapping, self.token_index[rank], "PCPSplit.local_slots")

    def gathered_slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The slot mapping of all ranks' rows in rank-major order (what an all-gather yields)."""
        return self._slots(slot_mapping, self.token_index.reshape(-1), "PCPSplit.gathered_slots")

    def _check_rank(self, rank: int, call: str) -> None:
        problem = index_problem("rank", rank, self.pcp, "the PCP group")
        if problem is not None:
            raise (BoundsError if is_int(rank) else ConfigError)(f"{call}: {problem}")

    def _slots(self, slot_mapping: torch.Tensor, idx: torch.Tensor, call: str) -> torch.Tensor:
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.shape != (self.num_tokens,):
            got = tuple(slot_mapping.shape) if isinstance(slot_mapping, torch.Tensor) else type(slot_mapping).__name__
            raise ConfigError(f"{call}: slot_mapping must be a tensor of shape ({self.num_tokens},), got {got}")
        idx = idx.to(slot_mapping.device)
        out = torch.full(idx.shape, -1, dtype=torch.int64, device=slot_mapping.device)
        keep = idx >= 0
        out[keep] = slot_mapping[idx[keep]].to(torch.int64)
        return out


#: Largest PCP group :func:`pcp_split` accepts.
MAX_PCP = 1 << 16


def pcp_split(num_tokens: int, pcp: int) -> PCPSplit:
    """Split ``num_tokens`` over ``pcp`` ranks: rank r takes chunks r and 2P-1-r of 2P.

    Raises:
        ConfigError: ``num_tokens`` is not a non-negative int, or ``pcp`` not an int in
            ``[1, MAX_PCP]``.
    """
    problem = int_problem("num_tokens", num_tokens, minimum=0) or int_problem("pcp", pcp, minimum=1, maximum=MAX_PCP)
    if problem is not None:
        raise ConfigError(f"pcp_split: {problem}")
    chunks = 2 * pcp
    chunk = -(-num_tokens // chunks)
    try:
        index = torch.full((pcp, 2 * chunk), -1, dtype=torch.int64)
    except (RuntimeError, OverflowError) as e:
        raise ConfigError(f"pcp_split: num_tokens={num_tokens} is too large to split over pcp={pcp} ranks ({e})") from e
    for r in range(pcp):
        for half, c in enumerate((r, chunks - 1 - r)):
            start, stop = c * chunk, min((c + 1) * chunk, num_tokens)
            if stop > start:
                index[r, half * chunk : half * chunk + stop - start] = torch.arange(start, stop)
    return PCPSplit(num_tokens, pcp, chunk, index)
