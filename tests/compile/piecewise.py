"""A compiled model split the way vLLM splits it, for the tests: pieces compiled, splitting ops eager.

vLLM traces the forward whole (Dynamo, ``fullgraph``), cuts the graph at its splitting ops
(``vllm/compilation/backends.py``, ``split_graph``: each splitting op in a subgraph of its own,
``torch.fx.passes.split_module`` with ``keep_original_order``), compiles every other subgraph
(a *piece*) and, in its piecewise CUDA-graph mode, captures each piece per batch size, while
the splitting ops run eagerly between them. :func:`backend` does the same with the split names
docs/inside-a-model.md gives vLLM (the rule: ``test_split_names.vllm_should_split``): a piece
is compiled per input shape (``aot_eager``), optionally captured in a CUDA graph, and a
``delay`` runs before every splitting op (random delays between pieces).
"""

from collections.abc import Callable

import torch
from test_split_names import VLLM_SPLITTING_OPS, vllm_should_split
from torch._dynamo.backends.registry import lookup_backend
from torch.fx.passes.split_module import split_module


def _key(args) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


class Piece(torch.nn.Module):
    """A subgraph between splitting ops: compiled once per input shape (and captured, ``graphs``)."""

    def __init__(self, gm: torch.fx.GraphModule, graphs: bool):
        super().__init__()
        output = next(n for n in gm.graph.nodes if n.op == "output")
        self.single = not isinstance(output.args[0], (tuple, list))
        if self.single:  # the compilers take graphs that return a tuple
            output.args = ((output.args[0],),)
            gm.recompile()
        self.gm, self.graphs, self.compiled = gm, graphs, {}
        self.calls = 0

    def forward(self, *args):
        self.calls += 1
        key = _key(args)
        if key not in self.compiled:
            fn = lookup_backend("aot_eager")(self.gm, list(args))
            self.compiled[key] = _captured(fn, args) if self.graphs else fn
        out = self.compiled[key](*args)
        return out[0] if self.single else tuple(out)


def _captured(fn: Callable, args) -> Callable:
    """``fn`` captured in a CUDA graph over static copies of its inputs (warmed up once first)."""
    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*static)  # every rank warms up at the same call: its collectives run for real, alike
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)

    def replay(*now):
        for s, a in zip(static, now):
            if isinstance(s, torch.Tensor):
                s.copy_(a)
        graph.replay()
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in out]

    return replay


class Between(torch.nn.Module):
    """A splitting op's subgraph, run eagerly, after ``delay()``."""

    def __init__(self, gm: torch.fx.GraphModule, delay: Callable[[], None] | None):
        super().__init__()
        self.gm, self.delay = gm, delay

    def forward(self, *args):
        if self.delay is not None:
            self.delay()
        return self.gm(*args)


def backend(graphs: bool = False, delay: Callable[[], None] | None = None, seen: list | None = None):
    """A ``torch.compile`` backend that splits at vLLM's splitting ops; ``seen`` gets the split module."""

    def split_and_compile(gm: torch.fx.GraphModule, example_inputs):
        parts, part, splitting = {}, 0, set()
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if vllm_should_split(node, VLLM_SPLITTING_OPS):
                part += 1
                parts[node] = part
                splitting.add(part)
                part += 1
            else:
                parts[node] = part
        split = split_module(gm, None, lambda n: parts[n], keep_original_order=True)
        for name, sub in list(split.named_children()):
            index = int(name.removeprefix("submod_"))
            setattr(split, name, Between(sub, delay) if index in splitting else Piece(sub, graphs))
        if seen is not None:
            seen.append(split)
        return split

    return split_and_compile
