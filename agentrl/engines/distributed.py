"""The weight-update process group, built the way SGLang builds it, so a trainer and SGLang
or embedded engines can meet in one group: rank 0 is the trainer (it hosts the tcp://
store), the engines are ranks rank_offset + tp_rank. No default process group is needed
on either side, and the trainer's own (Megatron's, say) is left alone.

SGLang 0.5.15 does the same in `sglang.srt.utils.common.init_custom_process_group`:
rendezvous on the tcp:// URL, a PrefixStore named after the group, then torch's
`_new_process_group_helper` (a private torch API; SGLang and slime rely on it too).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


def init_custom_process_group(*, backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout_s: float = 600.0):
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy(group) -> None:
    try:
        dist.destroy_process_group(group)
    except Exception:
        pass
