"""The Megatron-core trainer (`--trainer megatron`): model build from HF configs, HF <-> Megatron
weights (one module per family under families/), packed micro-batches, the shared losses,
distributed checkpoints and bucketed weight export. Imported lazily: megatron-core loads only
when the trainer is built."""


def __getattr__(name):
    if name == "MegatronTrainer":
        from agentrl.trainers.megatron.trainer import MegatronTrainer
        return MegatronTrainer
    raise AttributeError(name)
