"""Test-only: run megatron-core 0.16 on CPU (gloo), for tests/trainers/ on machines with no GPU.

megatron-core assumes CUDA in a few places the Megatron trainer's path goes through. This
shim changes nothing outside megatron-core and nothing in the trainer; `apply()` patches,
in every already-imported `megatron.core.*` module that holds the name `torch`:

1. the module-global `torch` -> `_TorchProxy`, which forwards everything to torch except
   - factory functions (`tensor, zeros, ones, empty, full, arange, randn, rand`) whose
     `device=` is CUDA ('cuda', 'cuda:N', an int, a cuda torch.device): it becomes 'cpu';
   - `torch.cuda` -> `_CudaProxy`: `current_device()` returns torch.device('cpu'),
     `synchronize/empty_cache` do nothing, `Stream/stream/current_stream/default_stream`
     are no-op stand-ins (their `record_event()` an event that is always done: the MoE
     token dispatcher waits on one), `is_available()` is False; the rest is torch.cuda's;
   - `torch.autocast('cuda', ...)` -> `torch.autocast('cpu', enabled=False)`;
   (megatron's grad buffers, optimizer scalars, pipeline p2p buffers, sequence-parallel
   gather buffers and grad-norm scratch all ask for `device='cuda'`/`current_device()`).
2. `megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork` -> a no-op context
   (it swaps CUDA RNG states; the embedding forks it under sequence parallelism; dropout
   is 0 in these tests, so no random numbers are drawn inside);
3. `torch.Tensor.cuda` -> returns the tensor itself, only when this torch sees no CUDA device
   (the one process-wide patch: megatron moves the tied output weight of the last pipeline
   stage with `weight.data.cuda()`; without a GPU that call could only raise);
4. `megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32` (and its re-imports in
   `megatron.core.optimizer.optimizer`): the same scaling without the assertion
   `param.grad.type() == 'torch.cuda.FloatTensor'`;
5. `DistributedOptimizer.__init__`: while it runs, a CPU tensor's `.type()` reads as the
   CUDA type name (it sorts parameters by `'torch.cuda.FloatTensor'` etc. and refuses others);
6. `maybe_move_tensor_to_cpu` (MoE all-to-all split sizes): a CPU tensor asked for `as_numpy`
   becomes a numpy array, as a CUDA one does (as a tensor, `all_to_all_single` refuses it).

Call `apply()` before building the trainer (it imports the trainer, and so megatron-core); a child
process (a Ray trainer actor) applies it when started with `child_env(...)`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch as _torch

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "as_tensor")


def _cpu(device):
    if device is None:
        return None
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, _torch.device) and device.type == "cuda":
        return "cpu"
    return device


class _NoEvent:
    def synchronize(self):
        pass

    def wait(self, *a, **k):
        pass

    def query(self):
        return True


class _NoStream:
    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return _NoEvent()


class _CudaProxy:
    def __getattr__(self, name):
        return getattr(_torch.cuda, name)

    @staticmethod
    def current_device():
        return _torch.device("cpu")

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def synchronize(*a, **k):
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def Stream(*a, **k):
        return _NoStream()

    @staticmethod
    def stream(*a, **k):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(*a, **k):
        return _NoStream()

    @staticmethod
    def default_stream(*a, **k):
        return _NoStream()


class _TorchProxy:
    cuda = _CudaProxy()

    def __getattr__(self, name):
        attr = getattr(_torch, name)
        if name in _FACTORIES:
            def factory(*args, _f=attr, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu(kwargs["device"])
                return _f(*args, **kwargs)
            return factory
        return attr

    @staticmethod
    def autocast(device_type="cuda", *args, **kwargs):
        if device_type == "cuda":
            return _torch.autocast("cpu", enabled=False)
        return _torch.autocast(device_type, *args, **kwargs)


_PROXY = _TorchProxy()
_applied = False


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    if isinstance(parameters, _torch.Tensor):
        parameters = [parameters]
    grads = []
    for p in parameters:
        g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
        if g is not None:
            grads.append(g.detach())
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for g in grads:
            g.mul_(coeff)


def _with_cuda_type_names(init):
    def wrapped(*args, **kwargs):
        plain = _torch.Tensor.type

        def type_name(self, dtype=None, *a, **k):
            if dtype is None and not a and not k and self.device.type == "cpu":
                return plain(self).replace("torch.", "torch.cuda.", 1)
            return plain(self, dtype, *a, **k)

        _torch.Tensor.type = type_name
        try:
            return init(*args, **kwargs)
        finally:
            _torch.Tensor.type = plain
    return wrapped


def _split_sizes_as_numpy(move):
    def wrapped(tensor, as_numpy=False, record_stream=False):
        if as_numpy and _torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)
    return wrapped


def apply() -> None:
    global _applied
    from agentrl.trainers.megatron import trainer  # it imports the megatron-core modules patched here

    import megatron.core.optimizer.clip_grads as clip_grads  # noqa: F401 (imported so it is patched)
    import megatron.core.optimizer.optimizer as optimizer_mod
    import megatron.core.pipeline_parallel.schedules  # noqa: F401
    # imported now so their `torch` is patched too (they load lazily at the first checkpoint)
    import megatron.core.dist_checkpointing.exchange_utils  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.async_utils  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.fully_parallel  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.state_dict_saver  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401
    import megatron.core.dist_checkpointing.tensor_aware_state_dict  # noqa: F401

    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is _torch:
            module.torch = _PROXY
    from megatron.core.tensor_parallel import random as tp_random
    tp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    if not _torch.cuda.is_available():
        _torch.Tensor.cuda = lambda self, *a, **k: self
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    if hasattr(optimizer_mod, "clip_grad_by_total_norm_fp32"):
        optimizer_mod.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    if not _applied:
        DistributedOptimizer.__init__ = _with_cuda_type_names(DistributedOptimizer.__init__)
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
        moe_utils.maybe_move_tensor_to_cpu = _split_sizes_as_numpy(moe_utils.maybe_move_tensor_to_cpu)
        token_dispatcher.maybe_move_tensor_to_cpu = moe_utils.maybe_move_tensor_to_cpu
    _applied = True
    trainer.megatron_patched_for_cpu = True  # the trainer's plugin point: it now accepts device "cpu"


def child_env(env: dict) -> dict:
    """`env` for a child process whose Megatron trainers (in its Ray actors too) run on CPU: this
    shim applied by megatron_on_cpu/sitecustomize.py, put first on PYTHONPATH."""
    hook = str(Path(__file__).resolve().parent / "megatron_on_cpu")
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (hook, env.get("PYTHONPATH")) if p)}
