"""`--balance-data` (slime's): each global batch split across data-parallel ranks so every rank
gets a near-equal number of tokens, by the largest differencing method (Karmarkar-Karp), as
slime does (slime/utils/seqlen_balancing.py, from verl). Without it the Megatron trainer
splits by a greedy longest-first pass (trainers/megatron/packing.py), already close; the
differencing method gets closer on skewed lengths, where a few long samples dominate.

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
