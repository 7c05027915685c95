"""`--balance-data` (slime's): each global batch split across data-parallel ranks so every rank
gets a near-equal share of estimated forward FLOPs (forward_flops), by the largest differencing
method (Karmarkar-Karp), as slime does. Without it the Megatron trainer splits by tokens in a
greedy longest-first pass (trainers/megatron/packing.py). Weighing by FLOPs matters on mixed
lengths: attention's cost grows with the square of the length, so equal tokens leave the rank
with the long samples the most work. `--balance-by-flops` forms the micro-batches by FLOPs too
(cost_micro_batches).

Which rank trains a sample changes nothing in the loss: it is a token sum over the whole
global batch divided by the batch's trained-token count, whatever the split."""

from __future__ import annotations

import heapq
import itertools


def karmarkar_karp(lengths: list[int], parts: int, *, equal_size: bool = False) -> list[list[int]]:
    """Indices of `lengths` in `parts` groups of near-equal total length, each group in index
    order. equal_size: every group gets len(lengths) / parts items (it must divide).

    Each item (or, with equal_size, each run of `parts` consecutive items in sorted order) starts
    as a partial partition; the two with the largest spread (heaviest group - lightest) are
    merged heaviest-to-lightest, until one partition is left."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if equal_size and len(lengths) % parts:
        raise ValueError(f"equal_size: {len(lengths)} items do not split into {parts} equal groups")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    seeds = [order[j:j + parts] for j in range(0, len(order), parts)] if equal_size else [[i] for i in order]
    heap: list = []
    tie = itertools.count()  # equal spreads: first made, first merged

    def push(groups: list[tuple[int, list[int]]]) -> None:
        groups = sorted(groups, key=lambda g: -g[0])  # heaviest first
        heapq.heappush(heap, (groups[-1][0] - groups[0][0], next(tie), groups))  # largest spread first

    for seed in seeds:
        push([(lengths[i], [i]) for i in seed] + [(0, [])] * (parts - len(seed)))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        push([(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))])
    groups = heap[0][2] if heap else [(0, [])] * parts
    return [sorted(items) for _, items in groups]


def forward_flops(length: int, hf: dict) -> int:
    """Estimated forward FLOPs of one sequence of `length` tokens through the model of HF
    config `hf` (its text half for a multimodal model): the matmuls, linear in the length, plus
    causal attention's scores and weighted sum, quadratic in it. slime's `--balance-data` and
    `--balance-by-flops` weigh samples this way, so one long sample counts for more than the
    same tokens in many short ones."""
    hf = {**hf, **(hf.get("text_config") or {})}
    hidden, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or hidden // heads
    kv_heads = hf.get("num_key_value_heads") or heads
    experts = hf.get("num_experts") or hf.get("n_routed_experts") or hf.get("num_local_experts")
    if experts:  # the routed experts each token goes to, plus a shared one where the family has it
        ffn = (hf["moe_intermediate_size"] * hf["num_experts_per_tok"]
               + (hf.get("shared_expert_intermediate_size") or 0))
    else:
        ffn = hf["intermediate_size"]
    # per token and layer: q, k, v and output projections, and the gated MLP's three matmuls
    per_token = 2 * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * ffn)
    # per layer: causal QK^T and attention x V, each ~L^2/2 dot products of head_dim per head
    attention = 2 * heads * head_dim * length * (length + 1)
    return layers * (per_token * length + attention) + 2 * hidden * hf["vocab_size"] * length


def cost_micro_batches(costs: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """`--balance-by-flops`: as many micro-batches as `max_tokens` needs for the total length
    (each sample its own when there are no more samples than that), with near-equal cost by
    Karmarkar-Karp. The token budget is then a target, not a cap: a micro-batch of many short
    samples can pass it (slime says the same: it may need more memory)."""
    count = max(1, -(-sum(lengths) // max_tokens))
    if count >= len(lengths):
        return [[i] for i in range(len(lengths))]
    return [g for g in karmarkar_karp(costs, count) if g]
