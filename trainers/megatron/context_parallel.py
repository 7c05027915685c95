"""Context parallelism for the local-spec (no Transformer Engine) Megatron trainer.

Layout (megatron-core's load-balanced one): every packed sequence is padded to a multiple of
2 x CP tokens (packing.pack's seq_pad) and cut into 2 x CP equal chunks; CP rank r keeps
chunks r and 2 x CP - 1 - r of every sequence, so each rank gets an early and a late chunk
and the causal work is even. Everything per token (tokens, positions, logit rows, targets,
routing) is split the same way; a micro-batch's local tokens are, sequence by sequence, its
two chunks.

Attention (layers.SDPAttention, all-gather K/V as Llama 3's CP): K and V are all-gathered over
the CP group (the backward pass sums their gradients back to the owning rank), each
sequence's full K/V is rebuilt in order, and each local query chunk attends to the key
prefix that ends with that chunk: causal, aligned bottom-right (the chunk's last query sees
the whole prefix). Two calls: first chunks, then second chunks, each over the packed
prefixes of every sequence.

Loss: each rank computes the logprobs of the response tokens whose logit rows it holds;
`CPShare.gather` puts them in the micro-batch's flat order on every CP rank (a sum over
the group of zero-filled vectors; the backward pass hands each rank its own tokens' gradient),
so every loss (sequence-level ones included) is computed unchanged on every rank. megatron-
core's schedule multiplies the loss by the CP size, and DDP averages gradients over the
data-parallel-with-CP group: the sum over CP ranks of each one's share is the whole gradient.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass
class CPShare:
    """One CP rank's share of one packed micro-batch, and how its attention is assembled."""
    size: int
    rank: int
    group: object  # the CP process group
    local_tokens: int  # T_local (every CP rank holds the same number)
    resp_index: torch.Tensor  # [N_local] where this rank's response tokens sit in the flat N order
    num_resp: int  # N
    # per half (0: each sequence's early chunk, 1: its late chunk):
    q_rows: tuple[torch.Tensor, torch.Tensor]  # local rows of the queries
    kv_rows: tuple[torch.Tensor, torch.Tensor]  # rows of the all-gathered [CP x T_local] K/V: the prefixes
    cu_q: tuple[torch.Tensor, torch.Tensor]  # int32 cu_seqlens of the query chunks
    cu_k: tuple[torch.Tensor, torch.Tensor]  # int32 cu_seqlens of the key prefixes
    max_q: tuple[int, int]
    max_k: tuple[int, int]
    unperm: torch.Tensor  # local row -> its row in cat(half 0 output, half 1 output)

    def to(self, device) -> "CPShare":
        move = lambda pair: tuple(t.to(device, non_blocking=True) for t in pair)  # noqa: E731
        self.q_rows, self.kv_rows, self.cu_q, self.cu_k = (move(p) for p in (self.q_rows, self.kv_rows,
                                                                           self.cu_q, self.cu_k))
        self.resp_index = self.resp_index.to(device, non_blocking=True)
        self.unperm = self.unperm.to(device, non_blocking=True)
        return self

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return _ToFull.apply(local, self.resp_index, self.num_resp, self.group)


def chunk_rows(cu_seqlens: list[int], cp: int, rank: int) -> list[tuple[int, int]]:
    """[start, end) packed rows of the two chunks CP rank `rank` keeps of every sequence, in
    local order (sequence by sequence: early chunk, late chunk)."""
    out = []
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        length = e - s
        if length % (2 * cp):
            raise ValueError(f"context parallelism: a packed sequence of {length} tokens is not a multiple of "
                             f"2 x CP = {2 * cp} (pack with seq_pad=2*CP)")
        c = length // (2 * cp)
        out += [(s + rank * c, s + (rank + 1) * c), (s + (2 * cp - 1 - rank) * c, s + (2 * cp - rank) * c)]
    return out


def split(mb, cp: int, rank: int, group):
    """This CP rank's share of packed micro-batch `mb` (packing.PackedBatch, every sequence a
    multiple of 2 x CP long), in place: per-token fields cut to the rank's rows, `mb.cp` set."""
    cu = mb.cu_seqlens.tolist()
    spans = [chunk_rows(cu, cp, r) for r in range(cp)]
    mine = spans[rank]
    rows = torch.cat([torch.arange(s, e) for s, e in mine])  # global packed rows, local order
    t_local = rows.numel()
    where = torch.full((mb.num_tokens,), -1, dtype=torch.long)
    where[rows] = torch.arange(t_local)
    local_of_logit = where[mb.logit_index.cpu()]
    keep = (local_of_logit >= 0).nonzero().squeeze(1)  # response tokens whose logit row is here

    # Every rank's chunk c of sequence i sits at rank j's local rows; in the all-gathered K/V
    # (rank-major), at j * T_local + that row.
    offsets = [[] for _ in range(cp)]  # per rank: local start of each of its spans
    for r in range(cp):
        pos = 0
        for s, e in spans[r]:
            offsets[r].append(pos)
            pos += e - s
    q_rows, kv_rows, cu_q, cu_k, max_q, max_k = [], [], [], [], [], []
    for half in (0, 1):
        qr, kr, cq, ck = [], [], [0], [0]
        for i in range(len(cu) - 1):
            chunk = rank if half == 0 else 2 * cp - 1 - rank
            c = (cu[i + 1] - cu[i]) // (2 * cp)
            start = offsets[rank][2 * i + half]
            qr.append(torch.arange(start, start + c))
            for k in range(chunk + 1):  # the prefix: chunks 0..chunk of sequence i
                owner, second = (k, 0) if k < cp else (2 * cp - 1 - k, 1)
                src = owner * t_local + offsets[owner][2 * i + second]
                kr.append(torch.arange(src, src + c))
            cq.append(cq[-1] + c)
            ck.append(ck[-1] + c * (chunk + 1))
        q_rows.append(torch.cat(qr))
        kv_rows.append(torch.cat(kr))
        cu_q.append(torch.tensor(cq, dtype=torch.int32))
        cu_k.append(torch.tensor(ck, dtype=torch.int32))
        lengths_q = [b - a for a, b in zip(cq[:-1], cq[1:])]
        lengths_k = [b - a for a, b in zip(ck[:-1], ck[1:])]
        max_q.append(max(lengths_q, default=0))
        max_k.append(max(lengths_k, default=0))
    unperm = torch.empty(t_local, dtype=torch.long)
    unperm[torch.cat(q_rows)] = torch.arange(t_local)

    device = mb.tokens.device
    mb.cp = CPShare(size=cp, rank=rank, group=group, local_tokens=t_local, resp_index=keep,
                    num_resp=int(mb.logit_index.numel()), q_rows=tuple(q_rows), kv_rows=tuple(kv_rows),
                    cu_q=tuple(cu_q), cu_k=tuple(cu_k), max_q=tuple(max_q), max_k=tuple(max_k),
                    unperm=unperm).to(device)
    rows_d = rows.to(device)
    mb.tokens = mb.tokens.index_select(1, rows_d)
    mb.position_ids = mb.position_ids.index_select(1, rows_d)
    mb.logit_index = local_of_logit[keep].to(device)
    mb.targets = mb.targets.index_select(0, keep.to(mb.targets.device))
    if mb.routing is not None:
        mb.routing = mb.routing.index_select(0, rows.to(mb.routing.device))
    local_cu = [0]
    for s, e in mine[::2]:
        local_cu.append(local_cu[-1] + 2 * (e - s))
    mb.cu_seqlens = torch.tensor(local_cu, dtype=torch.int32, device=mb.cu_seqlens.device)
    # mb.max_seqlen stays the longest whole sequence: RoPE computes frequencies up to it (true positions)
    return mb


# -- collectives with autograd ----------------------------------------------------------------------
class _AllGather(torch.autograd.Function):
    """x [T, ...] -> [CP x T, ...] (rank-major); backward: each rank gets the sum over the group
    of the gradients of its rows."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if grad.is_cuda:
            out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        dist.all_reduce(grad, group=group)  # gloo has no reduce-scatter
        return grad.chunk(size)[rank].contiguous(), None


class _ToFull(torch.autograd.Function):
    """Each rank's values at `index` of an n-vector, summed over the group (every index is owned
    by one rank); backward: this rank's own positions of the (identical on every rank) gradient."""

    @staticmethod
    def forward(ctx, local, index, n: int, group):
        import torch.distributed as dist
        full = local.new_zeros(n)
        full[index] = local
        dist.all_reduce(full, group=group)
        ctx.save_for_backward(index)
        return full

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad[index], None, None, None


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    return _AllGather.apply(x, group)


def attention(q, k, v, share: CPShare, attend):
    """Causal attention of this rank's queries q [T_local, h, d] over the whole sequences, from
    this rank's k, v [T_local, hk, d]. attend(q, k, v, cu_q, cu_k, max_q, max_k) is causal
    attention aligned bottom-right over packed (query chunk, key prefix) pairs."""
    k_all, v_all = all_gather(k, share.group), all_gather(v, share.group)
    outs = []
    for h in (0, 1):
        qh = q.index_select(0, share.q_rows[h])
        kh, vh = k_all.index_select(0, share.kv_rows[h]), v_all.index_select(0, share.kv_rows[h])
        outs.append(attend(qh, kh, vh, share.cu_q[h], share.cu_k[h], share.max_q[h], share.max_k[h]))
    return torch.cat(outs).index_select(0, share.unperm)


# -- RoPE ----------------------------------------------------------------------------------------------
class _OneRank:
    """A stand-in CP group of one for megatron-core's RoPE: the trainer gives each token the
    frequencies of its true position (model.enable_position_rope), so RoPE must not cut them
    again by CP rank."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def rope_without_cp_split(model) -> None:
    """Every attention module of `model` applies RoPE as if CP were 1 (see _OneRank). The
    attention core keeps the real CP group (it got it at construction)."""
    from megatron.core.transformer.attention import Attention

    for module in model.modules():
        if isinstance(module, Attention) and not isinstance(getattr(module.pg_collection, "cp", None), _OneRank):
            pgs = copy.copy(module.pg_collection)
            pgs.cp = _OneRank()
            module.pg_collection = pgs
