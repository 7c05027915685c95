"""Micro-batches for the Megatron trainer: samples split over data-parallel ranks, grouped by
token budget (`--max-tokens-per-gpu`) or by count (`--micro-batch-size`), and packed into one
sequence each (THD layout, `PackedSeqParams` with cu_seqlens), so no compute goes to padding.

Every rank holds the whole rollout and computes the same split, so pipeline stages agree on
the micro-batches without exchanging them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def balanced_split(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices split into `parts` groups of near-equal total length (longest first, each to the
    lightest group); each group keeps the original order."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = min(range(parts), key=lambda g: (load[g], len(groups[g]), g))
        groups[g].append(i)
        load[g] += lengths[i]
    return [sorted(g) for g in groups]


def token_budget_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so each group's total length stays within max_tokens (a longer sample
    gets a group of its own): as few groups as first-fit-decreasing finds, balanced."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    load: list[int] = []
    for i in order:
        for b in range(len(bins)):
            if load[b] + lengths[i] <= max_tokens:
                bins[b].append(i)
                load[b] += lengths[i]
                break
        else:
            bins.append([i])
            load.append(lengths[i])
    if len(bins) > 1:  # rebalance over the same number of groups where that still fits
        alt = balanced_split(lengths, len(bins)) if len(bins) < len(lengths) else [[i] for i in range(len(lengths))]
        if all(sum(lengths[i] for i in g) <= max_tokens or len(g) == 1 for g in alt):
            bins = alt
    return [sorted(b) for b in bins if b]


@dataclass
class PackedBatch:
    """One micro-batch, packed. Response tokens of all its samples are laid out flat (N)."""
    indices: list[int]  # the samples (indices into the rollout)
    tokens: torch.Tensor  # [1, T] token ids, T padded to a multiple of `pad_to`
    position_ids: torch.Tensor  # [1, T]; a vision-language model's multimodal ones [3, 1, T] (vision.add_images)
    cu_seqlens: torch.Tensor  # [n + 1] int32 (a padding segment at the end when T was padded)
    max_seqlen: int
    logit_index: torch.Tensor  # [N] packed position whose logits predict each response token
    targets: torch.Tensor  # [N] the response tokens
    seq_ids: torch.Tensor  # [N] which of `indices` each response token belongs to (0..n-1)
    resp_slices: list[tuple[int, int]]  # per sample, its [start, end) in the flat N
    dummy: bool = False  # a stand-in run with zero loss weight (a data-parallel rank with no samples)
    routing: torch.Tensor | None = None  # [T, layers, top-k] the engine's experts per token (routing replay)
    images: "object | None" = None  # vision.ImageInputs: the samples' images and where their embeddings go
    # Context parallelism (context_parallel.split): this rank's share of the packed tokens. Then
    # tokens/position_ids/logit_index/targets/routing are this rank's, while seq_ids,
    # resp_slices and flat() stay over every response token, and `gather` turns this rank's
    # per-token results into those of every response token.
    cp: "object | None" = None  # context_parallel.CPShare

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    def to(self, device) -> "PackedBatch":
        for name in ("tokens", "position_ids", "cu_seqlens", "logit_index", "targets", "seq_ids"):
            setattr(self, name, getattr(self, name).to(device, non_blocking=True))
        if self.cp is not None:
            self.cp.to(device)
        if self.images is not None:
            self.images.to(device)
        return self

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Per-response-token values computed on this rank ([len(logit_index)]) -> those of every
        response token of the micro-batch ([N], flat order); the identity without context parallelism."""
        return local if self.cp is None else self.cp.gather(local)

    def pad_to_length(self, length: int, pad_id: int = 0) -> "PackedBatch":
        """Padded at the end to `length` tokens, the padding a segment of its own (as pack's)."""
        pad = length - self.num_tokens
        if pad < 0:
            raise ValueError(f"a micro-batch of {self.num_tokens} tokens cannot be padded to {length}")
        if pad:
            fill = lambda t, v: torch.cat([t, v.to(t.device, t.dtype)], dim=-1)  # noqa: E731
            self.tokens = fill(self.tokens, torch.full((1, pad), pad_id))
            self.position_ids = fill(self.position_ids, torch.arange(pad).unsqueeze(0))
            self.cu_seqlens = fill(self.cu_seqlens, torch.tensor([length]))
            self.max_seqlen = max(self.max_seqlen, pad)
        return self

    def packed_seq_params(self, rope_by_position: bool = False):
        """rope_by_position: RoPE frequencies come per token (model.enable_position_rope), so
        RoPE is told the batch is one segment (cu_seqlens_*_padded = [0, T]). With context
        parallelism the params carry `cp_share` (read by layers.SDPAttention)."""
        from megatron.core.packed_seq_params import PackedSeqParams
        one = None
        if rope_by_position:
            one = torch.tensor([0, self.num_tokens], dtype=torch.int32).to(self.cu_seqlens.device, non_blocking=True)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                                 cu_seqlens_q_padded=one, cu_seqlens_kv_padded=one,
                                 max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)
        params.cp_share = self.cp
        return params

    def flat(self, per_sample: list[list[float]], device=None, dtype=torch.float32) -> torch.Tensor:
        """Per-sample response-token values (e.g. old logprobs) in this batch's flat order. [N]"""
        rows = [per_sample[i] for i in self.indices]
        # built on the host, copied without a stream sync: the loss asks for these after the forward was
        # queued, and a blocking copy would idle the GPU until that forward ended, once per micro-batch
        return torch.tensor([x for row in rows for x in row], dtype=dtype).to(device, non_blocking=True)

    def split(self, flat: torch.Tensor) -> list[list[float]]:
        values = flat.tolist()
        return [values[s:e] for s, e in self.resp_slices]


def padded_length(length: int, seq_pad: int) -> int:
    return length + (-length) % seq_pad


def pack(samples, indices: list[int], pad_to: int = 1, pad_id: int = 0, seq_pad: int = 1) -> PackedBatch:
    """seq_pad: every sequence padded at its end to a multiple of it (context parallelism splits
    each one into 2 x CP equal chunks); the padding follows the sequence's last token, so causal
    attention keeps it out of every real token's output."""
    tokens, positions, cu, logit_index, targets, seq_ids, slices = [], [], [0], [], [], [], []
    n = 0
    for k, i in enumerate(indices):
        s = samples[i]
        ids = s.tokens
        start = len(tokens)
        length = padded_length(len(ids), seq_pad)
        tokens += ids + [pad_id] * (length - len(ids))
        positions += range(length)
        cu.append(len(tokens))
        p = len(s.prompt_tokens)
        r = s.response_length
        logit_index += range(start + p - 1, start + p - 1 + r)
        targets += s.response_tokens
        seq_ids += [k] * r
        slices.append((n, n + r))
        n += r
    max_len = max((cu[j + 1] - cu[j] for j in range(len(cu) - 1)), default=0)
    pad = (-len(tokens)) % pad_to
    if pad:  # a segment of its own, so it attends only to itself
        tokens += [pad_id] * pad
        positions += range(pad)
        cu.append(len(tokens))
        max_len = max(max_len, pad)
    return PackedBatch(
        indices=list(indices), tokens=torch.tensor([tokens]), position_ids=torch.tensor([positions]),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=max_len,
        logit_index=torch.tensor(logit_index, dtype=torch.long), targets=torch.tensor(targets, dtype=torch.long),
        seq_ids=torch.tensor(seq_ids, dtype=torch.long), resp_slices=slices)


def micro_batches(samples, indices: list[int], *, dp_rank: int, dp_size: int, max_tokens: int | None,
                  micro_batch_size: int, pad_to: int = 1, pad_id: int = 0, seq_pad: int = 1) -> list[PackedBatch]:
    """This data-parallel rank's packed micro-batches of the given samples (each sequence padded
    to a multiple of seq_pad, the whole to a multiple of pad_to)."""
    lengths = [padded_length(len(samples[i].tokens), seq_pad) for i in indices]
    mine = [indices[j] for j in balanced_split(lengths, dp_size)[dp_rank]] if dp_size > 1 else list(indices)
    if not mine:
        return []
    if max_tokens is not None:
        groups = token_budget_batches([padded_length(len(samples[i].tokens), seq_pad) for i in mine], max_tokens)
        groups = [[mine[j] for j in g] for g in groups]
    else:
        groups = [mine[k:k + micro_batch_size] for k in range(0, len(mine), micro_batch_size)]
    return [pack(samples, g, pad_to=pad_to, pad_id=pad_id, seq_pad=seq_pad) for g in groups]
