"""Give a trainer's device memory back while the engines generate (--colocate), and take it
again before training, for both trainers.

Everything a trainer holds on the device goes: weights, gradients (Megatron's contiguous
grad buffers, which `param.main_grad` views), the optimizer's state and its fp32 master
weights, the reference model and the critic. It works on storages, not tensors: each storage
is copied to host memory and resized to zero, then resized back and refilled. Every tensor
object and every view of it (a parameter, a grad-buffer view, an optimizer's reference)
stays valid, which `module.to("cpu")` would not guarantee: it swaps `param.data` and leaves
Megatron's buffers and the optimizer's master weights behind.

Gradients are the exception: both trainers zero them at the start of every step, so their
storages are freed without a copy and come back zeroed (at 1.5B, Megatron's fp32 grad buffers
are 6 of the 29 GiB: a fifth of each switch's host traffic).

What fits beside the engines stays (`keep_bytes`, from `bytes_to_keep`): every byte moved
crosses the host link twice an iteration (~50 GB/s: at 1.5B, ~1 s of a 15-s iteration), while
SGLang's engines take back only their static share of the GPU on resume.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

# What a trainer (TorchTrainer, MegatronTrainer) holds on the device, by attribute.
TRAINER_PARTS = ("model", "ddp", "ref_model", "critic", "critic_ddp", "optimizer", "critic_optimizer")


def trainer_parts(trainer) -> list:
    """What `trainer` holds on the device, by TRAINER_PARTS (None where it has no such part)."""
    return [getattr(trainer, name, None) for name in TRAINER_PARTS]


def held_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from modules, optimizers (torch's or Megatron's wrappers) and lists."""
    if obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        for _, p in obj.named_parameters():
            yield p
            yield from (g for g in (p.grad, getattr(p, "main_grad", None)) if g is not None)
        for _, b in obj.named_buffers():
            yield b
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from held_tensors(item)
    else:
        for opt in _torch_optimizers(obj):
            for group in opt.param_groups:
                for p in group["params"]:
                    yield p
                    if p.grad is not None:
                        yield p.grad
            for state in opt.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _torch_optimizers(obj: Any) -> Iterator[torch.optim.Optimizer]:
    """torch optimizers, themselves or inside Megatron's wrappers (one, or a chain), in lists."""
    if isinstance(obj, torch.optim.Optimizer):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _torch_optimizers(item)
    elif obj is not None and not isinstance(obj, (torch.Tensor, torch.nn.Module)):
        chain = getattr(obj, "chained_optimizers", None)
        if chain is not None:  # a ChainedOptimizer's `.optimizer` asserts it holds one (MoE: dense + expert)
            yield from _torch_optimizers(chain)
        else:
            yield from _torch_optimizers(getattr(obj, "optimizer", None))


def _storages(tensors) -> Iterator[tuple[torch.Tensor, torch.UntypedStorage]]:
    """Each non-empty storage behind `tensors` once, with the first tensor seen on it."""
    seen = set()
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            yield t, storage


def gradient_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The gradients among held_tensors(obj) (`.grad`, Megatron's `main_grad` grad-buffer views)."""
    for t in held_tensors(obj):
        if isinstance(t, torch.nn.Parameter) or getattr(t, "requires_grad", False):
            yield from (g for g in (t.grad, getattr(t, "main_grad", None)) if g is not None)


class Offloaded:
    """The storages of `tensors` (each once), moved to host memory; `restore()` brings them back.
    `spare`: the host buffers of an earlier offload (`.hosts`), each reused for a storage of its
    size: pinning fresh host memory costs far more than the copy (1.5B, H200: 26 s
    to pin and copy Megatron's 29 GiB the first time). `discard`: tensors whose contents need
    not survive (gradients): freed without a copy, restored as zeros. `keep_bytes`: up to this
    many bytes of the rest stay where they are (the largest storages that fit)."""

    def __init__(self, tensors, spare: list[torch.Tensor] | None = None, discard=(), keep_bytes: int = 0):
        self.saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self.hosts: list[torch.Tensor] = []
        self.dropped: list[tuple[torch.UntypedStorage, int]] = []
        pool: dict[int, list[torch.Tensor]] = {}  # spare buffers by size: storages may come and go between
        for host in spare or []:                  # offloads (Adam's moments appear at the first step)
            pool.setdefault(host.numel(), []).append(host)
        discarded = {t.untyped_storage().data_ptr() for t in discard}
        storages = list(_storages(tensors))
        kept, self.kept_bytes = set(), 0
        for _, storage in sorted(storages, key=lambda ts: -ts[1].nbytes()):  # largest first: the fewest
            if storage.data_ptr() not in discarded and self.kept_bytes + storage.nbytes() <= keep_bytes:
                kept.add(storage.data_ptr())
                self.kept_bytes += storage.nbytes()
        for t, storage in storages:
            if storage.data_ptr() in kept:
                continue
            if not storage.resizable():  # CUDA allocations always are; a CPU tensor may map a file
                raise RuntimeError(f"cannot offload a tensor of shape {tuple(t.shape)}: its storage is not "
                                   "resizable (memory-mapped weights?)")
            if storage.data_ptr() in discarded:
                self.dropped.append((storage, storage.nbytes()))
                storage.resize_(0)
                continue
            same_size = pool.get(storage.nbytes())
            if same_size:
                host = same_size.pop(0)
            else:
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.untyped_storage().copy_(storage)
            self.saved.append((storage, host))
            self.hosts.append(host)
            storage.resize_(0)
        self.bytes = sum(h.numel() for h in self.hosts)
        self.dropped_bytes = sum(n for _, n in self.dropped)
        self.spare_left = [h for left in pool.values() for h in left]  # for storages still to come

    def restore(self) -> None:
        for storage, host in self.saved:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage())
        for storage, nbytes in self.dropped:
            storage.resize_(nbytes)
            storage.fill_(0)
        self.saved.clear()
        self.dropped.clear()


def host_buffers_for(trainer, device_type: str = "cuda") -> list[torch.Tensor]:
    """Pinned host buffers for what offloading `trainer` will copy, made ahead of time (pinning
    runs at ~3 GB/s, about ten times slower than the copy: at 1.5B, 6-9 s in each of iterations
    0 and 1 before). One per device storage the trainer holds (gradients excepted) and, for an
    Adam optimizer that has not stepped yet, two per parameter for the moments it will create."""
    parts = trainer_parts(trainer)
    gradients = {g.untyped_storage().data_ptr() for g in gradient_tensors(parts)}
    sizes = [storage.nbytes() for _, storage in _storages(held_tensors(parts))
             if storage.device.type == device_type and storage.data_ptr() not in gradients]
    for opt in _torch_optimizers(parts):
        if "Adam" in type(opt).__name__:
            sizes += [p.numel() * p.element_size() for g in opt.param_groups for p in g["params"]
                      if p.device.type == device_type and not opt.state.get(p) for _ in range(2)]
    return [torch.empty(n, dtype=torch.uint8, pin_memory=device_type == "cuda") for n in sizes]


# What the engines may allocate beyond their static pool while they generate (activations,
# sampling buffers): the kept state leaves at least this much of the GPU free after their resume.
ENGINE_HEADROOM_BYTES, ENGINE_HEADROOM_SHARE = 4 << 30, 0.06


def resident_budget(*, free: int, total: int, offloadable: int, engines_take: int) -> int:
    """Bytes of a trainer's state that may stay on a GPU of `total` bytes while engines take back
    `engines_take` of it: what would be free with all `offloadable` bytes gone, less that and
    the headroom."""
    headroom = max(ENGINE_HEADROOM_BYTES, ENGINE_HEADROOM_SHARE * total)
    return max(0, int(free + offloadable - engines_take - headroom))


def bytes_to_keep(trainer, engine_fraction: float, engines_released: bool) -> int:
    """resident_budget on this process's GPU as it is now. SGLang's engines resume into at most
    `engine_fraction` of the GPU (--mem-fraction-static sizes weights + KV pool against the
    total); before their first release (iteration 0) they still hold it, and `free` says so."""
    parts = trainer_parts(trainer)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    offloadable = sum(s.nbytes() for _, s in _storages(held_tensors(parts)) if s.device.type == "cuda")
    return resident_budget(free=free, total=total, offloadable=offloadable,
                           engines_take=int(engine_fraction * total) if engines_released else 0)


def offload_trainer(trainer, spare: list[torch.Tensor] | None = None, keep_bytes: int = 0) -> Offloaded:
    parts = trainer_parts(trainer)
    out = Offloaded(held_tensors(parts), spare, discard=list(gradient_tensors(parts)), keep_bytes=keep_bytes)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out
