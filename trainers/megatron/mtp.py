"""Multi-token prediction (MTP): megatron-core's MTP block beside a GPTModel, and its loss.

slime builds its model with `mtp_block_spec` and gives GPTModel the tokens as MTP labels; in
megatron-core the MTP loss then rides on the labels path, which returns a loss instead of the
logits the policy loss reads (0.16: `labels` required; 0.19: derived from `input_ids`, the loss
added through a backward hook, the per-token loss not returned). Here the GPTModel is built
without MTP (its forward unchanged), and the block (`MultiTokenPredictionBlock`, the layers of
`get_mtp_layer_spec`) is attached as `model.mtp`: the same parameter names
(`mtp.layers.K.*`), run on the decoder's output when a training step asks for it
(`model.mtp_run`), its hidden states handed to the trainer's loss (`model.mtp_hidden`).

The loss (`mtp_loss`), as slime's: MTP layer k (1-based) at position i sees the decoder's hidden
state i and token i+k's embedding and predicts token i+k+1; its cross-entropy (temperature 1,
through the shared LM head) counts on the trained response tokens only (loss mask 1), summed
over the micro-batches and normalised as the policy loss is (by the global batch's trained
tokens), then added as `mtp_loss_scaling_factor / num_layers` x the sum over layers. The
decoder's hidden states, the embedding and the LM head enter the MTP path detached (as slime's
CI checks: the MTP loss trains the MTP layers alone), so the policy's gradient and logprobs are
the same with and without it.

Limits: one pipeline stage and no context parallelism (the block needs the embedding on the
last stage, and its roll over packed sequences is per CP chunk); checked in `check`.
"""

from __future__ import annotations

import dataclasses

import torch

from agentrl.errors import ConfigError
from agentrl.trainers.megatron.logprobs import fused_logprobs

DEFAULT_SCALING_FACTOR = 0.2  # slime's --mtp-loss-scaling-factor default (megatron-core's is 0.1)


def check(num_layers: int, family, hf_config, margs) -> None:
    """--mtp-num-layers against the family and config.json, --enable-mtp-training against it."""
    from agentrl.trainers.megatron.families.mimo import mtp_layers

    training = margs.flag("enable_mtp_training")
    if not num_layers:
        if training:
            raise ConfigError("--enable-mtp-training needs the MTP layers built: add --mtp-num-layers N (N: "
                              "config.json's num_nextn_predict_layers)")
        return
    if not family.mtp:
        raise ConfigError(f"mtp_num_layers: model family {family.name!r} has no multi-token-prediction layers the "
                          "Megatron trainer maps (MiMo's model.mtp_layers.* only)")
    have = mtp_layers(hf_config)
    if num_layers != have:
        raise ConfigError(f"--mtp-num-layers {num_layers} differs from config.json's num_nextn_predict_layers "
                          f"({have})")
    if margs.pp > 1 or margs.cp > 1 or margs.vpp(hf_config.num_hidden_layers):
        raise ConfigError("--mtp-num-layers: the MTP layers run with --pipeline-model-parallel-size 1 and "
                          "--context-parallel-size 1 here (trainers/megatron/mtp.py)")


def scaling_factor(margs) -> float:
    return float(margs.transformer.get("mtp_loss_scaling_factor", DEFAULT_SCALING_FACTOR))


def build_block(config, layer_spec, *, te: bool, num_layers: int, vp_stage: int | None = None):
    """megatron-core's MTP block of `num_layers` layers, each a decoder layer of `layer_spec`
    (the model's last layer spec) between the MTP norms and projection. Local spec: the norms
    are layers.RMSNorm (HF-exact, as the decoder's)."""
    from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlock,
                                                                  MultiTokenPredictionBlockSubmodules,
                                                                  get_mtp_layer_spec)

    from agentrl.trainers.megatron.layers import RMSNorm

    layer = layer_spec.layer_specs[-1] if hasattr(layer_spec, "layer_specs") else layer_spec
    spec = get_mtp_layer_spec(layer, te)
    if not te:
        spec.submodules.enorm = spec.submodules.hnorm = spec.submodules.layer_norm = RMSNorm
    mtp_config = dataclasses.replace(config, mtp_num_layers=num_layers)
    return MultiTokenPredictionBlock(config=mtp_config, spec=MultiTokenPredictionBlockSubmodules(
        layer_specs=[spec] * num_layers), vp_stage=vp_stage)


def attach(model, block, *, train: bool) -> None:
    """`block` as `model.mtp`, run after the decoder whenever `model.mtp_run` is set (the
    trainer sets it per training micro-batch); its per-layer hidden states land in
    `model.mtp_hidden`. train=False: its weights frozen (no gradient, no optimizer update:
    they stay the checkpoint's, and are still exported)."""
    model.mtp = block
    model.mtp_run, model.mtp_hidden = False, None
    if not train:
        block.requires_grad_(False)
    inner = model._postprocess

    def _postprocess(**kw):
        if model.mtp_run:  # (the detached input requires grad: megatron-core's recompute needs one that does)
            out = block(input_ids=kw["input_ids"], position_ids=kw["position_ids"],
                        hidden_states=kw["hidden_states"].detach().requires_grad_(), attention_mask=kw["attention_mask"],
                        rotary_pos_emb=kw["rotary_pos_emb"], rotary_pos_cos=kw.get("rotary_pos_cos"),
                        rotary_pos_sin=kw.get("rotary_pos_sin"), packed_seq_params=kw.get("packed_seq_params"),
                        sequence_len_offset=kw.get("sequence_len_offset"),
                        embedding=lambda **a: model.embedding(**a).detach())
            model.mtp_hidden = list(out.chunk(1 + len(block.layers), dim=0)[1:])  # [s, 1, h] per layer
        return inner(**kw)

    model._postprocess = _postprocess


def mtp_loss(model, hidden: list[torch.Tensor], mb, mask: torch.Tensor, denom: float, *, factor: float,
             vocab_size: int, tp_group, tp_rank: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(factor / layers x the sum over MTP layers of their masked cross-entropy sum / denom,
    stats): `mtp_loss` (the sum over layers of each layer's mean over trained tokens, as slime
    logs it) and `mtp_K_loss`. mask: [N] the micro-batch's response loss mask (flat order)."""
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                         gather_from_sequence_parallel_region)

    head = model.output_layer
    weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
              else head.weight).detach()  # [V/tp, h]
    position = mb.position_ids[0].index_select(0, mb.logit_index)  # in-sequence position of each logit row
    total, stats = mask.new_zeros(()), {}
    for k, h in enumerate(hidden, start=1):
        valid = (position >= k).to(mask.dtype) * mask  # layer k predicts response token j from row j-1-k
        rows = (mb.logit_index - k).clamp(min=0)
        if getattr(head, "sequence_parallel", False):  # this rank's slice of the sequence -> all of it
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
        else:  # the input gradient summed over the vocabulary shards
            h = copy_to_tensor_model_parallel_region(h)
        logits = torch.nn.functional.linear(h[:, 0].index_select(0, rows), weight)  # [N, V/tp]
        logp, _ = fused_logprobs(logits, torch.arange(rows.numel(), device=rows.device), mb.targets,
                                 temperature=1.0, vocab_size=vocab_size, tp_group=tp_group, tp_rank=tp_rank)
        nll = -(logp * valid).sum() / denom
        total = total + nll
        stats[f"mtp_{k}_loss"] = nll.detach()
    stats["mtp_loss"] = total.detach()
    return total * (factor / len(hidden)), stats
