"""The embedded engine's prefix cache: KV caches of recently finished sequences, keyed by
their tokens, reused when a new request's input_ids start with (part of) one of them.

This is what SGLang's radix cache does for multi-turn agents: turn k+1's prompt is turn k's
prompt + its answer + the env's reply, so with session affinity only the new suffix needs a
prefill. Here an LRU of whole sequences stands in for the radix tree:

- `lookup(ids)` finds the entry sharing the longest prefix with `ids` (an index of prefix
  hashes at every BLOCK-token boundary finds the entries sharing the longest whole-block
  prefix; the most recent of them are extended token by token and the longest match
  wins), and returns that many tokens' KV, at most len(ids) - 1 so the last prompt token
  is always prefilled (its logits pick the first new token).
- `insert(tokens, kv)` stores a finished sequence; the oldest entries go when the cache
  holds more than `max_tokens` tokens.

KV tensors are kept per layer as (key, value) of shape [kv_heads, num_tokens, head_dim].
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK = 16  # prefix-hash granularity (tokens); shorter shared prefixes are not reused
MAX_CANDIDATES = 256  # entries sharing the longest matched block that are extended token by token


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [kv_heads, n, head_dim] x 2
    keys: list[tuple[int, int]] = field(default_factory=list)  # index keys (block end, hash)


def _block_hashes(tokens: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    return [(end, hash(tuple(tokens[:end]))) for end in range(BLOCK, len(tokens) + 1, BLOCK)]


class PrefixCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.index: dict[tuple[int, int], OrderedDict[tuple[int, ...], None]] = {}
        self.num_tokens = 0
        self.stats = {"lookups": 0, "hits": 0, "prompt_tokens": 0, "cached_tokens": 0, "evictions": 0}

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.index.clear()
        self.num_tokens = 0

    def lookup(self, ids: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """(number of reused tokens, their KV per layer) for the longest cached prefix of ids."""
        self.stats["lookups"] += 1
        self.stats["prompt_tokens"] += len(ids)
        limit = len(ids) - 1
        best, best_len = None, 0
        if limit >= BLOCK and self.entries:
            # the longest block boundary whose prefix hash is indexed, then verify and extend
            for end, h in reversed(_block_hashes(ids[:limit])):
                bucket = self.index.get((end, h))
                if not bucket:
                    continue
                # entries sharing that prefix differ after it (siblings of a GRPO group share
                # the prompt, not the answer): extend the most recent ones, keep the longest
                head = tuple(ids[:end])
                for key in itertools.islice(reversed(bucket), MAX_CANDIDATES):
                    entry = self.entries[key]
                    if entry.tokens[:end] != head:  # a hash collision
                        continue
                    n, stop = end, min(len(entry.tokens), limit)
                    while n < stop and entry.tokens[n] == ids[n]:
                        n += 1
                    if n > best_len:
                        best, best_len = entry, n
                        if n == stop:
                            break
                if best is not None:
                    break
        if best is None:
            return 0, None
        self.entries.move_to_end(best.tokens)
        for k in best.keys:
            self.index[k].move_to_end(best.tokens)
        self.stats["hits"] += 1
        self.stats["cached_tokens"] += best_len
        return best_len, [(k[:, :best_len], v[:, :best_len]) for k, v in best.kv]

    def insert(self, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        key = tuple(tokens)
        if len(key) < BLOCK or len(key) > self.max_tokens:
            return
        if key in self.entries:
            self._remove(key)
        entry = _Entry(key, kv, _block_hashes(key))
        self.entries[key] = entry
        for k in entry.keys:
            self.index.setdefault(k, OrderedDict())[key] = None
        self.num_tokens += len(key)
        while self.num_tokens > self.max_tokens and self.entries:
            self._remove(next(iter(self.entries)))
            self.stats["evictions"] += 1

    def _remove(self, key: tuple[int, ...]) -> None:
        entry = self.entries.pop(key)
        self.num_tokens -= len(key)
        for k in entry.keys:
            bucket = self.index.get(k)
            if bucket is not None:
                bucket.pop(key, None)
                if not bucket:
                    del self.index[k]


def layer_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (key, value) tensors [B, kv_heads, T, head_dim] of an HF cache object
    (transformers 5's `.layers`, or 4.x's `.key_cache` / `.value_cache`)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def build_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """An HF DynamicCache holding the given per-layer [B, kv_heads, T, head_dim] tensors."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache
