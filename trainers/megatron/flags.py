"""Which command-line flags are Megatron's own (light: no megatron import, so the CLI can
sort flags without loading megatron-core).

`--NAME VALUE` passes through to the Megatron trainer when NAME (dashes as underscores) is a
field of megatron-core's TransformerConfig / ModelParallelConfig, OptimizerConfig or
DistributedDataParallelConfig (the list below is the union of those fields in megatron-core
0.16.1 and 0.19.2, minus callables and dtypes; tests/trainers/test_megatron_args.py checks it
against the installed megatron-core; a field the installed version lacks is refused when the
trainer reads it), or one of megatron.training's own names in TRAINING_FLAGS. Flags agentrl
already owns (--lr, --micro-batch-size, --clip-grad, --weight-decay, --adam-beta1/2,
--global-batch-size, --seed) stay agentrl's; the trainer hands their values to Megatron.
"""

from __future__ import annotations

CORE_FIELDS = frozenset("""
account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split
activation_func_clamp_value activation_func_fp8_input_store activation_offload_fraction adam_beta1
adam_beta2 adam_eps adaptive_muon_beta2 adaptive_muon_eps adaptive_muon_moment2_method
add_bias_linear add_qkv_bias align_param_gather apply_query_key_layer_scaling
apply_residual_connection_post_layernorm apply_rope_fusion apply_wd_to_qk_layernorm
async_tensor_model_parallel_allreduce attention_backend attention_dropout attention_output_gate
attention_softmax_in_fp32 average_in_collective batch_invariant_mode batch_p2p_comm batch_p2p_sync
bf16 bias_activation_fusion bias_dropout_fusion bucket_size calculate_per_token_loss
check_for_large_grads check_for_nan_in_grad clip_grad clone_scatter_output_in_embedding
context_parallel_size cp_comm_type cpu_offloading cpu_offloading_activations
cpu_offloading_double_buffering cpu_offloading_num_layers cpu_offloading_retain_pinned_cpu_buffers
cpu_offloading_weights cross_entropy_fusion_impl cross_entropy_loss_fusion cuda_graph_impl
cuda_graph_modules cuda_graph_retain_backward_graph cuda_graph_scope cuda_graph_use_single_mempool
cuda_graph_warmup_steps data_parallel_sharding_strategy deallocate_pipeline_outputs decoupled_lr
decoupled_min_lr decoupled_weight_decay defer_embedding_wgrad_compute delay_offload_until_cuda_graph
delay_wgrad_compute delta_offload_bytes_across_pp_ranks deterministic_mode
disable_bf16_reduced_precision_matmul disable_parameter_transpose_cache
disable_symmetric_registration distribute_saved_activations dsa_indexer_head_dim
dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32 dsa_indexer_loss_coeff dsa_indexer_n_heads
dsa_indexer_rope_interleaved dsa_indexer_rotate_activation dsa_indexer_scoring_relu
dsa_indexer_skip_topk_offset dsa_indexer_topk dsa_indexer_topk_freq dsa_indexer_use_sparse_loss
dsa_kernel_backend embedding_init_method_std enable_autocast enable_cuda_graph
ep_overlap_early_attn_memory_release exp_avg_dtype exp_avg_sq_dtype experimental_attention_variant
experimental_attention_variant_loss_scale_func expert_gtp_weight_remat_size
expert_model_parallel_size expert_tensor_parallel_num_weight_shards expert_tensor_parallel_size
external_cuda_graph ffn_hidden_size fine_grained_activation_offloading
fine_grained_offloading_max_inflight_offloads first_last_layers_bf16 flash_attention_version
flash_decode fp16 fp32_residual_connection fp4 fp4_param fp4_param_gather fp4_quantizer_factory
fp4_recipe fp8 fp8_amax_compute_algo fp8_amax_history_len fp8_dot_product_attention fp8_interval
fp8_margin fp8_multi_head_attention fp8_output_proj fp8_param fp8_param_gather fp8_quantizer_factory
fp8_recipe fp8_wgrad fsdp_all_gather_in_start_param_sync fsdp_db_use_persist_buf_on_alloc_fail
fsdp_double_buffer fsdp_manual_registration fused_residual_rmsnorm fused_single_qkv_rope
gated_linear_unit glu_linear_offset grad_norm_skip_threshold grad_reduce_in_fp32
gradient_accumulation_fusion gradient_reduce_div_fusion gtp_weight_remat_size
hetereogenous_dist_checkpoint heterogeneous_block_specs hidden_dropout hidden_size
hierarchical_context_parallel_sizes high_priority_a2a_comm_stream hybrid_context_parallel hysteresis
inference_cuda_graph_scope inference_disable_triton_nvls_kernels inference_fuse_tp_communication
inference_grouped_gemm_backend inference_moe_disable_fused_quant_kernels
inference_moe_token_dispatcher_type inference_rng_tracker inference_sampling_seed init_method_std
init_model_with_meta_device initial_loss_scale is_hybrid_model keep_fp8_transpose_cache
kitchen_attention_backend kv_channels layernorm_epsilon layernorm_zero_centered_gamma
linear_attention_freq linear_conv_kernel_dim linear_key_head_dim linear_num_key_heads
linear_num_value_heads linear_value_head_dim lion_beta1 lion_beta2 log_max_attention_logit
log_num_zeros_in_grad loss_scale loss_scale_window lr main_grads_dtype main_params_dtype
mamba_head_dim mamba_num_groups mamba_num_heads mamba_state_dim mamba_training_ssm_states_dtype
masked_softmax_fusion max_seqlen_per_dp_cp_rank megatron_fsdp_cuda_graph_mode
megatron_fsdp_enable_fine_grained_param_gather megatron_fsdp_grad_comm_dtype
megatron_fsdp_main_grads_dtype megatron_fsdp_main_params_dtype megatron_fsdp_max_pool_double_buffer
megatron_fsdp_use_decoupled_grad memory_efficient_layer_norm microbatch_group_size_per_vp_stage
min_loss_scale min_lr min_offloaded_tensor_size mlp_chunks_for_prefill mlp_chunks_for_training
moe_apply_probs_on_input moe_aux_loss_coeff moe_deepep_num_sms moe_enable_deepep
moe_enable_routing_replay moe_expert_capacity_factor moe_expert_rank_capacity_factor moe_extended_tp
moe_ffn_hidden_size moe_flex_dispatcher_backend moe_flex_dispatcher_num_sms moe_grad_scale_func
moe_grouped_gemm moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute
moe_hybridep_num_sms moe_hybridep_num_sms_preprocessing moe_hybridep_pad_uneven_dispatch_inputs
moe_input_jitter_eps moe_latent_size moe_layer_freq moe_layer_recompute moe_mlp_glu_interleave_size
moe_ncclep_static_shape moe_ncclep_zero_copy moe_pad_expert_input_to_capacity
moe_pad_experts_for_cuda_graph_inference moe_paged_stash moe_paged_stash_buffer_size_factor_cpu
moe_paged_stash_buffer_size_factor_cuda moe_paged_stash_page_size moe_per_layer_logging
moe_permute_fusion moe_permute_fusion_into_hybridep moe_router_bias_update_rate moe_router_dtype
moe_router_enable_expert_bias moe_router_force_biased moe_router_force_load_balancing
moe_router_fusion moe_router_group_topk moe_router_load_balancing_type moe_router_num_groups
moe_router_padding_for_fp8 moe_router_padding_for_quantization moe_router_pre_softmax
moe_router_quantile_balancing_ema moe_router_score_function moe_router_topk
moe_router_topk_limited_devices moe_router_topk_scaling_factor moe_shared_expert_gate
moe_shared_expert_glu_interleave_size moe_shared_expert_intermediate_size moe_shared_expert_overlap
moe_single_grouped_bias moe_single_grouped_weight moe_token_dispatcher_type moe_token_drop_policy
moe_token_dropping moe_use_legacy_grouped_gemm moe_z_loss_coeff mrope_section mtp_detach_heads
mtp_grad_scale_func mtp_hybrid_override_pattern mtp_loss_scaling_factor mtp_num_layers
mtp_standalone mtp_use_repeated_layer multi_latent_attention muon_coefficient_type
muon_extra_scale_factor muon_fp32_matmul_prec muon_momentum muon_nesterov muon_num_ns_steps
muon_scalar_optimizer muon_scale_mode muon_split_qkv muon_tp_mode muon_use_nesterov
mup_attn_scale_power mup_base_head_dim mup_base_hidden_size mup_embedding_mult mup_output_mult
mup_width_mult nccl_all_reduce_for_prefill nccl_ub no_rope_freq normalization num_attention_heads
num_buckets num_distributed_optimizer_instances num_layers num_layers_at_end_in_bf16
num_layers_at_start_in_bf16 num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage
num_microbatches_with_partial_activation_checkpoints num_moe_experts num_query_groups
offload_modules optimizer optimizer_cpu_offload optimizer_cuda_graph optimizer_offload_fraction
outer_dp_sharding_strategy overlap_cpu_optimizer_d2h_h2d
overlap_dispatch_backward_with_experts_wgrad overlap_grad_reduce overlap_moe_expert_parallel_comm
overlap_p2p_comm overlap_p2p_comm_warmup_flush overlap_param_gather
overlap_param_gather_with_optimizer_step pad_buckets_for_high_nccl_busbw
param_name_patterns_for_fp32_local_accumulation perform_initialization persist_layer_norm
pin_cpu_grads pin_cpu_params pipeline_model_parallel_comm_backend pipeline_model_parallel_layout
pipeline_model_parallel_size preserve_fp32_weights qk_clip qk_clip_alpha qk_clip_threshold
qk_l2_norm qk_layernorm quant_recipe recompute_granularity recompute_method recompute_modules
recompute_num_layers reduce_scatter_with_fp32_accumulation reuse_grad_buf_for_mxfp8_param_ag
rotary_interleaved sequence_parallel sgd_momentum soap_precondition_frequency soap_shampoo_beta
soap_use_kl_shampoo softmax_scale softmax_type store_param_remainders
suggested_communication_unit_size symmetric_ar_type tensor_model_parallel_size
tensor_parallel_num_weight_shards test_mode tp_comm_atomic_ag tp_comm_atomic_rs
tp_comm_bootstrap_backend tp_comm_bulk_dgrad tp_comm_bulk_wgrad tp_comm_overlap tp_comm_overlap_ag
tp_comm_overlap_disable_fc1 tp_comm_overlap_disable_qkv tp_comm_overlap_rs tp_comm_overlap_rs_dgrad
tp_comm_split_ag tp_comm_split_rs tp_only_amax_red transformer_impl use_cpu_initialization
use_custom_fsdp use_distributed_optimizer use_fused_weighted_squared_relu
use_grouped_gemm_for_dense_mlp use_grouped_gemm_for_shared_expert use_inference_optimized_layers
use_kitchen use_kitchen_attention use_layer_wise_distributed_optimizer use_mamba_mem_eff_path
use_megatron_fsdp use_mup use_precision_aware_optimizer use_ring_exchange_p2p use_te_activation_func
use_te_rng_tracker use_torch_optimizer_for_cpu_offload use_transformer_engine_op_fuser
variable_seq_lengths virtual_pipeline_model_parallel_size weight_decay wgrad_deferral_limit
window_attn_skip_freq window_size
""".split())

# megatron.training flag -> (core field, value it sets, or None to take the flag's value)
TRAINING_FLAGS: dict[str, tuple[str, object]] = {
    "no_gradient_accumulation_fusion": ("gradient_accumulation_fusion", False),
    "no_bias_swiglu_fusion": ("bias_activation_fusion", False),
    "bias_swiglu_fusion": ("bias_activation_fusion", True),
    "no_bias_dropout_fusion": ("bias_dropout_fusion", False),
    "no_masked_softmax_fusion": ("masked_softmax_fusion", False),
    "no_rope_fusion": ("apply_rope_fusion", False),
    "rope_fusion": ("apply_rope_fusion", True),
    "no_persist_layer_norm": ("persist_layer_norm", False),
    "no_overlap_grad_reduce": ("overlap_grad_reduce", False),
}

# Trainer-level Megatron flags (not config fields): read by the Megatron trainer itself.
TRAINER_FLAGS = frozenset({
    "transformer_impl",  # local | transformer_engine (default: transformer_engine when installed)
    "lr_decay_style", "lr_warmup_iters", "lr_decay_iters", "lr_warmup_init",  # the LR schedule, in optimizer steps
    "make_vocab_size_divisible_by",  # pad the vocab (embedding/lm_head rows) to a multiple of this x TP
    "distributed_timeout_minutes",
    "seq_length", "max_position_embeddings",  # accepted for slime compatibility; the HF config decides
    "num_layers_per_virtual_pipeline_stage",  # slime's way to ask for virtual pipeline stages
    "use_rollout_routing_replay",  # slime's R3: replay the experts the engine routed each token to
    "enable_mtp_training",  # slime's: train the --mtp-num-layers MTP layers beside the policy (mtp.py)
})


def is_megatron_flag(name: str) -> bool:
    """NAME with underscores (no leading dashes)."""
    return name in CORE_FIELDS or name in TRAINING_FLAGS or name in TRAINER_FLAGS


def wants_routing_replay(megatron_args: dict) -> bool:
    """--use-rollout-routing-replay among the Megatron flags (bare or true): the rollout asks the
    engines for the experts they routed each token to, and the trainer replays them."""
    for key, value in megatron_args.items():
        if key.lstrip("-").replace("-", "_") == "use_rollout_routing_replay":
            return value is None or value is True or str(value).lower() in ("true", "1", "yes")
    return False


# megatron.training flags slime's scripts pass (appended for slime's launch scripts, issue 33)
TRAINING_FLAGS.update({
    "accumulate_allreduce_grads_in_fp32": ("grad_reduce_in_fp32", True),
    "no_check_for_nan_in_loss_and_grad": ("check_for_nan_in_grad", False),
    "decoder_first_pipeline_num_layers": ("num_layers_in_first_pipeline_stage", None),
    "decoder_last_pipeline_num_layers": ("num_layers_in_last_pipeline_stage", None),
    "fp8_format": ("fp8", None),  # e4m3 | hybrid: megatron.training's name of TransformerConfig.fp8
})
