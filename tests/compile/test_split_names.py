"""The op names docs/inside-a-model.md gives a runtime's list of splitting ops find symmsync's ops.

A runtime that splits a compiled model (vLLM's ``splitting_ops``, SGLang's split ops)
matches the nodes of the Dynamo graph against a list of strings. The page says which
strings find the writer and the fence; this test traces a decode step (an all-reduce,
a write, a read of the cache, a fence) and matches its nodes by each runtime's rule, as
the runtime's source states it (the oracle: the rules below, not symmsync's code).
"""

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives, pcp

VLLM_SPLITTING_OPS = ["symmsync::kv_write", "symmsync::fence"]  # as the page writes them
SGLANG_SPLIT_OPS = ["symmsync.kv_write", "symmsync.fence.default"]


def vllm_should_split(node: torch.fx.Node, splitting_ops: list[str]) -> bool:
    """vLLM's rule (vllm/compilation/partition_rules.py, should_split): a call of an op
    packet by its qualified name; a call of one overload by its packet's name or its own."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name in splitting_ops
    if isinstance(target, torch._ops.OpOverload):
        return target.name() in splitting_ops or f"{target.name()}.{target._overloadname}" in splitting_ops
    return False


def sglang_should_split(node: torch.fx.Node, split_ops: list[str]) -> bool:
    """SGLang's rule (python/sglang/srt/compilation/backend.py, split_graph)."""
    return node.op == "call_function" and str(node.target) in split_ops


def traced_nodes() -> dict[str, list[str]]:
    """Which nodes of a traced decode step each rule splits at (by the symmsync op they call)."""
    torch._dynamo.reset()  # as in a fresh process: these ranks serve other tests too (tests/conftest.py)
    layout = pcp.CacheLayout(
        num_blocks=1, num_layers=1, base=128 * -(-collectives.workspace_bytes(64, torch.float32, 1) // 128)
    )
    buf = ss.SymmetricBuffer(layout.end, backend="host")
    view = buf.view([0])
    ar = collectives.AllReduce(view, 64, torch.float32)
    writer = pcp.DirectKVWriter(view, layout, channel=1)
    batch = writer.prepare(torch.arange(2))
    graphs = []

    def step(x, kv, batch):
        y = ar(x)
        writer.write(0, kv, kv[:, :64].contiguous(), kv[:, :128].contiguous(), batch)
        main_kv, _ = writer.caches(0)
        seen = main_kv.view(-1, main_kv.shape[-1])[batch.slots].sum()
        writer.fence.fence()
        return y, seen

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(step, backend=keep_graph, fullgraph=True)(torch.ones(8), torch.zeros(2, 512).bfloat16(), batch)
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    found = {
        "vllm": [str(n.target) for n in calls if vllm_should_split(n, VLLM_SPLITTING_OPS)],
        "sglang": [str(n.target) for n in calls if sglang_should_split(n, SGLANG_SPLIT_OPS)],
        "symmsync": [str(n.target) for n in calls if str(n.target).startswith("symmsync.")],
    }
    dist.barrier()
    buf.close()
    return found


def test_the_documented_split_names_find_the_writer_and_the_fence_and_nothing_else(host_ranks):
    (found,) = host_ranks(traced_nodes, 1, timeout_s=300)
    assert found["symmsync"] == ["symmsync.all_reduce", "symmsync.kv_write", "symmsync.fence.default"], found
    assert found["vllm"] == ["symmsync.kv_write", "symmsync.fence.default"], found
    assert found["sglang"] == ["symmsync.kv_write", "symmsync.fence.default"], found
