"""Routings for the dispatcher's tests: what each member dispatches, drawn from a seed."""

import torch

KINDS = ("random", "hot", "unused", "masked", "empty_member", "repeats", "one_token")


def routing(kind, rank, world, num_experts, max_tokens, hidden, top_k, dtype, seed):
    """``(x [T, H], topk_idx [T, top_k] int64, weights [T, top_k] float32)`` of member ``rank``.

    * random: T = max_tokens - rank, ids uniform in [-1, E);
    * hot: most entries name expert 1 (two thirds), the rest uniform;
    * unused: only the experts of member 0 are named (every other member's experts get nothing);
    * masked: every entry is -1;
    * empty_member: member world - 1 has no tokens, the others max_tokens;
    * repeats: each token names one expert in every entry but the last;
    * one_token: every member one token, every entry an expert id (fewer send programs than
      experts, where the hidden size is one chunk: each program counts several experts).
    """
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    tokens = max_tokens - (rank % max_tokens)
    if kind == "empty_member":
        tokens = 0 if rank == world - 1 else max_tokens
    elif kind == "one_token":
        tokens = 1
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype)
    ids = torch.randint(-1, num_experts, (tokens, top_k), generator=g)
    if kind == "hot":
        ids = torch.where(torch.rand(tokens, top_k, generator=g) < 2 / 3, 1, ids)
    elif kind == "unused":
        ids = torch.randint(0, num_experts // world, (tokens, top_k), generator=g)
    elif kind == "masked":
        ids = torch.full((tokens, top_k), -1)
    elif kind == "one_token":
        ids = torch.randint(0, num_experts, (tokens, top_k), generator=g)
    elif kind == "repeats":
        ids[:, : max(1, top_k - 1)] = ids[:, :1].clamp(min=0)
    w = torch.rand(tokens, top_k, generator=g)
    return x.contiguous(), ids.to(torch.int64).contiguous(), w.contiguous()
