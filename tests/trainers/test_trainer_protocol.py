"""Both trainers satisfy agentrl.trainers.Trainer: every method it names, with the same
parameters in the same order (the trainer actor calls them positionally and by name)."""

import inspect

import pytest

from agentrl.trainers import Trainer

PROTOCOL_METHODS = [n for n, v in vars(Trainer).items() if callable(v) and not n.startswith("_")]


def trainer_classes():
    from agentrl.trainers.torch_trainer import TorchTrainer

    classes = [TorchTrainer]
    try:
        from agentrl.trainers.megatron import MegatronTrainer
    except ImportError:  # megatron-core is a dependency: absent only on a broken install
        pytest.fail("megatron-core is not importable")
    return classes + [MegatronTrainer]


def required_params(fn) -> list[str]:
    """Parameter names a caller of the protocol may pass (past self), in order: the protocol's."""
    return [p.name for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def test_protocol_names_what_the_trainer_actor_calls():
    assert {"train_rollout", "train_sft", "compute_logprobs", "named_tensors", "save_hf", "save_adapter", "save",
            "load"} <= set(PROTOCOL_METHODS)


@pytest.mark.parametrize("method", PROTOCOL_METHODS)
def test_each_trainer_has_the_protocol_method(method):
    want = required_params(getattr(Trainer, method))
    for cls in trainer_classes():
        impl = getattr(cls, method, None)
        assert impl is not None, f"{cls.__name__} has no {method}"
        got = required_params(impl)
        assert got[:len(want)] == want, f"{cls.__name__}.{method}{inspect.signature(impl)} vs the protocol's {want}"
        extra = [p for p in list(inspect.signature(impl).parameters.values())[len(want) + 1:]
                 if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        assert not extra, f"{cls.__name__}.{method} needs more than the protocol gives: {[p.name for p in extra]}"
