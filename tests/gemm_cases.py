"""Rank functions of symmsync.gemm's tests, on either backend (tests/gemm on the host backend,
tests/gpu/test_gpu_gemm.py on GPUs), and their oracles.

The oracles are plain torch, independent of the kernels: every rank draws every member's
inputs from one seed, so it knows what ``all_gather`` would give without calling symmsync, and
the references are ``torch.cat(rows) @ b`` and the documented reduction: each member's partial
``a_s @ b_s`` rounded to the dtype (as ``torch.matmul`` returns it), summed in float32 in member
order starting from member 0's, rounded once. Integer-valued inputs (entries in -2..2) make
every product and sum exact in float32 and in the dtype, so the results must be equal bit for
bit whatever order a GEMM sums its products in.
"""

import functools

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import gemm


def ints(shape, seed, dtype, device="cpu"):
    """A tensor of integer values in -2..2 (exact in every dtype), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, shape, generator=g).to(dtype).to(device)


def gathered_reference(rows, b):
    """``torch.cat(rows) @ b`` in float32 (exact for integer inputs), rounded to the dtype."""
    return (torch.cat([r.float() for r in rows]) @ b.float()).to(b.dtype)


def scattered_reference(parts_a, parts_b, me, m):
    """Member ``me``'s block of the member-order sum of each member's rounded partial."""
    dtype = parts_b[0].dtype
    partials = [(a.float() @ b.float()).to(dtype).float() for a, b in zip(parts_a, parts_b)]
    acc = partials[0].clone()
    for p in partials[1:]:
        acc += p
    return acc.to(dtype)[me * m : (me + 1) * m]


def made(buf, max_rows, k, n, dtype, **kw):
    """An AllGatherMatmul (width ``k``) and a MatmulReduceScatter (width ``n``) side by side."""
    view = buf.view(list(range(buf.world_size)))
    nb = gemm.all_gather_matmul_bytes(view.size, max_rows, k, dtype)
    ag = gemm.AllGatherMatmul(view, max_rows, k, dtype, **kw)
    rs = gemm.MatmulReduceScatter(view, max_rows, n, dtype, offset=nb, **kw)
    return ag, rs


def buffer_bytes(w, max_rows, k, n, dtype):
    return gemm.all_gather_matmul_bytes(w, max_rows, k, dtype) + gemm.matmul_reduce_scatter_bytes(w, max_rows, n, dtype)


def exact(backend, dtype, shapes, max_rows=32, k=32, n=48, calls=2, **kw):
    """Every (m, transposed, out) of ``shapes`` through both consumers (made with ``kw``), ``calls``
    times each with new inputs; what differed from the oracles (empty: all exact)."""
    w, me = dist.get_world_size(), dist.get_rank()
    wrong = []
    with ss.SymmetricBuffer(buffer_bytes(w, max_rows, k, n, dtype), backend=backend) as buf:
        dev = buf.device
        ag, rs = made(buf, max_rows, k, n, dtype, **kw)
        with ag, rs:
            for i, (m, transposed, give_out) in enumerate(shapes):
                for call in range(calls):
                    seed = 1000 * i + 10 * call
                    rows = [ints((m, k), seed + p, dtype) for p in range(w)]
                    bs = [ints((k, n), seed + 100 + p, dtype) for p in range(w)]
                    b = bs[me].to(dev)
                    if transposed:
                        b = b.t().contiguous().t()
                    out = torch.full((w * m, n), 7.0, dtype=dtype, device=dev) if give_out else None
                    y = ag(rows[me].to(dev), b, out=out)
                    if out is not None and y is not out:
                        wrong.append(f"m={m}: all-gather's out= not returned")
                    if not torch.equal(y.cpu(), gathered_reference(rows, bs[me])):
                        wrong.append(f"all_gather_matmul m={m} transposed={transposed} call {call}")
                    big = [ints((w * m, k), seed + 200 + p, dtype) for p in range(w)]
                    out = torch.full((m, n), 7.0, dtype=dtype, device=dev) if give_out else None
                    z = rs(big[me].to(dev), b, out=out)
                    if not torch.equal(z.cpu(), scattered_reference(big, bs, me, m)):
                        wrong.append(f"matmul_reduce_scatter m={m} transposed={transposed} call {call}")
    return wrong


def refused(backend, refuser, dtype=torch.bfloat16, max_rows=16, k=32, n=32, how="dtype"):
    """Call 0 right; call 1 refused by ``refuser`` on both consumers (``how``: ``"dtype"``, a float64
    ``a``; ``"overlap"``, an ``out=`` over the first bytes of its ``a``), the others' ``out=`` first
    filled with 7; call 2 right. Per consumer: what call 1 raised, whether its ``out`` held NaN only
    (the refuser's: whether its ``a`` and ``out`` kept their bytes), and whether calls 0 and 2 were
    exact."""
    w, me = dist.get_world_size(), dist.get_rank()
    m = 8
    seen = {}
    with ss.SymmetricBuffer(buffer_bytes(w, max_rows, k, n, dtype), backend=backend) as buf:
        dev = buf.device
        ag, rs = made(buf, max_rows, k, n, dtype)
        with ag, rs:
            for name in ("ag", "rs"):
                op, ok, raised, nan = (ag if name == "ag" else rs), [], None, None
                for call in range(3):
                    rows = [ints((m if name == "ag" else w * m, k), 50 * call + p, dtype) for p in range(w)]
                    bs = [ints((k, n), 50 * call + 20 + p, dtype) for p in range(w)]
                    want = gathered_reference(rows, bs[me]) if name == "ag" else scattered_reference(rows, bs, me, m)
                    x = rows[me].to(dev)
                    if call == 1:
                        out = torch.full(want.shape, 7.0, dtype=dtype, device=dev)
                        a = x.double() if me == refuser and how == "dtype" else x
                        if me == refuser and how == "overlap":  # out's bytes start where a's do
                            a = torch.full((max(x.numel(), out.numel()),), 7.0, dtype=dtype, device=dev)
                            a[: x.numel()] = x.flatten()
                            a, out = a[: x.numel()].view(x.shape), a[: out.numel()].view(out.shape)
                            kept = a.clone(), out.clone()
                        try:
                            op(a, bs[me].to(dev), out=out)
                        except ss.InputError as e:
                            raised = f"InputError: {e}"
                        except ss.PeerRefused as e:
                            raised = f"PeerRefused: rank {e.origin}: {e.reason}"
                        if backend == "cuda" and raised is None:  # GPUs: the outputs say so before synchronize()
                            nan = bool(torch.isnan(out).all())
                            try:
                                op.synchronize()
                            except ss.PeerRefused as e:
                                raised = f"PeerRefused: rank {e.origin}: {e.reason}"
                        elif me != refuser:
                            nan = bool(torch.isnan(out).all())
                        if me == refuser and how == "overlap":
                            nan = torch.equal(a, kept[0]) and torch.equal(out, kept[1])
                    else:
                        ok.append(torch.equal(op(x, bs[me].to(dev)).cpu(), want))
                seen[name] = (raised, nan, ok)
    return seen


def mismatch(backend, dtype=torch.float32, max_rows=16, k=32, n=32):
    """Rank 0 passes 4 rows, the others 8, to the all-gather: what each member raised, and what
    the consumer's next call raises."""
    w, me = dist.get_world_size(), dist.get_rank()
    with ss.SymmetricBuffer(buffer_bytes(w, max_rows, k, n, dtype), backend=backend) as buf:
        dev = buf.device
        ag, rs = made(buf, max_rows, k, n, dtype)
        with ag, rs:
            a = ints((4 if me == 0 else 8, k), me, dtype, dev)
            b = ints((k, n), 9, dtype, dev)
            first = later = None
            try:
                ag(a, b)
                if backend == "cuda":
                    ag.synchronize()
            except ss.SymmSyncError as e:
                first = type(e).__name__
            try:
                ag(a[:4], b)
            except ss.SymmSyncError as e:
                later = type(e).__name__
    return first, later


def _with_out(op, x, b, out):
    return op(x, b, out=out)


def compiled(backend, dtype=torch.bfloat16, max_rows=16, k=32, n=32):
    """Both consumers inside one ``torch.compile``'d function (fullgraph); True when its results
    equal the oracles' and an ``out=`` in a compiled call of either raised the ConfigError while
    tracing (Dynamo reports it as ``Unsupported`` carrying its text), not a call that drops it."""
    w, me = dist.get_world_size(), dist.get_rank()
    m = 4
    with ss.SymmetricBuffer(buffer_bytes(w, max_rows, k, n, dtype), backend=backend) as buf:
        dev = buf.device
        ag, rs = made(buf, max_rows, k, n, dtype)
        with ag, rs:
            rows = [ints((m, k), p, dtype) for p in range(w)]
            big = [ints((w * m, k), 40 + p, dtype) for p in range(w)]
            bs = [ints((k, n), 20 + p, dtype) for p in range(w)]

            def step(x, y, b):
                return ag(x * 1, b), rs(y * 1, b)

            fn = torch.compile(step, fullgraph=True, backend="aot_eager")
            g, s = fn(rows[me].to(dev), big[me].to(dev), bs[me].to(dev))
            right = torch.equal(g.cpu(), gathered_reference(rows, bs[me])) and torch.equal(
                s.cpu(), scattered_reference(big, bs, me, m)
            )
            refused = []
            b = bs[me].to(dev)
            for op, x, shape in ((ag, rows[me], (w * m, n)), (rs, big[me], (m, n))):
                args = (x.to(dev), b, torch.empty(shape, dtype=dtype, device=dev))
                try:
                    torch.compile(functools.partial(_with_out, op), fullgraph=True, backend="eager")(*args)
                except Exception as e:  # noqa: BLE001 - Dynamo reports the ConfigError it traced as Unsupported
                    refused.append("ConfigError" in str(e) and "out= is eager-only" in str(e))
            return right and refused == [True, True]
