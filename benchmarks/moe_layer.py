"""A Mixtral-like MoE layer on the dispatcher, against the same layer without the transfer.

The layer (:class:`Layer`): routing by a small gate matmul, a softmax and top-k (renormalized
over the k), ``dispatch``, the experts this rank owns as padded batched GEMMs over every row
they may receive (SwiGLU: gate and up projections, then down, as Mixtral's experts; one GEMM per
projection for all local experts, as a CUDA graph must run them: the counts stay on the device),
``combine``, plus a shared MLP on the rank's tokens (as DeepSeek- and Qwen-style MoE layers have).
Three ways to run it:

* ``transfer``: dispatch (waited), the shared MLP, the experts, combine;
* ``overlap``: ``dispatch(..., wait=False)``, the shared MLP while the rows travel, then the
  pending dispatch's ``wait()``, the experts, combine;
* ``local``: no transfer at all: the routing, the shared MLP and the same expert GEMMs on rows
  made locally of the same shapes (``[local experts, members * max_tokens, hidden]``).

``transfer - local`` and ``overlap - local`` are what the transfer adds to the layer.
:func:`reference` computes every token's output from all the experts' weights (every rank holds
them, seeded alike), one expert's rows at a time: what :func:`check` holds the layer to.
``benchmarks/moe.py --shared`` times the three in CUDA-graph replay (:func:`shared_figure`);
``--smoke`` runs them eagerly on the host backend (:func:`smoke_rank`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Mixtral's hidden size, expert count and top-k; its experts' FFN (14336) cut by 8, so that a
#: world's layer stays under a millisecond on an eighth of a GPU; a shared MLP of 4096.
HIDDEN, FFN, EXPERTS, TOP_K, SHARED_FFN, TOKENS = 4096, 1792, 8, 2, 4096, 128


class Layer:
    """The layer's weights (all experts', seeded alike on every rank) and its three ways to run."""

    def __init__(self, disp, rank: int, world: int, hidden: int, ffn: int, experts: int, top_k: int,
                 shared_ffn: int, dtype: torch.dtype, device):  # fmt: skip
        g = torch.Generator().manual_seed(1234)

        def w(*shape, fan_in):
            return (torch.randn(*shape, generator=g) / fan_in**0.5).to(dtype).to(device)

        self.disp, self.top_k, self.hidden = disp, top_k, hidden
        self.gate = w(hidden, experts, fan_in=hidden)
        self.w13 = w(experts, hidden, 2 * ffn, fan_in=hidden)  # gate and up projections
        self.w2 = w(experts, ffn, hidden, fan_in=ffn)
        self.s1, self.s2 = w(hidden, 2 * shared_ffn, fan_in=hidden), w(shared_ffn, hidden, fan_in=shared_ffn)
        el = experts // world
        self.mine = slice(rank * el, (rank + 1) * el)
        self.local_rows = w(el, world * disp.max_tokens, hidden, fan_in=1)

    def route(self, x):
        logits = (x @ self.gate).float()
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def shared(self, x):
        g, u = (x @ self.s1).chunk(2, dim=-1)
        return (F.silu(g) * u) @ self.s2

    def experts(self, rows):
        """This rank's experts on ``[local experts, rows, hidden]``: one batched GEMM per projection."""
        g, u = torch.bmm(rows, self.w13[self.mine]).chunk(2, dim=-1)
        return torch.bmm(F.silu(g) * u, self.w2[self.mine])

    def transfer(self, x):
        ids, weights = self.route(x)
        recv, counts, handle = self.disp.dispatch(x, ids)
        s = self.shared(x)
        return self.disp.combine(self.experts(recv), weights, handle) + s

    def overlap(self, x):
        ids, weights = self.route(x)
        pending = self.disp.dispatch(x, ids, wait=False)  # the rows travel ...
        s = self.shared(x)  # ... while the shared MLP runs
        recv, counts, handle = pending.wait()
        return self.disp.combine(self.experts(recv), weights, handle) + s

    def local(self, x):
        self.route(x)
        s = self.shared(x)
        return self.experts(self.local_rows), s

    def reference(self, x):
        """Every token's output from all the experts' weights, in float32 from the same bf16 inputs."""
        ids, weights = self.route(x)
        y = torch.zeros(x.shape[0], self.hidden, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            t, k = (ids == e).nonzero(as_tuple=True)
            g, u = (x[t].float() @ self.w13[e].float()).chunk(2, dim=-1)
            y.index_add_(0, t, weights[t, k, None] * ((F.silu(g) * u) @ self.w2[e].float()))
        return y + self.shared(x).float()


def check(layer: Layer, x) -> bool | str:
    """``transfer`` and ``overlap`` give the same bits, within bf16 rounding of :meth:`Layer.reference`."""
    with torch.no_grad():
        a, b, want = layer.transfer(x), layer.overlap(x), layer.reference(x)
    if not torch.equal(a, b):
        return "wait=False gives other bits than the waited dispatch"
    err = (a.float() - want).abs().max().item()
    bound = 0.03 * want.abs().max().item() + 1e-3
    return True if err <= bound else f"layer output {err:.3g} from the reference (bound {bound:.3g})"


def make(world: int, rank: int, backend: str, device, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, top_k=TOP_K,
         shared_ffn=SHARED_FFN, tokens=TOKENS, dtype=torch.bfloat16, timeout_s=None):  # fmt: skip
    """A buffer, a dispatcher (``max_tokens`` = ``tokens``) and the layer on it; the caller closes
    the dispatcher and the buffer."""
    import symmsync as ss
    from symmsync import moe

    buf = ss.SymmetricBuffer(moe.buffer_bytes(experts, tokens, hidden, dtype, top_k, world), backend=backend)
    disp = moe.Dispatcher(buf.view(list(range(world))), experts, tokens, hidden, dtype, top_k, timeout_s=timeout_s)
    return buf, disp, Layer(disp, rank, world, hidden, ffn, experts, top_k, shared_ffn, dtype, device)


def shared_figure(ctx, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, top_k=TOP_K, shared_ffn=SHARED_FFN, tokens=TOKENS,
                  dtype=torch.bfloat16) -> None:  # fmt: skip
    """The layer in CUDA-graph replay at ``tokens`` tokens a rank (``benchmarks/shared.py``'s
    ``ctx``): ``transfer`` against ``local`` (its floor: the same layer without the transfer),
    with ``overlap`` and the shared MLP alone beside them; checked on every rank (:func:`check`)."""
    buf, disp, layer = make(ctx.world, ctx.rank, ctx.backend, ctx.device, hidden, ffn, experts, top_k, shared_ffn,
                            tokens, dtype, timeout_s=ctx.wait_s)  # fmt: skip
    try:
        g = torch.Generator().manual_seed(99 + ctx.rank)
        x = torch.randn(tokens, hidden, generator=g).to(dtype).to(ctx.device)
        with torch.no_grad():
            ctx.figure(
                f"Mixtral-like layer {tokens} tok, dispatch + combine",
                lambda: layer.transfer(x),
                lambda: layer.local(x),
                "the same layer without the transfer",
                f"hidden {hidden}, {experts} experts of FFN {ffn} (SwiGLU), top-{top_k}, a shared MLP of "
                f"{shared_ffn}, {tokens} tokens a rank; the floor: routing, shared MLP and the same batched expert "
                f"GEMMs on local rows of the received rows' shape, no dispatch or combine",
                iters=10,
                more={"wait=False overlap": lambda: layer.overlap(x), "shared MLP alone": lambda: layer.shared(x)},
                check=lambda: check(layer, x),
                tags={"what": "layer", "tokens": tokens, "mode": "graph"},
            )
    finally:
        ctx.barrier()
        disp.close()
        buf.close()


def smoke_rank(hidden: int, ffn: int, experts: int, top_k: int, tokens: int) -> dict:
    """The layer's three ways, eagerly on the host backend, small and float32: their outputs checked
    (:func:`check`), their wall times (the interpreter's: no GPU figure)."""
    import time

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    buf, disp, layer = make(world, rank, "host", torch.device("cpu"), hidden, ffn, experts, top_k, 2 * ffn,
                            tokens, torch.float32)  # fmt: skip
    try:
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(5 + rank))
        out = {"check": check(layer, x)}
        with torch.no_grad():
            for name in ("transfer", "overlap", "local"):
                t0 = time.perf_counter()
                getattr(layer, name)(x)
                out[name] = (time.perf_counter() - t0) * 1e6
        disp.synchronize()
        return out
    finally:
        disp.close()
        buf.close()
