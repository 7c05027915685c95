"""Build megatron-core GPTModels from a Hugging Face config (Qwen2/2.5, Qwen3, Llama 3, MiMo dense;
Qwen3-MoE and Qwen2-MoE with megatron-core's MoE layer; MiMo's MTP layers: mtp.py; Qwen2-VL /
Qwen2.5-VL's decoder with multimodal RoPE, its HF vision tower beside: vision.py).

Layer spec: Transformer Engine's when it is installed (and not turned off with
`--transformer-impl local`), else megatron-core's local spec with two modules swapped
(`layers.py`): the attention core for PyTorch's fused SDPA / varlen flash kernels, and the
norms for an HF-exact RMSNorm that also allows sequence parallelism.
"""

from __future__ import annotations

import datetime
import importlib
import os

import torch
import torch.nn.functional as F

from agentrl.errors import ConfigError
from agentrl.trainers.megatron.args import MegatronArgs
from agentrl.trainers.megatron import mtp, no_apex
from agentrl.trainers.megatron.families import family_for, language_config
from agentrl.trainers.megatron.families.common import Family, Layout, head_dim, rope_theta


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
        return True
    except Exception:
        return False


def use_te_spec(margs: MegatronArgs, device: str) -> bool:
    impl = margs.trainer.get("transformer_impl")
    if impl is None:
        return device != "cpu" and have_te()
    if impl not in ("local", "transformer_engine"):
        raise ConfigError(f"--transformer-impl {impl!r}: choose local or transformer_engine")
    if impl == "transformer_engine" and not have_te():
        raise ConfigError("--transformer-impl transformer_engine: Transformer Engine is not installed")
    return impl == "transformer_engine"


# -- process groups ------------------------------------------------------------------------------
def init_distributed(margs: MegatronArgs, device: str, seed: int = 1234, *, num_layers: int | None = None) -> None:
    """torch.distributed (torchrun's env, or a one-process group) and Megatron's parallel state.
    num_layers: the model's, for virtual pipeline stages given as layers per stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    timeout = datetime.timedelta(minutes=int(margs.trainer.get("distributed_timeout_minutes", 30)))
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                    timeout=timeout)
    world = dist.get_world_size()
    tp, pp, cp, ep, etp = margs.tp, margs.pp, margs.cp, margs.ep, margs.etp
    vpp = margs.vpp(num_layers) if num_layers is not None else None
    if world % (tp * pp * cp):
        raise ConfigError(f"world size {world} is not a multiple of TP {tp} x PP {pp} x CP {cp}")
    if world % (etp * ep * pp):
        raise ConfigError(f"world size {world} is not a multiple of expert TP {etp} x EP {ep} x PP {pp}")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                ps.get_expert_tensor_parallel_world_size())
        if have != (tp, pp, cp, ep, etp) or ps.get_virtual_pipeline_model_parallel_world_size() != vpp:
            raise ConfigError(f"Megatron's parallel state is already set up as TP/PP/CP/EP/ETP {have}, "
                              f"(VPP {ps.get_virtual_pipeline_model_parallel_world_size()}), not {(tp, pp, cp, ep, etp)} "
                              f"(VPP {vpp})")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp,
                                     context_parallel_size=cp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=etp,
                                     distributed_timeout_minutes=int(timeout.total_seconds() // 60))
    if device.startswith("cuda"):
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _free_port() -> int:
    from agentrl.engines.launch import server_port  # outside the ephemeral range (see _rendezvous_address)

    return server_port()


# -- config and model ----------------------------------------------------------------------------
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformer_config(hf_config, family: Family, margs: MegatronArgs, *, dtype: str, device: str, te: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    params_dtype = DTYPES[dtype]
    kw = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=device == "cpu",
        perform_initialization=False,  # every weight is loaded from the checkpoint
        variable_seq_lengths=True,  # packed micro-batches differ in length (pipeline p2p shapes)
        moe_token_dispatcher_type="alltoall",  # (dense models; the default "allgather" refuses variable lengths)
        bias_activation_fusion=device != "cpu",  # fused SwiGLU (megatron's jit-scripted kernel) on GPUs
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=device != "cpu" and not te and _fused_rope(hf_config),  # rope_kernels.py
        persist_layer_norm=False,
        # weight gradients accumulate into main_grad inside the GEMM (no_apex.py stands in for Apex)
        gradient_accumulation_fusion=device != "cpu" and params_dtype != torch.float32 and no_apex.install_wgrad_fusion(),
        attention_softmax_in_fp32=True,
    )
    if family.moe is not None:
        kw.update(moe_config(family, te))
    if family.vision:
        kw["mrope_section"] = mrope_section(hf_config)
    vpp = margs.vpp(hf_config.num_hidden_layers)
    if vpp and margs.pp == 2:
        # Two stages in a ring: a rank's previous and next stage are the same peer, and a
        # batched send/receive to it pairs the activations going one way with the gradients
        # going the other (seen on gloo: training logprobs off, grad norm x100). Unbatched,
        # megatron-core sends each direction on its own process group. (Its shape exchange
        # stays batched: the trainer gives these micro-batches one length, see
        # MegatronTrainer._batches.)
        kw["batch_p2p_comm"] = False
    kw.update(margs.transformer)
    if family.vision and te and kw.get("apply_rope_fusion"):
        # (the local spec's fused kernel, rope_kernels.py, takes per-token frequencies)
        raise ConfigError("--apply-rope-fusion with Transformer Engine and a vision-language model: TE's packed-sequence "
                          "RoPE kernel indexes frequencies per sequence, not by the multimodal per-token positions; "
                          "drop the flag or use --transformer-impl local")
    # the MTP block is built beside the GPTModel, not by it (mtp.py): its config keeps megatron-core's
    # MTP fields unset, so its forward returns the logits
    mtp.check(int(kw.pop("mtp_num_layers", None) or 0), family, hf_config, margs)
    kw.pop("mtp_loss_scaling_factor", None)
    kw["virtual_pipeline_model_parallel_size"] = vpp
    if margs.flag("use_rollout_routing_replay"):
        if family.moe is None:
            raise ConfigError("--use-rollout-routing-replay: the model has no routed experts")
        kw["moe_enable_routing_replay"] = True  # each router gets a RouterReplay (MegatronTrainer sets its experts)
    if family.moe is not None and kw.get("moe_aux_loss_coeff") and "moe_router_load_balancing_type" not in margs.transformer:
        kw["moe_router_load_balancing_type"] = "aux_loss"  # --moe-aux-loss-coeff turns the aux loss on
    kw["transformer_impl"] = "transformer_engine" if te else "local"
    if kw.get("sequence_parallel") and kw.get("tensor_model_parallel_size", 1) == 1:
        kw["sequence_parallel"] = False  # as megatron.training does
    if family.moe is not None and kw.get("tensor_model_parallel_size", 1) > 1 and not kw.get("sequence_parallel"):
        raise ConfigError("a mixture-of-experts model with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                          "(megatron-core's MoE layer refuses to train without it)")
    return TransformerConfig(**kw)


def moe_config(family: Family, te: bool) -> dict:
    """TransformerConfig fields for a MoE family, HF's routing exactly: a softmax over every
    expert's logit (in fp32), top-k, renormalised or not. megatron-core's "softmax after top-k"
    is the renormalised form; "pre-softmax" the plain one. No load-balancing loss unless
    --moe-aux-loss-coeff asks for one (RL fine-tuning of a trained router); no token
    dropping. Experts: TEGroupedMLP with Transformer Engine, else SequentialMLP (the legacy
    GroupedMLP needs the `grouped_gemm` package)."""
    _moe_without_te()
    moe = family.moe
    kw = dict(num_moe_experts=moe.num_experts, moe_router_topk=moe.topk, moe_ffn_hidden_size=moe.ffn,
              moe_layer_freq=list(moe.layers), moe_router_score_function="softmax",
              moe_router_pre_softmax=not moe.norm_topk_prob, moe_router_dtype="fp32",
              moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=te,
              moe_token_dispatcher_type="alltoall", moe_permute_fusion=False)
    if moe.shared_ffn:
        kw.update(moe_shared_expert_intermediate_size=moe.shared_ffn, moe_shared_expert_gate=moe.shared_gate)
    return kw


def mrope_section(hf_config) -> list[int]:
    """A Qwen-VL decoder's multimodal RoPE split: rotary channel pairs per temporal, height, width position."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not params.get("mrope_section"):
        raise ConfigError(f"{hf_config.model_type}: no mrope_section in its rope parameters")
    return [int(x) for x in params["mrope_section"]]


def _moe_without_te() -> None:
    """megatron-core 0.16's router GEMM tests `te_general_gemm is not None`, a name its
    moe_utils only binds when Transformer Engine imports (NameError without TE): bind it to
    None, the value that means "no TE", so the router takes its torch.mm path."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _fused_rope(hf_config) -> bool:
    """The Triton RoPE kernels in megatron-core's fused-RoPE slots, where they cover the model
    (rotary over whole heads) and Triton imports."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        return False
    try:
        from agentrl.trainers.megatron import rope_kernels
    except ImportError:
        return False
    return rope_kernels.install()


def layer_spec(config, family: Family, te: bool, vp_stage: int | None = None):
    """The layer specs of this pipeline stage (and virtual stage vp_stage)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec, get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from agentrl.trainers.megatron.layers import RMSNorm, SDPAttention

    if te:
        if family.moe is not None:
            return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm",
                                              vp_stage=vp_stage)
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=family.qk_norm)
    norm = ModuleSpec(module=RMSNorm)

    def local(num_experts):
        spec = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=family.qk_norm, normalization="RMSNorm")
        sub = spec.submodules
        sub.input_layernorm = norm
        sub.pre_mlp_layernorm = norm
        attn = sub.self_attention.submodules
        attn.core_attention = ModuleSpec(module=SDPAttention)
        if family.qk_norm:
            attn.q_layernorm = norm
            attn.k_layernorm = norm
        return spec

    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    if family.moe is None:
        return TransformerBlockSubmodules(layer_specs=[local(None)] * count, layer_norm=norm)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    dense, routed = local(None), local(family.moe.num_experts)
    specs = [routed if family.moe.layers[i] else dense for i in range(offset, offset + count)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = 1) -> int:
    multiple = tp * max(1, divisible_by)
    return -(-vocab // multiple) * multiple


def build_gpt(hf_config, config, spec, *, padded_vocab: int, value_head: bool = False, vp_stage: int | None = None):
    """One GPTModel for this pipeline stage, or for its virtual stage vp_stage (pre/post-process
    from the parallel state). value_head=True builds the critic: the LM head replaced by a
    scalar head."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
    params = getattr(hf_config, "rope_parameters", None) or {}
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=padded_vocab,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=True, share_embeddings_and_output_weights=tied,
        position_embedding_type="mrope" if config.mrope_section else "rope",  # mrope: a Qwen-VL's decoder
        rotary_percent=float(params.get("partial_rotary_factor", 1.0)),
        rotary_base=int(rope_theta(hf_config)), vp_stage=vp_stage,
    )
    inv_freq, scaling = hf_inv_freq(hf_config)
    if scaling != 1.0:
        raise NotImplementedError(f"RoPE type {params.get('rope_type')!r} scales attention by {scaling}; "
                                  "not supported by the Megatron trainer")
    model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq.device)
    if value_head and model.post_process:
        model.output_layer = ValueHead(config)
    mark_tensor_parallel(model)
    return model


def enable_position_rope(model) -> None:
    """Packed sequences without megatron's per-sequence RoPE loop.

    For THD inputs megatron-core's RoPE splits q and k per sequence (a host sync and a
    slice/concat per sequence, per layer). Instead, this makes the model's rotary module return
    the frequencies of each packed token's own position (set per micro-batch in
    `model.rotary_pos_emb.positions`), and the trainer passes `cu_seqlens_q_padded = [0, T]`,
    so RoPE sees one segment whose frequencies are already per token. Attention reads the real
    boundaries from `cu_seqlens_q` (SDPAttention). Local spec only: TE's attention reads the
    padded boundaries."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None or getattr(rope, "positions", "unset") != "unset":
        return
    inner = rope.forward
    rope.positions = None

    def forward(max_seq_len, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if rope.positions is None or not packed_seq:
            return inner(max_seq_len, offset, packed_seq, cp_group)
        positions, longest = rope.positions
        return inner(longest, 0, packed_seq, cp_group)[positions]  # [T, 1, 1, d]

    rope.forward = forward


RESPONSE_HEAD = True  # False: the head runs over every position (bench/megatron_bench.py's A/B switch)


def enable_response_head(model) -> None:
    """The LM head over response positions only (set per micro-batch in
    `model.output_layer.rows`): prompt positions' logits were computed over the whole
    vocabulary, and their gradient (zeros) pushed back through the head, only to be dropped.
    The logits come back as [1, len(rows), V]. Not with sequence parallelism (the hidden
    states reach the head split over the sequence) nor for the critic's value head."""
    head = getattr(model, "output_layer", None)
    if head is None or isinstance(head, ValueHead) or getattr(head, "sequence_parallel", False):
        return
    if hasattr(head, "rows"):
        return
    inner = head.forward
    head.rows = None

    def forward(hidden_states, *args, **kwargs):  # hidden_states: [s, b, h]
        rows, head.rows = head.rows, None  # for this call only: a later direct call gets every position
        if rows is not None and RESPONSE_HEAD:
            hidden_states = hidden_states.index_select(0, rows)
        return inner(hidden_states, *args, **kwargs)

    head.forward = forward


def mark_tensor_parallel(model) -> None:
    """Tag TP-sharded weights as megatron-core's initialisers would. With
    perform_initialization=False (weights come from the checkpoint) megatron-core skips its
    init functions and with them `tensor_model_parallel`/`partition_dim`, which the grad
    norm, the distributed optimizer and checkpoint sharding rely on."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding, set_tensor_model_parallel_attributes)

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            set_tensor_model_parallel_attributes(weight, True, 0, 1)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)


def hf_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies exactly as the HF model computes them (llama3 scaling etc.)."""
    mt = {"mimo": "qwen2"}.get(hf_config.model_type, hf_config.model_type)  # MiMo: Qwen2's RoPE
    mt = mt.removesuffix("_text")  # a VLM's decoder config (qwen2_vl_text): its model's module
    module = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    with torch.device("cpu"):
        rope = cls(config=hf_config)
    return rope.inv_freq.float().clone(), float(getattr(rope, "attention_scaling", 1.0))


class ValueHead(torch.nn.Module):
    """The critic's head: hidden -> one value per token, replicated over TP. Called as
    GPTModel calls its output layer; returns ([s, b, 1], None)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.sequence_parallel = bool(config.sequence_parallel)
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype,
                                                     device="cpu" if config.use_cpu_initialization else None))
        # the same head on every rank (data, context and tensor parallel copies must start equal;
        # the process's own random state differs between ranks)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=g) / (config.hidden_size + 1) ** 0.5)
        setattr(self.weight, "average_gradients_across_tp_domain", True)

    def forward(self, hidden, weight=None, runtime_gather_output=None, **_ignored):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return F.linear(hidden, self.weight), None


def layout_for(hf_config, margs: MegatronArgs, te: bool) -> tuple[Family, Layout]:
    family = family_for(hf_config)
    hf_config = language_config(hf_config)
    divisible = int(margs.trainer.get("make_vocab_size_divisible_by", 1))
    experts = family.moe.num_experts if family.moe is not None else 0
    layout = Layout.from_hf(hf_config, margs.tp, padded_vocab_size(hf_config.vocab_size, margs.tp, divisible), te,
                            ep=margs.ep, etp=margs.etp, num_experts=experts,
                            mtp_layers=int(margs.transformer.get("mtp_num_layers") or 0))
    if layout.num_groups % margs.tp:
        raise ConfigError(f"--tensor-model-parallel-size {margs.tp} must divide the {layout.num_groups} KV heads")
    if margs.ep > 1 and (not experts or experts % margs.ep):
        raise ConfigError(f"--expert-model-parallel-size {margs.ep} must divide the model's routed experts "
                          f"({experts or 'none: a dense model'})")
    if experts and family.moe.ffn % layout.etp:
        raise ConfigError(f"--expert-tensor-parallel-size {layout.etp} must divide moe_intermediate_size "
                          f"{family.moe.ffn}")
    return family, layout
