"""The distributed optimizer's checkpoint state, saved and loaded without its host blow-up.

megatron-core's `fully_reshardable` format (megatron/core/optimizer/distrib_optimizer.py) keeps,
per parameter and state key (param, exp_avg, exp_avg_sq), one fp32 tensor of the parameter's
shape under `optimizer.state.<key>.<the parameter's sharded key>`: it loads into any TP/PP/EP/DP
layout. megatron-core (0.16 to 0.19) has every rank hold the whole DP group's state for it:

- save: get_parameter_state_dp_zero all-gathers every DP shard into DP-wide fp32 host buffers
  on every rank (then clones each parameter's slice as it writes): at 7B, TP=2 x DP=2, over
  100 GB per rank;
- load: get_parameter_state_dp_zero(empty_data=True) allocates the same DP-wide buffers, every
  rank asks dist_checkpointing for every parameter's whole state into them, and only then
  keeps its slice (load_parameter_state_from_fully_reshardable): DP times its own shard
  (about 39 GB per rank at 7B, DP=2).

Here, in the same format (a checkpoint either writes loads with either):

- save: each parameter's state is gathered onto one DP rank (owners spread by size), which
  alone lists it (the owner is its main replica);
- load: each rank lists, of each parameter, only the slice its DP shard owns, as boxes of the
  parameter's tensor (a flat slice of an N-d tensor is a few boxes: a partial row, whole rows,
  a partial row, recursively), whose data are views into this rank's own main parameter and
  Adam moments. dist_checkpointing reads each box in place (torch's FileSystemReader stages one
  stored tensor at a time), so a rank holds its own shard plus one stored tensor.

Installed once where the optimizer is built (install); where a case is not covered
(precision-aware or hybrid-device optimizer state, non-fp32 state, a sharded factory that is
not a view of its tensor) the load is megatron-core's own.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import torch

_PIECE = 2**20  # elements: a 4 MB receive buffer in the save's gather
KEYS = ("param", "exp_avg", "exp_avg_sq")  # what megatron-core's fully_reshardable stores per parameter


def install(optimizer) -> None:
    """On each distributed optimizer of `optimizer` (chained or not): the save and the load of
    its fully_reshardable state are this module's."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer] if optimizer is not None else []):
        if isinstance(opt, DistributedOptimizer) and not opt.ddp_config.use_megatron_fsdp:
            opt.sharded_param_state_fully_reshardable = partial(sharded_param_state, opt)
            opt.load_parameter_state_from_fully_reshardable = partial(_load_parameter_state, opt)


def sharded_param_state(opt, model_sharded_state_dict, is_loading: bool = False, metadata: dict | None = None):
    """Stands in for DistributedOptimizer.sharded_param_state_fully_reshardable."""
    if is_loading:
        state = _load_boxes(opt, model_sharded_state_dict)
        opt._agentrl_loads_in_place = state is not None
        if state is None:
            return type(opt).sharded_param_state_fully_reshardable(opt, model_sharded_state_dict, is_loading, metadata)
        return state
    return _owned_save_state(opt, model_sharded_state_dict)


def _load_parameter_state(opt, state_dict: dict) -> None:
    """Stands in for DistributedOptimizer.load_parameter_state_from_fully_reshardable: after the
    in-place load there is nothing left to copy."""
    if getattr(opt, "_agentrl_loads_in_place", False):
        opt._agentrl_loads_in_place = False
        return
    type(opt).load_parameter_state_from_fully_reshardable(opt, state_dict)


def _param_order(opt) -> list:
    """The parameters in fully_reshardable's order (its state dict's integer keys)."""
    return [p for gbuf_idx, maps in enumerate(opt.gbuf_ranges) for _ in maps
            for p in opt.buffers[gbuf_idx].param_index_map]


def _owned_ranges(opt) -> dict:
    """model parameter -> (start, end): this DP rank's slice of it, flattened."""
    return {p: (r["param"].start, r["param"].end) for maps in opt.gbuf_ranges for per_bucket in maps.values()
            for bucket in per_bucket for p, r in bucket["param_map"].items()}


def _model_sharded(model_sharded_state_dict) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    return {sh.data: sh for sh in nested_values(sharded)}


def _main_replica(replica_id):
    """This DP rank is the main replica along DP (the last axis of megatron's replica ids)."""
    return (*replica_id[:-1], 0) if isinstance(replica_id, tuple) else 0


# -- load ------------------------------------------------------------------------------------------

def _load_boxes(opt, model_sharded_state_dict) -> dict | None:
    """{param index: {key: [ShardedTensor box, ...]}}, each box's data a view into this rank's
    own state; None where this module does not cover the optimizer (megatron-core's load then)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 or isinstance(opt.optimizer, HybridDeviceOptimizer):
        return None
    meta = _model_sharded(model_sharded_state_dict)
    mine = _owned_ranges(opt)
    state = {}
    for i, p in enumerate(_param_order(opt)):
        if p not in mine:
            continue
        if p not in meta:
            raise ValueError(f"optimizer load: a parameter of shape {tuple(p.shape)} is not in the model's sharded "
                             "state dict (megatron-core's KEEP_VARS_HINT: state_dict(keep_vars=True))")
        start, end = mine[p]
        group, order = opt.model_param_group_index_map[p]
        main = opt.optimizer.param_groups[group]["params"][order]
        dst = {"param": main, **opt.optimizer.state.get(main, {})}
        if any(k not in dst for k in KEYS):
            return None  # no Adam state to read into yet: megatron-core's load allocates it
        flat = {}
        for k in KEYS:
            t = dst[k].detach()
            if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != end - start:
                return None
            flat[k] = t.view(-1)
        state[i] = {}
        for k in KEYS:
            pieces = _pieces(meta[p], f"optimizer.state.{k}.{meta[p].key}")
            if pieces is None:
                return None
            state[i][k] = [box for sh, offset in pieces for box in _slice_boxes(sh, offset, start, end, flat[k])]
    return state


def _pieces(sh, key: str):
    """The ShardedTensors the parameter's state is stored as, each with its offset in the
    parameter's flattened tensor: the parameter's own one, or what its factory builds (SwiGLU's
    fc1: two halves, `torch.chunk` views); None for a factory whose tensors are not views."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    base = torch.empty(sh.data.shape, dtype=torch.float32, device="meta")  # shapes and offsets, no memory
    if not isinstance(sh, ShardedTensorFactory):
        return [(replace(sh, key=key, data=base, dtype=base.dtype), 0)]
    out = []
    for built in nested_values(replace(sh, key=key, data=base).build()):
        if (not isinstance(built, ShardedTensor) or built.data is None or not built.data.is_contiguous()
                or not (built.data is base or built.data._base is base)):
            return None
        out.append((built, built.data.storage_offset()))
    if sum(b.data.numel() for b, _ in out) != base.numel():
        return None
    return out


def _slice_boxes(sh, offset: int, start: int, end: int, flat: torch.Tensor) -> list:
    """The boxes of sh (stored from `offset` of the parameter's flattened tensor) that cover
    [start, end) of it, as ShardedTensors whose data are views of `flat` (this rank's state,
    flat[0] being element `start`)."""
    lo, hi = max(start, offset), min(end, offset + math.prod(sh.local_shape))
    boxes = []
    n = sh.prepend_axis_num
    for box_offset, box_shape, flat_start in flat_boxes(sh.local_shape, lo - offset, hi - offset):
        a = offset + flat_start - start
        # the prepended axes (a layer's index in its stack) as leading 1s: dist_checkpointing's
        # irregular shards (torch DCP chunks) take offsets and sizes of the global tensor's rank
        data = flat[a:a + math.prod(box_shape)].view(*(1,) * n, *box_shape)
        boxes.append(replace(sh, data=data, dtype=data.dtype, local_shape=tuple(data.shape), prepend_axis_num=0,
                             global_offset=(*sh.global_offset[:n],
                                            *(g + o for g, o in zip(sh.global_offset[n:], box_offset))),
                             axis_fragmentations=None,  # irregular: dist_checkpointing reshards it by offsets
                             replica_id=_main_replica(sh.replica_id)))
    return boxes


def flat_boxes(shape: tuple, a: int, b: int):
    """The flat range [a, b) of a C-ordered tensor of `shape`, as boxes (offset, shape, flat
    start), in order, each one contiguous: at most two partial pieces per axis and one of whole
    rows."""
    if a >= b:
        return
    if not shape:
        yield (), (), 0
        return
    inner = math.prod(shape[1:])
    first, last = -(-a // inner), b // inner  # the whole rows are [first, last)
    if first > last:  # within one row
        r = a // inner
        for off, size, f in flat_boxes(shape[1:], a - r * inner, b - r * inner):
            yield (r, *off), (1, *size), r * inner + f
        return
    if a < first * inner:  # the tail of the row before the whole ones
        r = first - 1
        for off, size, f in flat_boxes(shape[1:], a - r * inner, inner):
            yield (r, *off), (1, *size), r * inner + f
    if first < last:
        yield (first, *[0] * (len(shape) - 1)), (last - first, *shape[1:]), first * inner
    if last * inner < b:  # the head of the row after them
        for off, size, f in flat_boxes(shape[1:], 0, b - last * inner):
            yield (last, *off), (1, *size), last * inner + f


# -- save ------------------------------------------------------------------------------------------

def _owned_save_state(opt, model_sharded_state_dict) -> dict:
    """Each parameter's whole state on one DP rank, its owner, which alone lists it."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    group = opt.data_parallel_group
    me, ranks = group.rank(), dist.get_process_group_ranks(group)
    meta = _model_sharded(model_sharded_state_dict)
    params = _param_order(opt)
    mine = _owned_ranges(opt)
    slices: list = [None] * group.size()
    dist.all_gather_object(slices, [mine.get(p, (0, 0)) for p in params], group=group)
    owner, load = {}, [0] * group.size()
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        owner[i] = load.index(min(load))
        load[owner[i]] += params[i].numel()
    state = {}
    for i, p in enumerate(params):
        local = opt._get_main_param_and_optimizer_states(p) if p in mine else {}
        out = {}
        for key in KEYS:
            full = torch.empty(p.numel(), dtype=torch.float32) if owner[i] == me else None
            for r, (start, end) in enumerate(s[i] for s in slices):
                if end <= start:  # that rank holds none of this parameter
                    continue
                if r == me and full is not None:
                    full[start:end].copy_(local[key].detach().view(-1))
                    continue
                # in pieces of _PIECE elements: a bounded receive buffer (on the GPU with NCCL)
                for a in range(start, end, _PIECE):
                    b = min(a + _PIECE, end)
                    if r == me:
                        piece = local[key].detach().view(-1)[a - start:b - start]
                        dist.send(piece.float().contiguous(), ranks[owner[i]], group=group)
                    elif full is not None:
                        part = torch.empty(b - a, dtype=torch.float32, device=p.device)
                        dist.recv(part, ranks[r], group=group)
                        full[a:b].copy_(part)
            out[key] = full
        if owner[i] != me:
            continue
        sh = meta[p]
        tensors = {}
        for key, full in out.items():
            kw = dict(key=f"optimizer.state.{key}.{sh.key}", data=full.view(sh.data.shape), dtype=full.dtype,
                      replica_id=_main_replica(sh.replica_id))  # the owner is this state's main replica
            if isinstance(sh, ShardedTensorFactory):
                kw.pop("dtype")
            tensors[key] = replace(sh, **kw)
            tensors[key].validate_metadata_integrity()
        state[i] = tensors
    return state
