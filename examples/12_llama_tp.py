"""Tutorial 12: transformers' Llama, tensor-parallel on symmsync, greedy decode in a CUDA graph.

    python examples/12_llama_tp.py                  # host backend: 2 processes, no GPU needed
    python examples/12_llama_tp.py --backend cuda   # one GPU per rank (SYMMSYNC_SHARE_GPUS=1: ranks share one)
    torchrun --nproc-per-node 2 examples/12_llama_tp.py --backend cuda   # torchrun's processes are the ranks
    python examples/12_llama_tp.py --model PATH     # a local checkpoint instead of a small random model

transformers' ``LlamaForCausalLM``, each rank holding its share of every layer's heads and MLP
columns (Megatron's split: q, k, v, gate and up by output rows, o and down by input columns),
so that o_proj and down_proj return this rank's partial sum. symmsync sums the partials with
its all-reduce, fused with the residual add and the next RMS norm: after the MLP that norm is
the next layer's input norm (the final norm after the last layer), so the decode loop is
written here rather than taken from transformers' decoder layer. The decode step runs eagerly
and, on GPUs, replayed from a CUDA graph. Every rank checks its logits against a one-process
simulation of the same shards summed as symmsync documents (member order, in float32) and its
tokens against transformers' unsharded model, then times a step beside the same step with no
communication. Needs ``pip install symmsync[models]`` (transformers).
"""

# --8<-- [start:imports]
import argparse
import copy
import json
import os
import time

import torch
import torch.distributed as dist

import symmsync as ss
from symmsync import collectives
from symmsync.testing import is_main_process, run, under_torchrun

PROMPT = [1, 7, 42, 3]  # token ids of the prompt (fed one step at a time, as decode steps)
NEW_TOKENS = 8
# --8<-- [end:imports]


# --8<-- [start:model]
def load_model(path: str | None, dtype: torch.dtype, hidden: int = 128, layers: int = 2):
    """A local checkpoint, or a Llama of ``hidden`` and ``layers`` with random weights (the same on
    every rank: seeded; the default is small enough for the host backend)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if path:  # a local folder only: nothing is downloaded
        return LlamaForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
    torch.manual_seed(0)
    head_dim = 16 if hidden <= 256 else 128
    config = LlamaConfig(
        vocab_size=256 if hidden <= 256 else 32000, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // head_dim, num_key_value_heads=hidden // head_dim // 2,
        head_dim=head_dim, max_position_embeddings=256, initializer_range=0.2,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).eval()


def shard(model, rank: int, world: int):
    """Keep this rank's share of every layer (in place): o_proj and down_proj then give partial sums."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % world or kv_heads % world or cfg.intermediate_size % world:
        raise SystemExit(f"{world} ranks must divide the heads ({heads}), KV heads ({kv_heads}) and MLP width")
    head_dim = model.model.layers[0].self_attn.head_dim

    def rows(linear, per_rank):  # output rows [rank * per_rank, (rank + 1) * per_rank)
        linear.weight = torch.nn.Parameter(linear.weight[rank * per_rank : (rank + 1) * per_rank].clone())

    def cols(linear, per_rank):  # input columns: the layer's output is then this rank's partial sum
        linear.weight = torch.nn.Parameter(linear.weight[:, rank * per_rank : (rank + 1) * per_rank].clone())

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        rows(attn.q_proj, heads // world * head_dim)
        rows(attn.k_proj, kv_heads // world * head_dim)
        rows(attn.v_proj, kv_heads // world * head_dim)
        cols(attn.o_proj, heads // world * head_dim)  # transformers reshapes by head_dim: fewer heads just work
        rows(mlp.gate_proj, cfg.intermediate_size // world)
        rows(mlp.up_proj, cfg.intermediate_size // world)
        cols(mlp.down_proj, cfg.intermediate_size // world)
    return model
    # --8<-- [end:model]


# --8<-- [start:cache]
class StaticKV:
    """A KV cache of fixed size that transformers' attention writes through ``update``: the
    step's keys and values go to the position in ``pos`` (a device tensor, so that a CUDA graph
    replays the write at each step's position), and attention reads the whole cache, masked."""

    def __init__(self, model, max_len: int, device):
        attn = model.model.layers[0].self_attn
        kv_heads = attn.k_proj.weight.shape[0] // attn.head_dim  # this rank's share
        shape = (1, kv_heads, max_len, attn.head_dim)
        dtype = attn.k_proj.weight.dtype
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.model.layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.model.layers]
        self.pos = torch.zeros(1, dtype=torch.long, device=device)

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.k[layer_idx].index_copy_(2, self.pos, key)
        self.v[layer_idx].index_copy_(2, self.pos, value)
        return self.k[layer_idx], self.v[layer_idx]

    def clear(self) -> None:
        for t in self.k + self.v:
            t.zero_()
            # --8<-- [end:cache]


# --8<-- [start:step]
def decode_step(shards, caches, reduce, token):
    """One decode step of every layer for ``token`` (a [1, 1] id tensor) at ``caches[0].pos``.
    ``shards``: the model shards this process runs (one in the job; every rank's in the
    simulation), ``reduce(partials, residual, norm)``: the tensor-parallel sum with the residual
    add and ``norm`` (an RMS norm module), returning (normed, new residual)."""
    base = shards[0].model  # the embedding, the norms and the head are whole on every rank
    h = base.embed_tokens(token)
    position = caches[0].pos.view(1, 1)
    rope = base.rotary_emb(h, position)
    max_len = caches[0].k[0].shape[2]
    visible = torch.arange(max_len, device=h.device) <= caches[0].pos  # the positions written so far
    mask = torch.where(visible, 0.0, float("-inf")).to(h.dtype).view(1, 1, 1, max_len)
    layers = list(zip(*(s.model.layers for s in shards)))  # each layer, as every shard holds it
    residual, normed = h, [layers[0][0].input_layernorm(h)] * len(shards)
    for i, layer in enumerate(layers):
        partials = [s.self_attn(x, rope, mask, caches[j])[0] for j, (s, x) in enumerate(zip(layer, normed))]
        x, residual = reduce(partials, residual, layer[0].post_attention_layernorm)
        partials = [s.mlp(x) for s in layer]
        after = layers[i + 1][0].input_layernorm if i + 1 < len(layers) else base.norm  # across the layer boundary
        x, residual = reduce(partials, residual, after)
        normed = [x] * len(shards)
    return shards[0].lm_head(normed[0])[0, -1]
    # --8<-- [end:step]


# --8<-- [start:reduce]
def fused(ar):
    """symmsync's all-reduce fused with the residual add and the RMS norm: one launch."""
    return lambda partials, residual, norm: ar(
        partials[0], residual=residual, norm_weight=norm.weight, eps=norm.variance_epsilon
    )


def plain(ar):
    """symmsync's all-reduce, then transformers' own residual add and RMS norm."""

    def reduce(partials, residual, norm):
        residual = residual + ar(partials[0])
        return norm(residual), residual

    return reduce


def no_communication(partials, residual, norm):
    """No sum at all (wrong numbers): the cost of the same step without communication."""
    residual = residual + partials[0]
    return norm(residual), residual


def member_order(partials):
    """The sum symmsync documents: float32, member 0 first, rounded to the dtype once."""
    acc = partials[0].float()
    for p in partials[1:]:
        acc = acc + p.float()
    return acc.to(partials[0].dtype)


def simulated_plain(partials, residual, norm):
    residual = residual + member_order(partials)
    return norm(residual), residual


def simulated_fused(partials, residual, norm):
    """The fused epilogue's documented arithmetic (docs/collectives.md), in plain torch."""
    residual = (member_order(partials).float() + residual.float()).to(residual.dtype)
    h = residual.float()
    out = h / torch.sqrt((h * h).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.float()
    return out.to(residual.dtype), residual
    # --8<-- [end:reduce]


# --8<-- [start:greedy]
def greedy(step, caches, steps: int, forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """The prompt, then greedy tokens (or the ``forced`` ones); ``step(token)`` runs at
    ``caches[0].pos``. Returns the tokens and every step's logits."""
    device = caches[0].pos.device
    for c in caches:
        c.clear()
    tokens, logits = list(PROMPT), []
    for p in range(len(PROMPT) + steps - 1):
        for c in caches:
            c.pos.fill_(p)
        out = step(torch.tensor([[tokens[p]]], device=device))
        logits.append(out.float().cpu())
        if p + 1 >= len(PROMPT):
            tokens.append(forced[p + 1] if forced else int(out.argmax()))
    return tokens, torch.stack(logits)


def close_choices(tokens: list[int], logits: torch.Tensor, want: torch.Tensor, rel: float) -> float:
    """Check that ``logits`` are within ``rel`` (of the largest) of ``want``, the reference's for
    the same tokens, and that each generated token is the reference's best up to that distance
    (in bfloat16 two near-equal logits may swap); return the distance."""
    drift = (logits - want).abs().max().item()
    assert drift <= rel * max(1.0, want.abs().max().item()), f"logits {drift:.2e} from the reference's"
    for p, t in enumerate(tokens[len(PROMPT) :], len(PROMPT) - 1):
        assert want[p, t] >= want[p].max() - 2 * drift, f"token {p + 1} ({t}) is not the reference's choice"
    return drift


def graphed(step, caches):
    """``step`` captured once in a CUDA graph; each call refills the token and replays it."""
    token = torch.zeros(1, 1, dtype=torch.long, device=caches[0].pos.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(token)  # warm up: kernels compiled and launches packed before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(token)

    def replay(t):
        token.copy_(t)
        graph.replay()
        return out

    return replay
    # --8<-- [end:greedy]


# --8<-- [start:timing]
def per_token_us(step, caches) -> float:
    """Mean time of a step (after one to warm up), synchronized: the whole step, as decode pays it."""
    on_gpu = caches[0].pos.is_cuda
    sync, reps = (torch.cuda.synchronize, 50) if on_gpu else ((lambda: None), 2)
    token = torch.ones(1, 1, dtype=torch.long, device=caches[0].pos.device)
    step(token)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        step(token)
    sync()
    return (time.perf_counter() - t0) / reps * 1e6
    # --8<-- [end:timing]


# --8<-- [start:main_fn]
def llama_tp(
    backend: str, path: str | None, dtype_name: str, new_tokens: int, size: tuple[int, int], compile_backend: str
) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else torch.device("cpu")
    pristine = load_model(path, dtype, *size).to(device)  # the unsharded model: read once
    full = copy.deepcopy(pristine)
    hidden = full.config.hidden_size
    max_len = len(PROMPT) + new_tokens
    rel = 1e-3 if dtype == torch.float32 else 5e-2  # how far rounding may move a logit: of the largest
    with torch.no_grad():  # inference: symmsync's ops have no autograd formula
        # The job: this rank's shard, one all-reduce (a decode token's row) on the symmetric buffer.
        buf = ss.SymmetricBuffer(collectives.workspace_bytes(hidden, dtype, world), backend=backend)
        ar = collectives.AllReduce(buf.view(list(range(world))), hidden, dtype, timeout_s=120.0)
        mine = [shard(full, rank, world)]
        caches = [StaticKV(mine[0], max_len, device)]
        steps = {name: (lambda t, r=r: decode_step(mine, caches, r, t)) for name, r in
                 [("fused", fused(ar)), ("plain", plain(ar)), ("none", no_communication)]}  # fmt: skip
        tokens, logits = greedy(steps["fused"], caches, new_tokens)
        plain_tokens, plain_logits = greedy(steps["plain"], caches, new_tokens)
        lines = []
        if compile_backend:  # the same step under torch.compile(fullgraph=True): the ops symmsync registers
            compiled = torch.compile(steps["fused"], fullgraph=True, backend=compile_backend)
            got, got_logits = greedy(compiled, caches, new_tokens)
            exact = got == tokens and torch.equal(got_logits, logits)
            # transformers' own ops may take other kernels when compiled (attention, say): then the
            # logits are checked within rounding, the tokens as choices; symmsync's op is the same launch.
            d = 0.0 if exact else close_choices(got, got_logits, logits, rel)
            said = "logits bit for bit" if exact else f"logits within {d:.1e}"
            same = "the eager tokens" if got == tokens else "tokens the eager logits choose too"
            lines.append(f"rank {rank}: compiled ({compile_backend}, fullgraph): {same}, {said}")
        times = {"eager": {name: per_token_us(step, caches) for name, step in steps.items()}}
        if device.type == "cuda":
            graph_steps = {name: graphed(step, caches) for name, step in steps.items()}
            replayed, replayed_logits = greedy(graph_steps["fused"], caches, new_tokens)
            assert replayed == tokens and torch.equal(replayed_logits, logits), f"rank {rank}: replay differs"
            lines.append(f"rank {rank}: CUDA graph replay: the eager tokens and logits, bit for bit")
            times["graph"] = {name: per_token_us(step, caches) for name, step in graph_steps.items()}
        ar.close()
        buf.close()

        # The oracle: every rank's shard in this one process, summed in plain torch in member order.
        sims = [shard(copy.deepcopy(pristine), r, world) for r in range(world)]
        sim_caches = [StaticKV(s, max_len, device) for s in sims]
        sim_plain = greedy(lambda t: decode_step(sims, sim_caches, simulated_plain, t), sim_caches, new_tokens)
        assert sim_plain[0] == plain_tokens and torch.equal(plain_logits, sim_plain[1]), f"rank {rank}: plain differs"
        # The fused path on the job's own tokens: its norm's mean is a tree sum inside the kernel.
        sim_fused = greedy(lambda t: decode_step(sims, sim_caches, simulated_fused, t), sim_caches, new_tokens, tokens)
        drift = close_choices(tokens, logits, sim_fused[1], rel)

        # transformers' own forward of the unsharded model over the whole sequence (no cache).
        ref_logits = pristine(torch.tensor([tokens[:-1]], device=device)).logits[0].float().cpu()
        ref_drift = close_choices(tokens, logits, ref_logits, rel)
        same = ref_logits[len(PROMPT) - 1 :].argmax(-1).tolist() == tokens[len(PROMPT) :]
    where = "" if device.type == "cuda" else " (host backend: the interpreter, not a speed figure)"
    for mode, t in times.items():
        lines.append(
            f"rank {rank}: per token, {mode}{where}: fused {t['fused']:.0f} us, plain {t['plain']:.0f} us, "
            f"no communication {t['none']:.0f} us"
        )
    lines[:0] = [
        f"rank {rank}: {world}-way tensor parallel, {len(full.model.layers)} layers, hidden {hidden}, {dtype_name}",
        f"rank {rank}: tokens {tokens[len(PROMPT) :]}: "
        + ("transformers' unsharded model gives the same tokens" if same else "each one transformers' best")
        + f" (its logits within {ref_drift:.1e})",
        f"rank {rank}: plain all-reduce: logits bit for bit the member-order simulation's",
        f"rank {rank}: fused all-reduce + residual + RMS norm: the simulation's tokens and logits (see below)",
        f"rank {rank}: fused logits: at most {drift:.1e} from the simulation's (the norm's mean is a tree sum)",
    ]
    return {"lines": lines, "us_per_token": times, "tokens": tokens, "fused_drift": drift}
    # --8<-- [end:main_fn]


# --8<-- [start:main]
if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="symmsync tutorial 12: Llama tensor-parallel")
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    parser.add_argument("--model", default=None, help="a local Llama checkpoint (default: a small random one)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--tokens", type=int, default=NEW_TOKENS, help="tokens to generate")
    parser.add_argument("--hidden", type=int, default=128, help="the random model's hidden size")
    parser.add_argument("--layers", type=int, default=2, help="the random model's layers")
    parser.add_argument("--json", default=None, help="write every rank's step times here")
    parser.add_argument("--ranks", type=int, default=2, help="the processes run() starts (not under torchrun)")
    parser.add_argument("--compile", default="", choices=("", "aot_eager", "inductor"), help="also run it compiled")
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.ranks  # torchrun's ranks, or run()'s
    size = (args.hidden, args.layers)
    results = run(llama_tp, world, args.backend, args.model, args.dtype, args.tokens, size, args.compile,
                  backend=args.backend, timeout_s=900)  # fmt: skip
    if is_main_process():  # print once, also under torchrun
        for r in results:
            print("\n".join(r["lines"]))
        if args.json:
            device = torch.cuda.get_device_name() if args.backend == "cuda" else "host backend (CPU)"
            with open(args.json, "w") as f:
                json.dump({"device": device, "world": world, "dtype": args.dtype, "hidden": args.hidden,
                           "layers": args.layers, "ranks": results}, f, indent=1)  # fmt: skip
# --8<-- [end:main]
