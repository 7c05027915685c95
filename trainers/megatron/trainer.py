"""The Megatron trainer: megatron-core GPTModel, DDP, optimizer and pipeline schedules, behind
the same methods as the plain-PyTorch trainer (`train_rollout`, `train_sft`, `compute_logprobs`,
`named_tensors`, `save`, `load`, `.tokenizer`, `.version`).

Parallelism comes from Megatron's own flags (Config.megatron_args): TP, PP, SP, recompute,
distributed optimizer... One process per GPU; started by torchrun (or any launcher that
sets RANK / WORLD_SIZE / LOCAL_RANK), every rank constructs the trainer and calls the same
methods with the same whole rollout; with no launcher it runs as a one-process group.

Per optimizer step (one global batch): the trained samples are split over data-parallel
ranks (balanced by length, or by FLOPs with --balance-data), grouped into micro-batches by token budget
(`--max-tokens-per-gpu`) or count (`--micro-batch-size`) and packed (THD), then Megatron's
forward/backward schedule runs them; the loss is the shared `agentrl.algorithms` objective
on the response tokens, normalised by the global batch's trained-token count.
"""

from __future__ import annotations

import json
import re
import shutil
from functools import partial
from pathlib import Path
from typing import Iterator

import torch

from agentrl.algorithms import (check_algo, copy_parameters, has_dropout, needs_reference, policy_objective,
                                sft_loss, teacher_in_trainer, train_iteration, value_loss)
from agentrl.balance import cost_micro_batches, forward_flops, karmarkar_karp
from agentrl.config import AlgoConfig, TrainConfig
from agentrl.errors import ConfigError
from agentrl.profiling import TrainProfiler
from agentrl.slime_args import check_reference, megatron_checkpoint_dir
from agentrl.trainers import rng_state, set_rng_state
from agentrl.trainers.megatron import mtp, no_apex, optimizer_state, vision
from agentrl.trainers.megatron.args import parse_megatron_args
from agentrl.trainers.megatron.context_parallel import rope_without_cp_split
from agentrl.trainers.megatron.context_parallel import split as cp_split
from agentrl.trainers.megatron.families import family_for, language_config
from agentrl.trainers.megatron.logprobs import fused_logprobs
from agentrl.trainers.megatron.model import (DTYPES, build_gpt, enable_position_rope, enable_response_head,
                                             init_distributed, layer_spec, layout_for, mark_tensor_parallel,
                                             transformer_config, use_te_spec)
from agentrl.trainers.megatron.packing import PackedBatch, micro_batches, pack, padded_length
from agentrl.trainers.megatron.weights import HFCheckpoint, export_hf, load_hf_weights, model_chunks
from agentrl.types import Sample

#: The plugin point for running megatron-core on CPU: megatron-core assumes CUDA, so the trainer
#: refuses device "cpu" unless a patch made it run there and set this (the test-only
#: tests/trainers/megatron_cpu_shim.py's apply()).
megatron_patched_for_cpu = False


class MegatronTrainer:
    def __init__(self, model_path: str, *, train: TrainConfig, algo: AlgoConfig, temperature: float,
                 device: str = "cuda", dtype: str = "bfloat16", megatron_args: dict | None = None, seed: int = 1234,
                 ref_load: str | None = None):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        from agentrl.models import load_tokenizer

        check_algo(algo)
        self.train_cfg, self.algo = train, algo
        self.temperature = temperature if temperature > 0 else 1.0
        self.model_path = str(model_path)
        self.margs = parse_megatron_args(megatron_args or {})
        self.margs.check_context_parallel(use_te_spec(self.margs, device))  # context_parallel.py: local spec only
        if device == "cpu" and not megatron_patched_for_cpu:
            raise ConfigError("the Megatron trainer needs CUDA GPUs (on CPU use --trainer torch; tests apply "
                              "tests/trainers/megatron_cpu_shim.py)")
        if device.startswith("cuda") and device != "cuda":
            device = "cuda"  # the rank's GPU comes from LOCAL_RANK
        from agentrl import hf_mimo

        hf_mimo.register()  # model_type "mimo": transformers has no config class of its own
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self.lm_config = language_config(self.hf_config)  # the decoder's (a VLM's text_config)
        if family_for(self.hf_config).vision:
            vision.check_layout(self.margs, lora=bool(train.lora_rank))
        init_distributed(self.margs, device, seed, num_layers=self.lm_config.num_hidden_layers)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.dtype = DTYPES[dtype]
        self.tokenizer = load_tokenizer(self.model_path)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.te = use_te_spec(self.margs, device)
        self.cp = self.margs.cp
        self.family, self.layout = layout_for(self.hf_config, self.margs, self.te)
        self.processor = self.rope_index = None
        if self.family.vision:  # the samples' images into pixel values and multimodal positions (vision.py)
            from agentrl.vision import load_processor
            self.processor, self.rope_index = load_processor(self.model_path), vision.RopeIndex(self.hf_config)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.rank = dist.get_rank()
        self.routing_replay = self.margs.flag("use_rollout_routing_replay")  # R3
        self.mtp_train = self.margs.flag("enable_mtp_training")  # MTP layers: built with --mtp-num-layers (mtp.py)
        self.mtp_factor = mtp.scaling_factor(self.margs)
        self.max_tokens = train.max_tokens_per_gpu
        self.pad_to = self.margs.tp if self.margs.transformer.get("sequence_parallel") and self.margs.tp > 1 else 1
        self.seq_pad = 2 * self.cp if self.cp > 1 else 1  # each sequence cut into 2 x CP chunks (context_parallel.py)
        self.pad_to *= self.seq_pad
        if self.max_tokens is not None and self.cp > 1:
            self.max_tokens *= self.cp  # --max-tokens-per-gpu: a micro-batch spans the CP group's GPUs
        if self.max_tokens is not None and self.pad_to > 1:
            self.max_tokens -= self.max_tokens % self.pad_to or 0
        ckpt = HFCheckpoint(self.model_path)
        self.lora, self.seed = bool(train.lora_rank), seed
        self.lora_targets: list[str] = []
        self.lora_whole: set[str] = set()  # the Megatron parameters --lora-trainable-modules trains whole

        self.model, self.ddp, self.optimizer, self.scheduler, self.config = self._build(ckpt, lr=train.lr)
        # --use-kl-loss / --kl-coef: KL against the frozen initial policy, or slime's --ref-load (an HF
        # folder or a Megatron distributed checkpoint)
        self.ref_model, self.ref_path, self.ref_given = None, str(ref_load or self.model_path), bool(ref_load)
        if needs_reference(algo):
            if ref_load:
                check_reference(ref_load, "megatron", start=self.model_path)
            self.ref_model = self._frozen_model(self.ref_path, dtype, device)
        if algo.ref_update_interval and self.lora:
            raise ConfigError("--ref-update-interval with --lora-rank: the Megatron trainer's reference is a model "
                              "without adapters and the merged weights exist only as HF tensors for the engines; "
                              "use the torch trainer, or train without LoRA")
        self.teacher_model = None  # --use-opd: the teacher whose logprobs the advantages are pulled toward
        if teacher_in_trainer(algo):
            self.teacher_model = self._frozen_model(algo.opd_teacher_load, dtype, device)
        self.critic = self.critic_ddp = self.critic_optimizer = self.critic_scheduler = None
        if algo.advantage_estimator == "ppo":
            (self.critic, self.critic_ddp, self.critic_optimizer, self.critic_scheduler,
             self.critic_config) = self._build(ckpt, lr=algo.critic_lr or train.lr, value_head=True)
        self.version = 0
        self.dtype_name = dtype
        self.profiler = TrainProfiler(train)  # --use-pytorch-profiler

    # -- construction --------------------------------------------------------------------------
    def _build(self, ckpt: HFCheckpoint, *, lr: float, value_head: bool = False):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        device = "cpu" if self.device.type == "cpu" else "cuda"
        config = transformer_config(self.lm_config, self.family, self.margs, dtype=self._dtype_name(), device=device,
                                    te=self.te)
        if config.virtual_pipeline_model_parallel_size and (self.lora or value_head):
            raise ConfigError("virtual pipeline stages are not supported with --lora-rank or the PPO critic")
        if self.lora and self.layout.mtp_layers:
            raise ConfigError("--mtp-num-layers with --lora-rank: the MTP layers are trained whole or not at all; "
                              "train without LoRA")
        chunks = self._model_chunks(config, ckpt, value_head=value_head, with_mtp=not value_head)
        model = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
        if self.lora and not value_head:  # frozen base + adapters: only they get grad buffers and optimizer state
            from agentrl.trainers.megatron.lora import add_lora
            self.lora_targets, self.lora_whole = add_lora(model, self.train_cfg, self.layout, family=self.family,
                                                          tp_rank=self.tp_rank, seed=self.seed)
        ddp_kw = {"grad_reduce_in_fp32": True, "overlap_grad_reduce": False, "use_distributed_optimizer": False}
        ddp_kw.update(self.margs.ddp)
        ddps = [DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(**ddp_kw), module=chunk,
                                        disable_bucketing=i > 0)  # as megatron.training: only chunk 0 overlaps
                for i, chunk in enumerate(chunks)]
        ddp = ddps[0] if len(ddps) == 1 else ddps
        t = self.train_cfg
        opt_kw = dict(optimizer="adam", lr=lr, min_lr=0.0, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                      adam_beta2=t.adam_beta2, adam_eps=1e-8, clip_grad=t.clip_grad, bf16=config.bf16,
                      fp16=config.fp16, params_dtype=config.params_dtype,
                      use_distributed_optimizer=ddp_kw["use_distributed_optimizer"])
        opt_kw.update(self.margs.optimizer)
        opt_kw["lr"] = lr
        no_apex.install_multi_tensor_ops()  # grad norm and weight copies on the device, without host syncs
        optimizer = get_megatron_optimizer(OptimizerConfig(**opt_kw), ddps)
        optimizer_state.install(optimizer)  # its checkpoint state, saved and loaded per parameter
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = ddps[0].no_sync if len(ddps) == 1 else [d.no_sync for d in ddps]
        config.grad_scale_func = optimizer.scale_loss
        scheduler = self._scheduler(optimizer, lr, opt_kw["min_lr"])
        return model, ddp, optimizer, scheduler, config

    def _model_chunks(self, config, ckpt: HFCheckpoint, *, value_head: bool = False, with_mtp: bool = False) -> list:
        """This rank's GPTModel, loaded from the HF checkpoint: one, or one per virtual pipeline
        stage (the interleaved schedule's model chunks). with_mtp: the policy, with its
        --mtp-num-layers MTP block (mtp.py)."""
        vpp = config.virtual_pipeline_model_parallel_size
        chunks = []
        for vp_stage in (range(vpp) if vpp else [None]):
            spec = layer_spec(config, self.family, self.te, vp_stage)
            chunk = build_gpt(self.lm_config, config, spec, padded_vocab=self.layout.padded_vocab,
                              value_head=value_head, vp_stage=vp_stage)
            if self.family.vision:
                vision.attach(chunk, vision.build_tower(self.hf_config, config.params_dtype))
            chunk = chunk.to(self.device)
            if with_mtp and self.layout.mtp_layers:
                block = mtp.build_block(config, spec, te=self.te, num_layers=self.layout.mtp_layers, vp_stage=vp_stage)
                mtp.attach(chunk, block.to(self.device), train=self.mtp_train)
                mark_tensor_parallel(chunk)
            if not self.te and not self.family.vision:  # (multimodal RoPE: positions per token already)
                enable_position_rope(chunk)
            if self.cp > 1:
                rope_without_cp_split(chunk)
            enable_response_head(chunk)
            load_hf_weights(chunk, ckpt, self.family, self.layout, self.tp_rank, value_head=value_head)
            chunks.append(chunk)
        return chunks

    def _dtype_name(self) -> str:
        return {v: k for k, v in DTYPES.items()}[self.dtype]

    def _scheduler(self, optimizer, lr: float, min_lr: float):
        a = self.margs.trainer
        if not any(k in a for k in ("lr_decay_style", "lr_warmup_iters", "lr_decay_iters")):
            return None  # constant LR
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        warmup = int(a.get("lr_warmup_iters", 0))
        decay = int(a.get("lr_decay_iters", 0) or max(warmup + 1, 10**9))
        return OptimizerParamScheduler(optimizer, init_lr=float(a.get("lr_warmup_init", 0.0)), max_lr=lr, min_lr=min_lr,
                                       lr_warmup_steps=warmup, lr_decay_steps=decay,
                                       lr_decay_style=a.get("lr_decay_style", "constant"),
                                       start_wd=self.train_cfg.weight_decay, end_wd=self.train_cfg.weight_decay,
                                       wd_incr_steps=1, wd_incr_style="constant")

    def _set_device(self) -> None:
        if self.device.type == "cuda":  # train_rollout may run in a worker thread
            torch.cuda.set_device(self.device)

    # -- forward pieces ------------------------------------------------------------------------
    def _batches(self, samples: list[Sample], indices: list[int]) -> list[PackedBatch]:
        mine, dp_rank, dp_size = indices, self.dp_rank, self.dp_size
        by_flops = self.train_cfg.balance_by_flops and self.max_tokens is not None
        if by_flops or self.train_cfg.balance_data:  # slime's: shares and micro-batches weighed by estimated FLOPs
            hf = self.lm_config.to_dict()
            lengths = {i: padded_length(len(samples[i].tokens), self.seq_pad) for i in indices}
            costs = {i: forward_flops(n, hf) for i, n in lengths.items()}
            if dp_size > 1:  # this rank's share by Karmarkar-Karp on the costs
                share = karmarkar_karp([costs[i] for i in indices], dp_size)[dp_rank]
                mine, dp_rank, dp_size = [indices[j] for j in share], 0, 1
        if by_flops and mine:
            groups = cost_micro_batches([costs[i] for i in mine], [lengths[i] for i in mine], self.max_tokens)
            batches = [pack(samples, [mine[j] for j in g], pad_to=self.pad_to, pad_id=self.pad_id,
                            seq_pad=self.seq_pad) for g in groups]
        else:
            batches = micro_batches(samples, mine, dp_rank=dp_rank, dp_size=dp_size,
                                    max_tokens=self.max_tokens, micro_batch_size=self.train_cfg.micro_batch_size,
                                    pad_to=self.pad_to, pad_id=self.pad_id, seq_pad=self.seq_pad)
        want = self._micro_batch_count(len(batches))
        while len(batches) < want:  # run copies with zero weight so collectives match
            dummy = micro_batches(samples, indices[:1], dp_rank=0, dp_size=1, max_tokens=None, micro_batch_size=1,
                                  pad_to=self.pad_to, pad_id=self.pad_id, seq_pad=self.seq_pad)[0]
            dummy.dummy = True
            batches.append(dummy)
        if self.margs.pp == 2 and isinstance(self.ddp, list):
            # virtual stages on two ranks: megatron-core's batched shape exchange swaps the two
            # directions' shapes (model.transformer_config), harmless only when they are equal
            longest = max(b.num_tokens for b in batches)
            batches = [b.pad_to_length(longest + (-longest) % self.pad_to, self.pad_id) for b in batches]
        if self.routing_replay:
            for b in batches:
                b.routing = self._recorded_routing(samples, b)
        if self.family.vision:
            for b in batches:
                vision.add_images(b, samples, self.processor, self.rope_index)
        elif any(samples[i].images for b in batches for i in b.indices):
            raise ValueError("samples with images, and the trainer's model is not a vision-language model")
        if self.cp > 1:  # this CP rank's chunks of every sequence
            from megatron.core import parallel_state as ps
            batches = [cp_split(b, self.cp, ps.get_context_parallel_rank(), ps.get_context_parallel_group())
                       for b in batches]
        return [b.to(self.device) for b in batches]

    def _recorded_routing(self, samples: list[Sample], mb: PackedBatch) -> torch.Tensor:
        """The engine's experts for every packed token of mb, [T, layers, top-k] (R3). A record
        may be flat per token ([tokens, layers * top-k], as the client decodes SGLang's) and may
        stop before the sample's last tokens (env tokens appended after the last generation).
        Tokens without a record (those, each sample's last token, padding) get experts
        0..k-1: causal attention keeps their outputs from every trained token's logprob."""
        k = self.family.moe.topk
        parts, layers = [], None
        for i in mb.indices:
            s = samples[i]
            if s.routed_experts is None:
                raise ValueError(f"trajectory {s.trajectory_id}: --use-rollout-routing-replay needs the engine's routed "
                                 "experts (SGLang --enable-return-routed-experts), and this sample has none")
            rec = torch.as_tensor(s.routed_experts, dtype=torch.int64)
            n = len(s.tokens)
            trained = [j for j, m in enumerate(s.loss_mask) if m]
            need = len(s.prompt_tokens) + (trained[-1] if trained else 0)  # up to the last trained token's input
            if rec.dim() == 2 and rec.shape[1] % k == 0:
                rec = rec.reshape(rec.shape[0], -1, k)
            if rec.dim() != 3 or rec.shape[2] != k or (layers and rec.shape[1] != layers) \
                    or not need <= rec.shape[0] <= n - 1:
                raise ValueError(f"trajectory {s.trajectory_id}: routed_experts has shape {tuple(rec.shape)}, expected "
                                 f"[{need}..{n - 1} (tokens up to the last trained one), layers, {k} (top-k)]")
            layers = rec.shape[1]
            parts += [rec, torch.arange(k).expand(n - rec.shape[0], layers, k)]
        pad = mb.num_tokens - sum(len(samples[i].tokens) for i in mb.indices)
        parts.append(torch.arange(k).expand(pad, layers, k))
        return torch.cat(parts).to(self.device)

    def _replay_routing(self, gpt, mb: PackedBatch) -> None:
        """Every MoE layer of this model chunk routes mb's tokens to the recorded experts."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        moe_layers = self.family.moe.layers
        recorded = mb.routing.shape[1]
        for layer in gpt.decoder.layers:
            replay = getattr(getattr(layer.mlp, "router", None), "router_replay", None)
            if replay is None:
                continue
            i = layer.layer_number - 1  # global
            if recorded == len(moe_layers):  # one entry per decoder layer
                column = i
            elif recorded == sum(moe_layers):  # one per MoE layer
                column = sum(moe_layers[:i])
            else:
                raise ValueError(f"routed_experts has {recorded} layers; the model has {len(moe_layers)} layers, "
                                 f"{sum(moe_layers)} of them MoE")
            experts = mb.routing[:, column]
            if self.config.sequence_parallel:  # the router sees this TP rank's slice of the sequence
                experts = experts.chunk(self.margs.tp)[self.tp_rank]
            replay.clear_indices()
            replay.set_target_indices(experts)
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _micro_batch_count(self, mine: int) -> int:
        """How many micro-batches this rank runs: at least one; with expert parallelism as many as
        every data-parallel rank (each MoE layer's all-to-all spans them); with virtual pipeline
        stages a multiple of PP (the interleaved schedule runs them in groups of PP)."""
        import torch.distributed as dist
        want = max(mine, 1)
        if self.margs.ep > 1 and self.dp_size > 1:
            t = torch.tensor([want], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
            want = int(t.item())
        if isinstance(self.ddp, list):
            pp = self.margs.pp
            want = -(-want // pp) * pp
        return want

    def _run(self, model, ddp_or_model, batches: list[PackedBatch], loss_fn, *, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, m):
            mb = next(data_iterator)
            gpt = getattr(m, "module", m)
            # RoPE frequencies per token: enable_position_rope's, or the multimodal ones (from position_ids)
            by_position = not self.te and (self.family.vision or hasattr(gpt.rotary_pos_emb, "positions"))
            if self.family.vision:
                gpt.embedding.images = mb.images  # vision.attach: the image embeddings at their tokens
            elif by_position:
                gpt.rotary_pos_emb.positions = (mb.position_ids[0], mb.max_seqlen)
            if self.routing_replay:
                self._replay_routing(gpt, mb)
            head = getattr(gpt, "output_layer", None)
            if hasattr(head, "rows"):  # enable_response_head
                head.rows = mb.logit_index
            run_mtp = self.mtp_train and not forward_only and getattr(gpt, "mtp", None) is not None
            if run_mtp:
                gpt.mtp_run = True
            out = m(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params(by_position))
            if run_mtp:  # the MTP layers' hidden states, for _step's loss
                mb.mtp_out, gpt.mtp_run, gpt.mtp_hidden = (gpt, gpt.mtp_hidden), False, None
            return out, partial(loss_fn, mb)

        chunks = ddp_or_model if isinstance(ddp_or_model, (list, torch.nn.ModuleList)) else [ddp_or_model]
        data = iter(batches) if len(chunks) == 1 else [iter(batches) for _ in chunks]  # each chunk sees every one
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=list(chunks),
            num_microbatches=len(batches), seq_length=max(b.num_tokens for b in batches), micro_batch_size=1,
            forward_only=forward_only)

    def _logprobs(self, logits: torch.Tensor, mb: PackedBatch, with_entropy: bool):
        """Logprobs (and entropies) of mb's response tokens from vocab-parallel logits [1, T, V/tp],
        or [1, N, V/tp] when the head ran over the response positions only (enable_response_head)."""
        rows = mb.logit_index
        if logits.shape[1] != mb.num_tokens:  # N < T: every sample has a prompt token
            rows = torch.arange(rows.numel(), device=rows.device)
        logp, entropy = fused_logprobs(logits[0], rows, mb.targets, temperature=self.temperature,
                                       vocab_size=self.layout.vocab, tp_group=self.tp_group, tp_rank=self.tp_rank,
                                       with_entropy=with_entropy)
        # context parallelism: every response token's, in flat order, on every CP rank
        return mb.gather(logp), (mb.gather(entropy) if entropy is not None else None)

    def _gather_results(self, local: dict[int, list[float]]) -> dict[int, list[float]]:
        """Per-sample results held by the last stage of each data-parallel rank -> every rank."""
        import torch.distributed as dist
        if self.dp_size > 1:
            parts = [None] * self.dp_size
            dist.all_gather_object(parts, local, group=self.dp_group)
            local = {k: v for p in parts for k, v in p.items()}
        if dist.get_world_size(self.pp_group) > 1:
            obj = [local]
            dist.broadcast_object_list(obj, src=dist.get_process_group_ranks(self.pp_group)[-1], group=self.pp_group)
            local = obj[0]
        return local

    # -- log-probabilities and values ----------------------------------------------------------
    @torch.no_grad()
    def _frozen_model(self, source: str, dtype: str, device: str):
        """A model of the policy's shape and layout (its virtual stages too) with the weights of
        `source`, for logprobs only (reference, teacher): an HF folder, or a Megatron distributed
        checkpoint (slime's torch_dist, an agentrl checkpoint) read into this layout."""
        cfg = transformer_config(self.lm_config, self.family, self.margs, dtype=dtype, device=device.split(":")[0],
                                 te=self.te)
        dist_dir = megatron_checkpoint_dir(source)
        chunks = self._model_chunks(cfg, HFCheckpoint(self.model_path if dist_dir else source))
        model = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
        if dist_dir:
            self._read_weights(model, source)
        return model.eval().requires_grad_(False)

    @torch.no_grad()
    def _read_weights(self, model, source: str) -> None:
        """`source`'s weights into `model` (this rank's chunks): an HF folder, or the model part of a
        Megatron distributed checkpoint (matched by sharded key, so any layout it was saved in
        that dist_checkpointing reshards; its optimizer state is not read)."""
        from megatron.core import dist_checkpointing

        dist_dir = megatron_checkpoint_dir(source)
        chunks = model_chunks(model)
        if dist_dir is None:
            for chunk in chunks:
                load_hf_weights(chunk, HFCheckpoint(source), self.family, self.layout, self.tp_rank)
            return
        state = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
        loaded = dist_checkpointing.load(state, str(dist_dir))
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model{i}"])

    def compute_logprobs(self, samples: list[Sample], model=None) -> list[list[float]]:
        """Per-sample response logprobs under the policy (or `model`, e.g. the reference)."""
        self._set_device()
        model = model if model is not None else self.model
        results: dict[int, list[float]] = {}

        def loss_fn(mb, logits):
            logp, _ = self._logprobs(logits, mb, with_entropy=False)
            for i, row in zip(mb.indices, mb.split(logp)):
                if not getattr(mb, "dummy", False):
                    results[i] = row
            return logits.new_zeros(()), {}

        was_training = model.training
        model.eval()
        self._run(model, model, self._batches(samples, list(range(len(samples)))), loss_fn, forward_only=True)
        model.train(was_training)
        results = self._gather_results(results)
        return [results[i] for i in range(len(samples))]

    @torch.no_grad()
    def compute_values(self, samples: list[Sample]) -> list[list[float]]:
        self._set_device()
        results: dict[int, list[float]] = {}

        def loss_fn(mb, values):
            v = mb.gather(values[0, :, 0].index_select(0, mb.logit_index).float())
            for i, row in zip(mb.indices, mb.split(v)):
                if not getattr(mb, "dummy", False):
                    results[i] = row
            return values.new_zeros(()), {}

        self.critic.eval()
        self._run(self.critic, self.critic, self._batches(samples, list(range(len(samples)))), loss_fn,
                  forward_only=True)
        self.critic.train()
        results = self._gather_results(results)
        return [results[i] for i in range(len(samples))]

    # -- one iteration of training -------------------------------------------------------------
    def train_rollout(self, samples: list[Sample]) -> dict[str, float]:
        """Advantages, then one optimizer step per global batch (policy, and the critic for ppo)."""
        self._set_device()
        return train_iteration(self, samples, self.algo, self.train_cfg.global_batch_size)

    def _step(self, model, ddp, optimizer, scheduler, samples, idx, make_loss) -> dict[str, float]:
        """One optimizer step over the trained samples of idx; make_loss(mb, output, denom) ->
        (loss, stats) with loss a token sum / denom."""
        import torch.distributed as dist

        trained = [i for i in idx if samples[i].trainable]
        denom = float(sum(samples[i].num_trained_tokens for i in trained))
        if not trained:
            return {}
        batches = self._batches(samples, trained)
        sums: dict[str, torch.Tensor] = {}
        scale = len(batches) * self.dp_size  # Megatron divides by the micro-batch count, DDP averages over DP

        def loss_fn(mb, output):
            loss, stats = make_loss(mb, output, denom)
            if getattr(mb, "mtp_out", None) is not None:  # --enable-mtp-training: the MTP layers' loss beside it
                (gpt, hidden), mb.mtp_out = mb.mtp_out, None
                mask = mb.flat([s.loss_mask for s in samples], loss.device)
                extra, more = mtp.mtp_loss(gpt, hidden, mb, mask, denom, factor=self.mtp_factor,
                                           vocab_size=self.layout.vocab, tp_group=self.tp_group, tp_rank=self.tp_rank)
                loss, stats = loss + extra, {**stats, **more}
            if getattr(mb, "dummy", False):
                loss, stats = loss * 0.0, {}
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v.detach().float()
            return loss * scale, {}

        model.train()
        for d in (ddp if isinstance(ddp, list) else [ddp]):
            d.zero_grad_buffer()
        optimizer.zero_grad()
        self._run(model, ddp, batches, loss_fn, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        if scheduler is not None:
            scheduler.step(increment=1)
        keys = sorted(sums)
        packed = torch.stack([sums[k].reshape(()) for k in keys]) if keys else torch.zeros(0)
        if self.dp_size > 1 and keys:
            packed = packed.to(self.device)
            dist.all_reduce(packed, group=self.dp_group)
        stats = dict(zip(keys, packed.tolist()))
        if dist.get_world_size(self.pp_group) > 1:
            obj = [stats]
            dist.broadcast_object_list(obj, src=dist.get_process_group_ranks(self.pp_group)[-1], group=self.pp_group)
            stats = obj[0]
        stats["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        stats["update_skipped"] = 0.0 if ok else 1.0
        return stats

    @property
    def train_forward_has_dropout(self) -> bool:
        """Training-mode dropout (--lora-dropout, the HF config's attention_dropout), or sinkhorn MoE routing
        (it routes differently in training): then the training forward is not compute_logprobs' and the old
        logprobs cannot come from it (reuses_training_logprobs)."""
        return (has_dropout([self.model], float(getattr(self.lm_config, "attention_dropout", 0.0) or 0.0))
                or getattr(self.config, "moe_router_load_balancing_type", None) == "sinkhorn")

    def policy_step(self, idx, samples, advantages, old, ref) -> dict[str, float]:
        """One optimizer step; old None: the old logprobs are the training forward's (policy_objective)."""
        with_entropy = self.algo.entropy_coef > 0

        def make_loss(mb: PackedBatch, logits, denom):
            logp, entropy = self._logprobs(logits, mb, with_entropy)
            dev = logp.device
            return policy_objective(
                self.algo, logprobs=logp, mask=mb.flat([s.loss_mask for s in samples], dev),
                denom=denom, old_logprobs=mb.flat(old, dev) if old is not None else None,
                advantages=mb.flat(advantages, dev),
                ref_logprobs=mb.flat(ref, dev) if ref is not None else None,
                rollout_logprobs=mb.flat([s.rollout_logprobs for s in samples], dev), entropy=entropy,
                seq_ids=mb.seq_ids)

        stats = self._step(self.model, self.ddp, self.optimizer, self.scheduler, samples, idx, make_loss)
        self.version += 1
        return stats

    def train_sft(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning on `samples` (one global batch, the same
        on every rank): the mean NLL of their trained tokens (`algorithms.sft_loss`), at the
        trainer's temperature (`agentrl sft` builds the trainer with temperature 1)."""
        self._set_device()

        def make_loss(mb: PackedBatch, logits, denom):
            logp, _ = self._logprobs(logits, mb, with_entropy=False)
            return sft_loss(logp, mb.flat([s.loss_mask for s in samples], logp.device), denom)

        stats = self._step(self.model, self.ddp, self.optimizer, self.scheduler, samples, list(range(len(samples))),
                           make_loss)
        self.version += 1
        return stats

    def critic_step(self, idx, samples, old_values, returns) -> dict[str, float]:
        def make_loss(mb: PackedBatch, values, denom):
            v = mb.gather(values[0, :, 0].index_select(0, mb.logit_index).float())
            dev = v.device
            mask = mb.flat([s.loss_mask for s in samples], dev)
            loss, clipfrac = value_loss(v, mb.flat(old_values, dev), mb.flat(returns, dev), mask,
                                        clip=self.algo.value_clip, denom=denom)
            return loss, {"value_loss": loss.detach(), "value_clipfrac": clipfrac}

        stats = self._step(self.critic, self.critic_ddp, self.critic_optimizer, self.critic_scheduler, samples, idx,
                           make_loss)
        return {("critic_" + k if k in ("grad_norm", "update_skipped") else k): v for k, v in stats.items()}

    # -- weights ---------------------------------------------------------------------------------
    def hf_buckets(self, bucket_bytes: int | None = None, dtype: torch.dtype | None = None, *, merged: bool = True
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The policy's weights in HF names and layout, bucketed (every rank gets every bucket,
        on its own device): what tensor or NCCL weight sync sends. With LoRA the adapters are
        merged in (W + scale B A: --lora-sync merged), unless merged=False (the frozen base)."""
        self._set_device()
        size = bucket_bytes or int(self.train_cfg.weight_sync_bucket_mb * 2**20)
        delta = self._lora_delta() if self.lora and merged else None
        yield from export_hf(self.model, self.family, self.layout, bucket_bytes=size, tp_group=self.tp_group,
                             pp_group=self.pp_group, dtype=dtype, delta=delta)

    def _lora_delta(self):
        """HF weight name -> scale B A of its adapter (gathered over TP on demand), or None."""
        from agentrl.trainers.megatron.lora import HF_PARENT, lora_layers, split_dim
        from agentrl.trainers.megatron.weights import _tp_gather

        where = {f"model.layers.{i}.{HF_PARENT[m]}.{m}.weight": (adapters, m)
                 for i, _, adapters in lora_layers(self.model) for m in adapters.pairs}

        def delta(hf_name: str):
            if hf_name not in where:
                return None
            adapters, m = where[hf_name]
            pair = adapters.pairs[m]
            a, b = (_tp_gather(getattr(pair, w).detach(), split_dim(w, adapters.kind), self.tp_group, self.margs.tp)
                    for w in "AB")
            return (b.float() @ a.float()) * adapters.scale
        return delta

    def trained_module_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The --lora-trainable-modules weights (trained whole, beside the adapters) in HF names:
        what --lora-sync adapter sends by the full-weight path. Collective, as hf_buckets."""
        self._set_device()
        size = int(self.train_cfg.weight_sync_bucket_mb * 2**20)
        for bucket in export_hf(self.model, self.family, self.layout, bucket_bytes=size, tp_group=self.tp_group,
                                pp_group=self.pp_group, only=self.lora_whole):
            yield from bucket

    # -- LoRA adapters (peft's format) ---------------------------------------------------------
    def save_adapter(self, folder: str | Path) -> Path:
        """The LoRA adapter alone, in peft's format (adapter_config.json, adapter_model.safetensors
        with peft's names for the HF model): what `peft.PeftModel.from_pretrained` and SGLang's
        /load_lora_adapter read. Collective (TP shards gathered, stages exchanged); rank 0 writes."""
        import torch.distributed as dist

        from agentrl.trainers.megatron.lora import gather_adapter, write_peft

        self._set_device()
        tensors = gather_adapter(self.model, tp_group=self.tp_group, pp_group=self.pp_group)
        if self.rank == 0:
            write_peft(folder, tensors, self.train_cfg, self.lora_targets, self.model_path)
        if dist.is_initialized():
            dist.barrier()
        return Path(folder)

    def load_adapter_weights(self, folder: str | Path) -> None:
        """The adapter weights of a peft folder (save_adapter's, or peft's own) into this trainer's adapters."""
        from safetensors.torch import load_file

        from agentrl.trainers.megatron.lora import load_adapter

        load_adapter(self.model, load_file(str(Path(folder) / "adapter_model.safetensors")), tp_rank=self.tp_rank)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Weights in HF names, as the engine loads them (tied weights once), streamed bucket by bucket."""
        for bucket in self.hf_buckets():
            yield from bucket

    def save_hf(self, folder: str | Path, max_shard_bytes: int = 5 * 2**30, *, merged: bool = True) -> Path:
        """An HF checkpoint (safetensors shards, config, tokenizer) the engines can load;
        written by global rank 0, every rank takes part in the export. With LoRA: the adapters
        merged in, or (merged=False) the frozen base."""
        import torch.distributed as dist
        from safetensors.torch import save_file

        folder = Path(folder)
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.glob("model*.safetensors*"):
                old.unlink()
        # rank 0 writes each shard as it fills (held on the host: one shard and one bucket, never
        # the whole model); the names say "of N" once N is known
        files: list[Path] = []
        weight_map: dict[str, int] = {}
        shard: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush():
            nonlocal shard, size
            if shard:
                files.append(folder / f"model-part{len(files) + 1:05d}.safetensors")
                save_file(shard, str(files[-1]), metadata={"format": "pt"})
                weight_map.update({name: len(files) - 1 for name in shard})
            shard, size = {}, 0

        for bucket in [*self.hf_buckets(bucket_bytes=256 * 2**20, merged=merged), self._unbuilt_tensors()]:
            if self.rank != 0:
                continue
            for name, t in bucket:
                n = t.numel() * t.element_size()
                if shard and size + n > max_shard_bytes:
                    flush()
                shard[name] = t.detach().to("cpu", copy=True).contiguous()
                size, total = size + n, total + n
        if self.rank == 0:
            flush()
            if len(files) == 1:
                files[0].rename(folder / "model.safetensors")
            else:
                names = [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
                for f, name in zip(files, names):
                    f.rename(folder / name)
                (folder / "model.safetensors.index.json").write_text(json.dumps(
                    {"metadata": {"total_size": total}, "weight_map": {n: names[k] for n, k in weight_map.items()}},
                    indent=1))
            config = self.hf_config.__class__.from_dict(self.hf_config.to_dict())
            config.torch_dtype = self._dtype_name()
            config.save_pretrained(folder)
            self.tokenizer.save_pretrained(folder)
            gen = Path(self.model_path) / "generation_config.json"
            if gen.exists():
                shutil.copy(gen, folder / "generation_config.json")
            for code in Path(self.model_path).glob("*.py"):  # a config.json auto_map's remote code (MiMo's)
                shutil.copy(code, folder / code.name)
            if self.processor is not None:  # a VLM's processor files: the engines and a resume load them
                from agentrl.vision import copy_processor_files
                copy_processor_files(self.model_path, folder)
        if dist.is_initialized():
            dist.barrier()
        return folder

    def _unbuilt_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The start checkpoint's MTP tensors when the model was built without them (MiMo without
        --mtp-num-layers): unchanged, they go into a saved checkpoint as they are (rank 0 reads them)."""
        if not self.family.mtp or self.layout.mtp_layers or self.rank != 0:
            return []
        ckpt = HFCheckpoint(self.model_path)
        return [(n, ckpt.get(n)) for n in ckpt.keys() if n.startswith("model.mtp_layers.")]

    # -- checkpoints -----------------------------------------------------------------------------
    def _sharded_state(self, is_loading: bool = False) -> dict:
        state = self._model_and_optimizer_state(is_loading)
        if self.train_cfg.no_save_optim:  # --no-save-optim: neither saved nor loaded (slime's --no-load-optim)
            state = {k: v for k, v in state.items() if k not in ("optimizer", "critic_optimizer")}
        return state

    def _model_and_optimizer_state(self, is_loading: bool) -> dict:
        # The distributed optimizer's state in megatron-core's fully reshardable format: its
        # default (fully_sharded_model_space) builds flattened ShardedTensors, which this
        # megatron-core refuses at save; this one loads into any TP/PP/EP/DP layout.
        opt = dict(is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        if isinstance(self.model, torch.nn.ModuleList):  # virtual stages: megatron.training's model0, model1, ...
            # the chunks' local names repeat (each numbers its layers from 0): the optimizer maps its
            # parameters to sharded tensors over the nested dict, as megatron.training passes it
            state = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(self.model)}
            state["optimizer"] = self.optimizer.sharded_state_dict(dict(state), **opt)
            return state
        state = {"model": self.model.sharded_state_dict()}
        if self.lora:  # the base is frozen and saved once as model/: what trains alone (and its optimizer state)
            trained = self._lora_trained()
            state["model"] = {k: v for k, v in state["model"].items() if k in trained}
        state["optimizer"] = self.optimizer.sharded_state_dict(state["model"], **opt)
        if self.critic is not None:
            state["critic"] = self.critic.sharded_state_dict(prefix="critic.")
            state["critic_optimizer"] = self.critic_optimizer.sharded_state_dict(state["critic"], **opt)
        return state

    def save(self, folder: Path, extra_state: dict) -> None:
        """A Megatron distributed checkpoint (model, optimizer, critic) under folder/megatron, an HF
        copy of the policy under folder/model (what the engines reload on resume; also
        --save-hf), RNG states per rank, and trainer_state.json (version + the run's state).
        With LoRA: model/ is the base (frozen, but for the --lora-trainable-modules as trained),
        adapter/ the peft adapter, and the distributed checkpoint holds only the trained
        parameters (adapters and modules trained whole) and their optimizer state."""
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        self._set_device()
        folder = Path(folder)
        dist_dir = folder / "megatron"
        if self.rank == 0:
            if dist_dir.exists():
                shutil.rmtree(dist_dir)
            dist_dir.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(), str(dist_dir))
        rng = rng_state(self.device)
        if self.device.type == "cuda":
            from megatron.core import tensor_parallel
            rng["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
        torch.save(rng, dist_dir / f"rng_rank{self.rank:05d}.pt")
        self.save_hf(folder / "model", merged=False)
        if self.lora:
            self.save_adapter(folder / "adapter")
        if self.train_cfg.save_hf:
            self.save_hf(self.train_cfg.save_hf.format(rollout_id=extra_state.get("rollout_id", self.version)))
        if self.rank == 0:
            sched = {k: s.state_dict() for k, s in (("policy", self.scheduler), ("critic", self.critic_scheduler))
                     if s is not None}
            torch.save(sched, dist_dir / "schedulers.pt")
            (folder / "trainer_state.json").write_text(json.dumps(
                {"version": self.version, "ref_model_path": str(Path(self.ref_path).resolve()),
                 "distributed_optimizer": self._distributed_optimizer(), **extra_state}, indent=1))
        dist.barrier()

    def _lora_trained(self) -> set[str]:
        """With LoRA: the policy's trained parameters by their local names (the adapters and the
        --lora-trainable-modules), what its distributed checkpoint holds."""
        return {n for n, p in self.model.named_parameters() if p.requires_grad}

    def _distributed_optimizer(self) -> bool:
        return bool(self.margs.ddp.get("use_distributed_optimizer"))

    @torch.no_grad()
    def update_reference(self) -> None:
        """--ref-update-interval: each of this rank's reference chunks takes its policy chunk's weights
        (same layout: the reference is built as the policy is)."""
        for ref_chunk, chunk in zip(model_chunks(self.ref_model), model_chunks(self.model), strict=True):
            copy_parameters(ref_chunk, chunk.named_parameters(), "--ref-update-interval")

    def load(self, folder: Path) -> dict:
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        self._set_device()
        folder = Path(folder)
        dist_dir = folder / "megatron"
        if self.lora and not (folder / "adapter").is_dir():
            raise FileNotFoundError(f"{folder}: no adapter/ (a checkpoint without --lora-rank cannot resume a LoRA run)")
        saved_kind = json.loads((folder / "trainer_state.json").read_text()).get("distributed_optimizer")
        if saved_kind is not None and saved_kind != self._distributed_optimizer():
            # megatron-core keeps Adam's state in another format for each kind: any layout, not another kind
            raise ConfigError(f"--load {folder}: saved {'with' if saved_kind else 'without'} "
                              f"--use-distributed-optimizer; resume it {'with' if saved_kind else 'without'} it too")
        optim = not self.train_cfg.no_save_optim
        # the optimizer's sharded keys: "optimizer.state..." or, chained (MoE: dense + expert), "chained_N.optimizer..."
        if optim and not any(re.match(r"(chained_\d+\.)?optimizer\.", k)
                             for k in dist_checkpointing.load_tensors_metadata(str(dist_dir))):
            raise ConfigError(f"--load {folder}: saved with --no-save-optim (no optimizer state); resume with "
                              "--no-save-optim to start the optimizer afresh")
        for optimizer in (self.optimizer, self.critic_optimizer) if optim else ():
            _prepare_load(optimizer)
        loaded = dist_checkpointing.load(self._sharded_state(is_loading=True), str(dist_dir))
        if self.lora:
            missing, unexpected = self.model.load_state_dict(loaded["model"], strict=False)
            trained = self._lora_trained()
            missing = [k for k in missing if k in trained]
            if unexpected or missing:
                raise ValueError(f"{folder}: adapter weights do not fit: missing {missing[:3]}"
                                 f", unexpected {unexpected[:3]}")
        elif isinstance(self.model, torch.nn.ModuleList):
            for i, chunk in enumerate(self.model):
                chunk.load_state_dict(loaded[f"model{i}"])
        else:
            self.model.load_state_dict(loaded["model"])
        if optim:
            self.optimizer.load_state_dict(loaded["optimizer"])
        if self.critic is not None:
            self.critic.load_state_dict({k.removeprefix("critic."): v for k, v in loaded["critic"].items()})
            if optim:
                self.critic_optimizer.load_state_dict(loaded["critic_optimizer"])
        for optimizer in (self.optimizer, self.critic_optimizer) if optim else ():
            _own_steps(optimizer)
        rng_file = dist_dir / f"rng_rank{self.rank:05d}.pt"
        if rng_file.exists():
            rng = torch.load(rng_file, weights_only=False)
            set_rng_state(rng, self.device)
            if self.device.type == "cuda" and "tracker" in rng:  # megatron's model-parallel CUDA generators
                from megatron.core import tensor_parallel
                tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        if (dist_dir / "schedulers.pt").exists():
            sched = torch.load(dist_dir / "schedulers.pt", weights_only=False)
            for key, s in (("policy", self.scheduler), ("critic", self.critic_scheduler)):
                if s is not None and key in sched:
                    s.load_state_dict(sched[key])
        state = json.loads((folder / "trainer_state.json").read_text())
        self.version = state["version"]
        self.rollouts_trained = state.get("rollout_id", 0)  # --ref-update-interval counts from here, as slime
        ref = state.get("ref_model_path")
        if (self.ref_model is not None and not self.ref_given and ref
                and Path(ref).resolve() != Path(self.ref_path).resolve()):
            # resumed from the checkpoint's HF copy: the reference is still the run's initial model
            if not Path(ref).exists():
                raise ConfigError(f"--load {folder}: the reference model {ref} (the run's initial weights) is gone")
            self._read_weights(self.ref_model, ref)
            self.ref_path = ref
        dist.barrier()
        return state


def _prepare_load(optimizer) -> None:
    """Two megatron-core 0.16 gaps in loading a distributed optimizer's fully_reshardable state
    into torch's Adam (no Apex/TE), worked around on this optimizer alone:
    - before its first step it has no Adam state, and the state dict to load into is built from
      the current one, which reads each parameter's `step`: one step at lr 0 with zero grads
      creates the state (no weight moves; the checkpoint replaces it);
    - where megatron-core's own load runs (optimizer_state reads the state in place otherwise),
      it copies every state key of a parameter from the checkpoint, torch's `step` too, which
      the checkpoint keeps in its param groups instead (restored from there): copy the keys
      the checkpoint has, and fail if one other than `step` is missing."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer] if optimizer is not None else []):
        if not isinstance(opt, DistributedOptimizer) or opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            continue
        if not opt.optimizer.state:
            groups = opt.optimizer.param_groups
            kept = [(g["lr"], g["weight_decay"]) for g in groups]
            for g in groups:
                g["lr"] = g["weight_decay"] = 0.0
            opt._init_optimizer_states_with_dummy_values()
            for g, (lr, wd) in zip(groups, kept):
                g["lr"], g["weight_decay"] = lr, wd

        def set_states(model_param, tensors, opt=opt):
            group, order = opt.model_param_group_index_map[model_param]
            main = opt.optimizer.param_groups[group]["params"][order]
            dst = {"param": main, **opt.optimizer.state[main]}
            if missing := set(dst) - set(tensors) - {"step"}:
                raise ValueError(f"the checkpoint's optimizer state lacks {sorted(missing)}")
            for key, value in tensors.items():
                dst[key].copy_(value)

        opt._set_main_param_and_optimizer_states = set_states


def _own_steps(optimizer) -> None:
    """megatron-core 0.16's distributed optimizer, loading into torch's Adam, gives every parameter
    the same `step` tensor, which Adam then advances once per parameter at each step (16
    parameters: step 1 -> 17, and a wrong bias correction): each gets a copy of its own."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer] if optimizer is not None else []):
        if isinstance(opt, DistributedOptimizer):
            for state in opt.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()
