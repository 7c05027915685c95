"""The plain-PyTorch trainer: the HF model itself, trained with the shared losses.

Used by the embedded default (CPU or one GPU). The model is an ordinary nn.Module with no
wrapper baked in, so FSDP2 (`torch.distributed.fsdp.fully_shard` per decoder layer, then
the root) can shard it on several GPUs without touching the loss code; that launch path
is not wired yet. The Megatron trainer will sit behind the same methods.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from agentrl.algorithms import (check_algo, copy_parameters, entropy_from_logits, has_dropout, needs_reference,
                                policy_objective, sft_loss, teacher_in_trainer, train_iteration, value_loss)
from agentrl.config import AlgoConfig, TrainConfig
from agentrl.errors import ConfigError
from agentrl.models import is_vision_model, load_model, load_tokenizer
from agentrl.profiling import TrainProfiler
from agentrl.trainers import rng_state, set_rng_state
from agentrl.types import Sample
from agentrl.vision import (checkpoint_names, copy_processor_files, forward_inputs, load_processor,
                            pixel_inputs)


def pad_batch(samples: list[Sample], device: str, pad_id: int = 0):
    """Right-padded token ids [B, L] and, over the response positions that predict a
    response token, the index/mask tensors the loss needs."""
    lengths = [len(s.tokens) for s in samples]
    longest = max(lengths)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), longest), dtype=torch.long)
    resp_len = max(s.response_length for s in samples)
    mask = torch.zeros((len(samples), resp_len))
    for i, s in enumerate(samples):
        ids[i, :lengths[i]] = torch.tensor(s.tokens)
        attn[i, :lengths[i]] = 1
        mask[i, :s.response_length] = torch.tensor(s.loss_mask, dtype=torch.float)
    return ids.to(device), attn.to(device), mask.to(device)


class TorchTrainer:
    def __init__(self, model_path: str, *, train: TrainConfig, algo: AlgoConfig, temperature: float,
                 device: str = "cpu", dtype: str = "float32", ref_load: str | None = None):
        self.train_cfg, self.algo, self.device = train, algo, device
        self.temperature = temperature if temperature > 0 else 1.0
        self.model = load_model(model_path, device=device, dtype=dtype)
        # a VLM's weights go to the engines under its checkpoint's names (taken before LoRA wraps the model)
        vision = is_vision_model(model_path)
        self.engine_names = checkpoint_names(self.model) if vision else {}
        if train.lora_rank:  # peft freezes the base weights: only the adapters get grads and optimizer state
            self.model = wrap_lora(self.model, train)
        self.model.train()
        self.tokenizer = load_tokenizer(model_path)
        # a vision-language model's processor: the samples' images into pixel values for its forward
        self.processor = load_processor(model_path) if vision else None
        self.model_path = str(model_path)
        self.pad_id = self.tokenizer.pad_token_id or 0
        check_algo(algo)
        # --use-kl-loss or --kl-coef: KL against the initial model, or slime's --ref-load (an HF folder here)
        self.ref_model, self.ref_path, self.ref_given = None, str(ref_load or model_path), bool(ref_load)
        if needs_reference(algo):
            if ref_load:
                from agentrl.slime_args import check_reference
                check_reference(ref_load, "torch", start=model_path)
            self.ref_model = load_model(self.ref_path, device=device, dtype=dtype).eval().requires_grad_(False)
        self.teacher_model = None  # --use-opd: the teacher whose logprobs the advantages are pulled toward
        if teacher_in_trainer(algo):
            self.teacher_model = load_model(algo.opd_teacher_load, device=device, dtype=dtype).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=train.lr,
                                           weight_decay=train.weight_decay, betas=(train.adam_beta1, train.adam_beta2))
        self.critic = self.critic_optimizer = None
        if algo.advantage_estimator == "ppo":  # the critic: the policy's backbone with a scalar head
            self.critic = ValueModel(load_model(model_path, device=device, dtype=dtype)).to(device)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=algo.critic_lr or train.lr,
                                                      weight_decay=train.weight_decay,
                                                      betas=(train.adam_beta1, train.adam_beta2))
        self.version = 0  # bumped at every optimizer step; the engine's weight_version follows it
        self.profiler = TrainProfiler(train)  # --use-pytorch-profiler

    # -- log-probabilities -------------------------------------------------------------------
    def _response_logprobs(self, model, samples: list[Sample], with_entropy: bool = False):
        """Logprobs of each response token under `model`, temperature-scaled like the engine's.
        Returns ([B, T] logprobs, [B, T] mask, [B, T] entropy or None)."""
        ids, attn, mask = pad_batch(samples, self.device, self.pad_id)
        inputs = self._vision_inputs(model, samples, ids, attn) if any(s.images for s in samples) \
            else {"input_ids": ids, "attention_mask": attn}
        logits = model(**inputs).logits.float() / self.temperature  # [B, L, V]
        T = mask.shape[1]
        # The token at position p is predicted by the logits at p - 1.
        index = torch.zeros((len(samples), T), dtype=torch.long, device=self.device)
        for i, s in enumerate(samples):
            p = len(s.prompt_tokens)
            index[i, :s.response_length] = torch.arange(p - 1, p - 1 + s.response_length)
        gathered = logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1]))  # [B, T, V]
        targets = torch.zeros((len(samples), T), dtype=torch.long, device=self.device)
        for i, s in enumerate(samples):
            targets[i, :s.response_length] = torch.tensor(s.response_tokens)
        logp = torch.log_softmax(gathered, dim=-1).gather(-1, targets[:, :, None]).squeeze(-1)
        entropy = entropy_from_logits(gathered) if with_entropy else None
        return logp, mask, entropy

    def _vision_inputs(self, model, samples: list[Sample], ids, attn) -> dict:
        """Forward kwargs with the samples' images at their prompt's placeholders (the engine's
        prefill does the same, agentrl/vision.py); image tokens in a response stay text."""
        if self.processor is None:
            raise ValueError("samples with images, and the trainer's model is not a vision-language model")
        media = pixel_inputs(self.processor, [u for s in samples for u in s.images])
        prompt = torch.tensor([len(s.prompt_tokens) for s in samples], device=self.device)
        in_prompt = torch.arange(ids.shape[1], device=self.device)[None, :] < prompt[:, None]
        image_mask = (ids == self.processor.image_token_id) & in_prompt
        kwargs, _ = forward_inputs(model, ids, attn, media["pixel_values"].to(self.device),
                                   media["image_grid_thw"].to(self.device), image_mask)
        return kwargs

    def _response_values(self, samples: list[Sample]):
        """The critic's value at each response position (the state before that token). [B, T]"""
        ids, attn, mask = pad_batch(samples, self.device, self.pad_id)
        v = self.critic(ids, attn)  # [B, L]
        index = torch.zeros(mask.shape, dtype=torch.long, device=self.device)
        for i, s in enumerate(samples):
            p = len(s.prompt_tokens)
            index[i, :s.response_length] = torch.arange(p - 1, p - 1 + s.response_length)
        return v.gather(1, index), mask

    @torch.no_grad()
    def compute_values(self, samples: list[Sample]) -> list[list[float]]:
        out: list[list[float]] = []
        for chunk in self._micro_batches(samples):
            v, _ = self._response_values(chunk)
            out += [v[i, :s.response_length].tolist() for i, s in enumerate(chunk)]
        return out

    @torch.no_grad()
    def compute_logprobs(self, samples: list[Sample], model=None) -> list[list[float]]:
        """Per-sample response logprobs (no grad), micro-batched; dropout off (--lora-dropout), as
        the engine sampled them and as the Megatron trainer computes them."""
        model = model or self.model
        was_training = model.training
        model.eval()
        out: list[list[float]] = []
        try:
            for chunk in self._micro_batches(samples):
                logp, _, _ = self._response_logprobs(model, chunk)
                out += [logp[i, :s.response_length].tolist() for i, s in enumerate(chunk)]
        finally:
            model.train(was_training)
        return out

    def _micro_batches(self, items: list, samples: list[Sample] | None = None) -> Iterator[list]:
        """`items` (samples, or indices into `samples`) in forward/backward-sized pieces: by count
        (--micro-batch-size), or with --max-tokens-per-gpu as many as fit that budget of padded
        tokens (pieces x longest; a longer sample goes alone). Loss sums are over the whole step,
        so how the pieces fall does not change the gradient."""
        budget = self.train_cfg.max_tokens_per_gpu
        if not budget:
            yield from _chunks(items, self.train_cfg.micro_batch_size)
            return
        piece, longest = [], 0
        for item in items:
            n = len((samples[item] if samples is not None else item).tokens)
            if piece and (len(piece) + 1) * max(longest, n) > budget:
                yield piece
                piece, longest = [], 0
            piece.append(item)
            longest = max(longest, n)
        if piece:
            yield piece

    # -- one iteration of training -----------------------------------------------------------
    def train_rollout(self, samples: list[Sample]) -> dict[str, float]:
        """Advantages, then the rollout split into global batches (one optimizer step each)."""
        return train_iteration(self, samples, self.algo, self.train_cfg.global_batch_size)

    @property
    def train_forward_has_dropout(self) -> bool:
        """Training-mode dropout (--lora-dropout, the model's own): then the training forward is not
        the eval-mode logprob pass and the old logprobs cannot come from it (`reuses_training_logprobs`)."""
        return has_dropout([self.model], float(getattr(self.model.config, "attention_dropout", 0.0) or 0.0))

    def policy_step(self, idx, samples, advantages, old, ref) -> dict[str, float]:
        """One optimizer step; old None: the old logprobs are the training forward's (policy_objective)."""
        def make_loss(chunk, logp, mask, entropy, denom):
            return policy_objective(
                self.algo, logprobs=logp, mask=mask, denom=denom,
                old_logprobs=_padded([old[i] for i in chunk], logp.shape, self.device) if old is not None else None,
                advantages=_padded([advantages[i] for i in chunk], logp.shape, self.device),
                ref_logprobs=_padded([ref[i] for i in chunk], logp.shape, self.device) if ref is not None else None,
                rollout_logprobs=_padded([samples[i].rollout_logprobs for i in chunk], logp.shape, self.device),
                entropy=entropy)

        stats = {"loss": 0.0, "pg_loss": 0.0, "kl_loss": 0.0, "entropy": 0.0, "clipfrac": 0.0, "ppo_kl": 0.0}
        return stats | self._step(idx, samples, make_loss, with_entropy=self.algo.entropy_coef > 0)

    def train_sft(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning on `samples` (one global batch): the mean
        NLL of their trained tokens (`algorithms.sft_loss`), at the trainer's temperature
        (`agentrl sft` builds the trainer with temperature 1)."""
        return self._step(list(range(len(samples))), samples,
                          lambda chunk, logp, mask, entropy, denom: sft_loss(logp, mask, denom))

    def _step(self, idx, samples, make_loss, *, with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step over the trainable samples of idx, micro-batched.
        make_loss(chunk, logprobs, mask, entropy, denom) -> (loss, stats), each a token sum / denom
        (denom: the trained tokens of the whole step), so micro-batches add up to the step's means."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        trained = [i for i in idx if samples[i].trainable]
        denom = float(sum(samples[i].num_trained_tokens for i in trained))
        stats: dict[str, float] = {}
        if not trained:
            return stats
        for chunk in self._micro_batches(trained, samples):
            logp, mask, entropy = self._response_logprobs(self.model, [samples[i] for i in chunk], with_entropy)
            loss, out = make_loss(chunk, logp, mask, entropy, denom)
            loss.backward()
            for k, v in out.items():
                stats[k] = stats.get(k, 0.0) + v.item()
        if self.train_cfg.clip_grad > 0:
            stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_cfg.clip_grad))
        self.optimizer.step()
        self.version += 1
        return stats

    def critic_step(self, idx, samples, old_values, returns) -> dict[str, float]:
        self.critic.train()
        self.critic_optimizer.zero_grad(set_to_none=True)
        trained = [i for i in idx if samples[i].trainable]
        denom = float(sum(samples[i].num_trained_tokens for i in trained))
        stats = {"value_loss": 0.0, "value_clipfrac": 0.0}
        if not trained:
            return stats
        for chunk in self._micro_batches(trained, samples):
            v, _ = self._response_values([samples[i] for i in chunk])
            mask = _padded([samples[i].loss_mask for i in chunk], v.shape, self.device)
            loss, clipfrac = value_loss(v, _padded([old_values[i] for i in chunk], v.shape, self.device),
                                        _padded([returns[i] for i in chunk], v.shape, self.device), mask,
                                        clip=self.algo.value_clip, denom=denom)
            loss.backward()
            stats["value_loss"] += loss.item()
            stats["value_clipfrac"] += float(clipfrac)
        if self.train_cfg.clip_grad > 0:
            stats["critic_grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.critic.parameters(),
                                                                             self.train_cfg.clip_grad))
        self.critic_optimizer.step()
        return stats

    # -- weights and checkpoints -------------------------------------------------------------
    @property
    def lora(self) -> bool:
        return bool(self.train_cfg.lora_rank)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Weights in HF names, as the engine loads them (tied weights once): the checkpoint's names
        (a VLM's differ from the ones in memory: vision.checkpoint_names); with LoRA the adapters
        merged in (W + scale B A), so any engine serves them (--lora-sync merged)."""
        for name, tensor in self._merged_tensors():
            yield self.engine_names.get(name, name), tensor

    def _merged_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """named_tensors in the names of the model in memory."""
        if not self.lora:
            for name, param in self.model.named_parameters():
                yield name, param.detach()
            return
        base = self.model.get_base_model()
        for name, param in base.named_parameters():
            if ".lora_" in name or ORIGINAL in name:  # the trained copy of a --lora-trainable-modules one
                continue
            if ".base_layer." not in name:
                yield name.replace(TRAINED, "."), param.detach()
                continue
            layer_name, _, leaf = name.partition(".base_layer.")
            tensor = param.detach()
            if leaf == "weight":
                tensor = tensor + base.get_submodule(layer_name).get_delta_weight("default").to(tensor.dtype)
            yield f"{layer_name}.{leaf}", tensor

    def save_hf(self, folder: str | Path) -> Path:
        """An HF checkpoint the engines can load (the disk weight-sync path); with LoRA, merged."""
        if self.lora:
            self.model.get_base_model().save_pretrained(folder, state_dict=dict(self._merged_tensors()))
        else:
            self.model.save_pretrained(folder)
        self._save_tokenizer(folder)
        return Path(folder)

    def _save_tokenizer(self, folder: str | Path) -> None:
        """The tokenizer, and a vision-language model's processor files, beside saved weights."""
        self.tokenizer.save_pretrained(folder)
        if self.processor is not None:
            copy_processor_files(self.model_path, folder)

    def save_adapter(self, folder: str | Path) -> Path:
        """The LoRA adapter alone, in peft's format (adapter_config.json, adapter_model.safetensors):
        what `peft.PeftModel.from_pretrained` and SGLang's /load_lora_adapter read. In the base
        weights' dtype, what the engines compute in (peft trains adapters in float32: half the bytes
        to sync in bfloat16); checkpoints keep float32 (`save`)."""
        import copy

        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        dtype = self.model.get_base_model().dtype
        # SGLang serves lora_A/lora_B only: the --lora-trainable-modules go by the full-weight path
        # (trained_module_tensors), so this folder neither holds nor names them
        weights = {k: v.to(dtype).contiguous() for k, v in get_peft_model_state_dict(self.model).items()
                   if ".lora_" in k}
        Path(folder).mkdir(parents=True, exist_ok=True)
        save_file(weights, str(Path(folder) / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = copy.copy(self.model.peft_config["default"])
        config.modules_to_save = None
        config.save_pretrained(str(folder))
        return Path(folder)

    def trained_module_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The --lora-trainable-modules weights (trained whole, beside the adapters) in HF names and
        the base weights' dtype: what --lora-sync adapter sends by the full-weight path."""
        base = self.model.get_base_model()
        for name, param in base.named_parameters():
            if TRAINED in name:
                yield name.replace(TRAINED, "."), param.detach().to(base.dtype)

    def save(self, folder: Path, extra_state: dict) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if self.lora:  # model/: the frozen base (what engines start from), adapter/: what trained
            self.model.get_base_model().save_pretrained(folder / "model", state_dict=dict(self._base_tensors()))
            self._save_tokenizer(folder / "model")
            self.model.save_pretrained(folder / "adapter")  # float32, as it trains: an exact resume
        else:
            self.save_hf(folder / "model")
        optim = not self.train_cfg.no_save_optim  # --no-save-optim: no optimizer state (and none loaded back)
        if optim:
            torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
        if self.critic is not None:
            torch.save({"model": self.critic.state_dict()} | ({"optimizer": self.critic_optimizer.state_dict()}
                                                              if optim else {}), folder / "critic.pt")
        torch.save(rng_state(self.device), folder / "rng.pt")
        (folder / "trainer_state.json").write_text(json.dumps(
            {"version": self.version, "ref_model_path": str(Path(self.ref_path).resolve()), **extra_state}, indent=1))

    def load_adapter_weights(self, folder: str | Path) -> None:
        """The adapter weights of a peft folder into this trainer's adapters; a checkpoint's (`save`)
        also holds the --lora-trainable-modules, a sync folder's (`save_adapter`) does not: those keep
        their weights."""
        from peft import get_peft_model_state_dict, set_peft_model_state_dict
        from safetensors.torch import load_file

        adapter = load_file(str(Path(folder) / "adapter_model.safetensors"), device=str(self.device))
        adapter = {**{k: v for k, v in get_peft_model_state_dict(self.model).items() if ".lora_" not in k}, **adapter}
        result = set_peft_model_state_dict(self.model, adapter)
        if result.unexpected_keys:
            raise ValueError(f"{folder}: adapter weights this model has no place for: {result.unexpected_keys[:5]}")

    def _base_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """With LoRA: the frozen base weights in HF names (no adapter)."""
        for name, param in self.model.get_base_model().named_parameters():
            if ".lora_" not in name and TRAINED not in name:
                yield name.replace(".base_layer.", ".").replace(ORIGINAL, "."), param.detach()

    def update_reference(self) -> None:
        """--ref-update-interval: the KL reference takes the policy's current weights (LoRA: merged)."""
        copy_parameters(self.ref_model, self._merged_tensors(), "--ref-update-interval")

    def load(self, folder: Path) -> dict:
        if self.lora:
            if not (folder / "adapter").is_dir():
                raise FileNotFoundError(f"{folder}: no adapter/ (a checkpoint without --lora-rank cannot resume "
                                        "a LoRA run)")
            self.load_adapter_weights(folder / "adapter")
        else:
            fresh = load_model(folder / "model", device=self.device)
            self.model.load_state_dict(fresh.state_dict())
        optim = not self.train_cfg.no_save_optim  # slime: --no-save-optim implies --no-load-optim
        if optim and not (folder / "optimizer.pt").exists():
            raise ConfigError(f"--load {folder}: saved with --no-save-optim (no optimizer.pt); resume with "
                              "--no-save-optim to start the optimizer afresh")
        if optim:
            self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
        if self.critic is not None and (folder / "critic.pt").exists():
            critic = torch.load(folder / "critic.pt", weights_only=False)
            self.critic.load_state_dict(critic["model"])
            if optim:
                self.critic_optimizer.load_state_dict(critic["optimizer"])
        set_rng_state(torch.load(folder / "rng.pt", weights_only=False), self.device)
        state = json.loads((folder / "trainer_state.json").read_text())
        self.version = state["version"]
        self.rollouts_trained = state.get("rollout_id", 0)  # --ref-update-interval counts from here, as slime
        ref = state.get("ref_model_path")
        if (self.ref_model is not None and not self.ref_given and ref and Path(ref).exists()
                and Path(ref).resolve() != Path(self.ref_path).resolve()):
            # resumed from the checkpoint's copy: the KL reference stays the run's initial model
            self.ref_model.load_state_dict(load_model(ref, device=self.device).state_dict())
            self.ref_path = ref
        return state


# peft's names in a --lora-trainable-modules module (ModulesToSaveWrapper): the frozen original
# and the trained copy; both stand for the one HF weight without them
ORIGINAL, TRAINED = ".original_module.", ".modules_to_save.default."


def wrap_lora(model, train: TrainConfig):
    """The HF model with peft LoRA adapters on --target-modules (base weights frozen) and the
    --lora-trainable-modules trained whole (peft's modules_to_save; a tied embedding stays tied
    to the LM head)."""
    from peft import LoraConfig, get_peft_model

    from agentrl.config import lora_target_modules, lora_trainable_modules

    whole = lora_trainable_modules(train.lora_trainable_modules)
    config = LoraConfig(r=train.lora_rank, lora_alpha=train.lora_alpha, lora_dropout=train.lora_dropout,
                        target_modules=lora_target_modules(train.target_modules), bias="none", task_type="CAUSAL_LM",
                        modules_to_save=whole or None, ensure_weight_tying=bool(whole))
    model = get_peft_model(model, config)
    trained = [n.removesuffix(".modules_to_save") for n, _ in model.named_modules() if n.endswith(".modules_to_save")]
    missing = [w for w in whole if not any(t == w or t.endswith("." + w) for t in trained)]
    if missing:  # peft skips a name that matches nothing
        raise ValueError(f"--lora-trainable-modules: the model has no module {missing} (e.g. model.norm, lm_head)")
    return model


class ValueModel(torch.nn.Module):
    """PPO's critic: a causal LM's backbone (its decoder, without the LM head) and a scalar head."""

    def __init__(self, causal_lm):
        super().__init__()
        self.backbone = causal_lm.model
        hidden = causal_lm.config.hidden_size
        param = next(causal_lm.parameters())
        self.value_head = torch.nn.Linear(hidden, 1, bias=False, dtype=param.dtype, device=param.device)
        torch.nn.init.normal_(self.value_head.weight, std=1.0 / (hidden + 1) ** 0.5)

    def forward(self, input_ids, attention_mask):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()  # [B, L]


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _padded(rows: list[list[float]], shape, device) -> torch.Tensor:
    out = torch.zeros(shape, device=device)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row)
    return out
