"""Plain-torch references for expert-parallel dispatch and combine, written from the contract of
docs/moe.md and nothing of symmsync's: loops over members, tokens and entries in Python.

* dispatch at member ``me``: for each member ``s`` in order, each token ``t`` of ``s`` in order,
  each entry ``k`` in order, expert ``e = topk[s][t, k]``: skipped when ``e`` is -1 or an earlier
  entry of the token named ``e``; else, when ``me`` owns ``e`` (``e // EL == me``), the token's row
  is appended to local expert ``e % EL``'s received rows (packed: in this loop's order, so
  member ``s``'s rows follow those of the members before it). The source index of a row is
  ``t * top_k + k``. Past an expert's count the contract says nothing: the oracle holds zeros
  (and -1) there, and :func:`received` sets the outputs' rows there alike before comparing.
* fp8: per token and 128 channels, ``s = max(amax, 1e-4) / 448`` in float32 and codes
  ``(x / s).to(torch.float8_e4m3fn)`` (torch's conversion: round to nearest even, saturating).
* combine at member ``me``: ``acc = 0``; for ``k`` in order with ``e = topk[t, k] >= 0``:
  ``acc = acc + w[t, k] * float32(f(x[t], e))``, ``f`` the experts' function of the test; then
  ``acc.to(dtype)``.
"""

import torch


def dispatch(xs, topks, num_experts, max_tokens, me):
    """``(rows [EL, W*M, H], src [EL, W*M], per_source [EL, W])`` that member ``me`` receives
    (zeros, and -1, past each expert's count)."""
    world = len(xs)
    el = num_experts // world
    hidden = xs[0].shape[1]
    rows = torch.zeros((el, world * max_tokens, hidden), dtype=xs[0].dtype)
    src = torch.full((el, world * max_tokens), -1, dtype=torch.int64)
    fill = torch.zeros((el, world), dtype=torch.int64)
    for s in range(world):
        for t in range(xs[s].shape[0]):
            seen = set()
            for k in range(topks[s].shape[1]):
                e = int(topks[s][t, k])
                if e < 0 or e in seen:
                    continue
                seen.add(e)
                if e // el != me:
                    continue
                j = int(fill[e % el].sum())  # the next row of the expert: packed
                rows[e % el, j] = xs[s][t]
                src[e % el, j] = t * topks[s].shape[1] + k
                fill[e % el, s] += 1
    return rows, src, fill


def received(t, counts, fill=0):
    """``t`` (rows per local expert, ``[EL, R, ...]``) with its rows past ``counts[e]`` set to
    ``fill``: the part of a dispatch's output the contract speaks of, comparable with the oracle's."""
    out = t.clone()
    for e, n in enumerate(counts.tolist()):
        out[e, n:] = fill
    return out


def quantize(x):
    """``(codes uint8 [T, H], scales float32 [T, H / 128])`` of the fp8 rule, in plain torch."""
    t, h = x.shape
    v = x.to(torch.float32).reshape(t, h // 128, 128)
    s = torch.clamp(v.abs().amax(dim=-1), min=1e-4) / 448.0
    codes = (v / s[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.reshape(t, h), s


def expert(rows, e):
    """The experts' function of the tests: a row times ``(e + 1) / 8``, rounded to the dtype."""
    return (rows.to(torch.float32) * ((e + 1) / 8.0)).to(rows.dtype)


def combine(x, topk, weights):
    """``y [T, H]`` for member's tokens ``x`` routed by ``topk`` with ``weights`` (f = :func:`expert`)."""
    y = torch.zeros(x.shape, dtype=x.dtype)
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float32)
        for k in range(topk.shape[1]):
            e = int(topk[t, k])
            if e < 0:
                continue
            acc = acc + weights[t, k] * expert(x[t : t + 1], e)[0].to(torch.float32)
        y[t] = acc.to(x.dtype)
    return y


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
