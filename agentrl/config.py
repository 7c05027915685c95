"""Typed configuration: a tree of pydantic models, one per component.

Every field is also a command-line flag named after it with dashes (slime's names:
``rollout_batch_size`` -> ``--rollout-batch-size``), plus a few aliases (``--model``).
Layers, later wins: field defaults < the env's ``default_config`` < the YAML file
(``--config``, keys flat or nested by section) < flags. Arguments the trainer does not own
pass through: ``--sglang-*`` to SGLang servers, ``--router-*`` to sglang-router.
The config is frozen once resolved; `resolve()` is the one place values are derived.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.errors import ConfigError


class Section(BaseModel):
    # a field's docstring is its description: what `--help` prints for its flag
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ModelConfig(Section):
    """The policy model: which checkpoint, on which device, in which dtype."""

    model: str | None = None
    """Local HF causal-LM checkpoint folder; None builds the tiny default model offline."""
    device: str = "auto"
    """cpu, cuda, or auto (cuda when available)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Training and embedded-engine dtype."""


class DataConfig(Section):
    """Where prompts (or SFT conversations) come from and which row keys hold what."""

    prompt_data: str | None = None
    """JSONL or parquet file of prompts; None uses the env's own dataset or task generator."""
    input_key: str = "prompt"
    """Row key of the prompt (a string or a list of chat messages)."""
    label_key: str = "label"
    """Row key of the label the reward is computed against."""
    metadata_key: str = "metadata"
    """Row key of a dict passed to the env as task metadata."""
    apply_chat_template: bool = True
    """Render prompts and turns with the tokenizer's chat template (else plain concatenation)."""
    apply_chat_template_kwargs: dict[str, Any] = {}
    """slime's: extra variables of the chat template, a JSON object such as '{"enable_thinking": false}',
    given to every rendering (each turn's prompt too, not only the first)."""
    multimodal_keys: dict[str, str] = {}
    """slime's: a vision-language model's media, a JSON object of media type to row key, such as
    '{"image": "images"}' (the row's `images` list: file paths, bytes, HF datasets image dicts or data
    URLs). Each image takes the place of the next <image> in the prompt; the model's processor turns
    them into prompt tokens and pixel values (agentrl/vision.py). Images only; either trainer (Megatron:
    Qwen2-VL / Qwen2.5-VL at pipeline and context parallel size 1)."""
    rollout_shuffle: bool = True
    """Shuffle the dataset each epoch (seeded)."""
    tool_key: str = "tools"
    """`agentrl sft`: row key of the tool JSON schemas given to the chat template (RL envs list their own tools)."""
    num_epoch: int = Field(1, ge=1)
    """`agentrl sft`: passes over --prompt-data (RL runs count iterations with --num-rollout)."""
    difficulty_window: int | None = Field(None, ge=1)
    """Difficulty-aware sampling: skip a prompt whose last N groups each gave all their samples one
    reward (always or never solved: no signal), revisiting it with --difficulty-revisit-prob; None: off."""
    difficulty_revisit_prob: float = Field(0.1, ge=0, le=1)
    """Chance that a prompt skipped by --difficulty-window is sampled anyway."""


class RolloutConfig(Section):
    """Generation: batch sizes, sampling, multi-turn limits, failures, async and the engines that serve it."""

    num_rollout: int = Field(50, ge=1)
    """Number of iterations (rollout + training step + weight sync)."""
    rollout_batch_size: int = Field(16, ge=1)
    """Prompts per iteration."""
    n_samples_per_prompt: int = Field(8, ge=1)
    """Trajectories per prompt (the GRPO group size)."""
    rollout_max_response_len: int = Field(16, ge=1)
    """Token budget of a trajectory's response (all turns, policy and env tokens)."""
    rollout_max_tokens_per_turn: int | None = Field(None, ge=1)
    """Cap on the tokens of one assistant turn; None: the remaining response budget."""
    rollout_max_context_len: int | None = Field(None, ge=2)
    """Cap on prompt + response tokens of a trajectory (slime's; a prompt filling it ends truncated,
    untrained); None: only --rollout-max-response-len."""
    rollout_stop_token_ids: list[int] = []
    """Token ids that end a turn, besides the tokenizer's EOS (slime's)."""
    rollout_max_prompt_len: int | None = Field(None, ge=1)
    """slime's: --prompt-data rows whose prompt, rendered by the chat template (the row's messages alone,
    with the generation prompt), is longer than this many tokens are left out when the data is loaded."""
    rollout_temperature: float = Field(1.0, ge=0)
    """Sampling temperature of rollouts (the trainer's log-probs use it too)."""
    rollout_top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches p (1: all)."""
    rollout_top_k: int = -1
    """Sample among the k most likely tokens (-1: all)."""
    rollout_skip_special_tokens: bool = False
    """slime's: the text of each assistant turn that the env (and so the reward) reads is decoded without
    special tokens; the trained tokens and the conversation the template renders keep them."""
    rollout_ignore_eos: bool = False
    """Generate every response to the length limit, past EOS (SGLang's ignore_eos): a fixed
    workload for benchmarks and memory tests."""
    max_turns: int | None = Field(None, ge=1)
    """Turn limit; None uses the env's own max_turns."""
    max_concurrency: int = Field(256, ge=1)
    """Trajectories in flight at once."""
    over_sampling_batch_size: int | None = Field(None, ge=1)
    """Groups kept in flight while a batch fills (>= rollout_batch_size); None: rollout_batch_size."""
    dynamic_sampling_filter_path: str | None = None
    """Drop finished groups: "nonzero_std" (built-in: zero reward std carries no signal), or
    "module.fn" / "file.py:fn" with fn(args, samples) -> bool | (bool, reason)."""
    custom_generate_function_path: str | None = None
    """slime's `async def generate(args, sample, sampling_params) -> Sample | list[Sample]` ("module.fn" or
    "file.py:fn"), run for each sample of a group in place of the agent loop (see docs/slime.md)."""
    rollout_function_path: str | None = None
    """slime's `generate_rollout(args, rollout_id, data_source, evaluation=False) -> list[list[Sample]]`,
    filling each training batch in place of agentrl's producer (see docs/slime.md)."""
    max_group_retries: int = Field(2, ge=0)
    """A group with an infrastructure failure is re-run whole this many times, then dropped."""
    max_failed_groups: int | None = Field(8, ge=1)
    """Stop the run, naming the first failure, when this many groups in a row are dropped as
    failed (after their retries) with no useful group between them; None: never stop."""
    async_rollout: bool = False
    """--async: generate the next batch while the current one trains (one step off-policy)."""
    max_staleness: int | None = Field(None, ge=0)
    """Drop samples whose oldest token is more than K policy versions behind the trainer."""
    partial_rollout: bool = False
    """At a weight update, abort in-flight generations and resume them under the new weights."""
    mask_offpolicy_in_partial_rollout: bool = False
    """With --partial-rollout: train only on tokens sampled by the newest policy of each sample."""
    rollout_engine: Literal["embedded", "sglang"] = "embedded"
    """Which engine serves generation: the embedded HF engine (CPU, tests) or SGLang servers
    (GPU; every SGLang server argument passes through as --sglang-ARG)."""
    rollout_engine_urls: list[str] = []
    """Attach to engines already running at these URLs instead of launching any (repeatable or comma-separated)."""
    num_engines: int | None = Field(None, ge=1)
    """Engines to launch; None: one embedded engine, or rollout_num_gpus / rollout_num_gpus_per_engine SGLang ones."""
    rollout_num_gpus: int | None = Field(None, ge=1)
    """GPUs the SGLang engines use; None: every visible GPU. More engines than GPUs share them."""
    rollout_num_gpus_per_engine: int = Field(1, ge=1)
    """GPUs of one SGLang engine (its --tp-size)."""
    prefill_num_servers: int | None = Field(None, ge=1)
    """slime's prefill/decode disaggregation: the first N SGLang engines prefill, the rest decode, the
    router pairs them (sglang-router --pd-disaggregation); None: every engine does both."""
    prefill_sglang_args: dict[str, Any] = {}
    """With --prefill-num-servers: SGLang arguments of the prefill engines only, over --sglang-*
    (names without the --, e.g. {"chunked-prefill-size": 8192}; null: a bare switch, false: dropped)."""
    decode_sglang_args: dict[str, Any] = {}
    """With --prefill-num-servers: SGLang arguments of the decode engines only, over --sglang-* (as
    --prefill-sglang-args)."""
    engine_model_name: str = "default"
    """The name slime hooks find the engines under (args.sglang_model_routers, its get_model_url):
    --sglang-config's model name."""
    use_router: Literal["auto", "always", "never"] = "auto"
    """sglang-router in front of the engines (--router-* flags pass through); auto: with two or more engines."""
    engine_startup_timeout_s: float = Field(900.0, gt=0)
    """How long an engine (or the router) may take to become healthy."""
    engine_restart: bool = True
    """Restart engines this run launched when they die; they rejoin the router once they hold the current weights."""
    engine_num_threads: int = Field(0, ge=0)
    """CPU threads of the embedded engine process (0: torch's default)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Timeout of one /generate call."""


class AlgoConfig(Section):
    """The RL algorithm: advantage estimator, policy-loss clipping, KL and entropy terms, importance weights, reward."""

    advantage_estimator: Literal["grpo", "dr_grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus",
                                 "reinforce_plus_plus_baseline", "ppo"] = "grpo"
    """grpo, dr_grpo (no std normalization), gspo (sequence-level ratio; use small clips such as
    --eps-clip 3e-4 --eps-clip-high 4e-4), cispo (grpo's advantages, MiniMax-M1's loss: the ratio clipped
    to [1 - eps_clip, 1 + eps_clip_high] as a detached weight on -A * logprob; canonical: --eps-clip 1
    --eps-clip-high 4), rloo, reinforce_plus_plus(_baseline), ppo (critic + GAE)."""
    disable_rewards_normalization: bool = False
    """slime's: the group estimators (grpo, dr_grpo, gspo, cispo, rloo, reinforce_plus_plus_baseline) take
    each sample's raw reward as its advantage, with no group mean subtracted and no std division."""
    normalize_advantages: bool = False
    """slime's: whiten the final advantages (after --use-opd's term) over the rollout's trained tokens:
    (A - mean) / sqrt(var + 1e-8), var Bessel-corrected (reinforce_plus_plus(_baseline) and ppo always whiten)."""
    eps_clip: float = Field(0.2, ge=0)
    """PPO clip range (low side, and high side unless eps_clip_high is set)."""
    eps_clip_high: float | None = Field(None, ge=0)
    """PPO clip range on the high side; None: --eps-clip."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual-clip PPO: bound the loss of negative-advantage tokens at c times the advantage; None: off."""
    use_kl_loss: bool = False
    """Add a KL(pi || pi_ref) loss against the initial model."""
    kl_loss_coef: float = Field(0.0, ge=0)
    """Weight of the KL loss (--use-kl-loss)."""
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    """KL estimator of the KL loss."""
    ref_update_interval: int | None = Field(None, ge=1)
    """slime's: every N rollouts (after rollout k's training, when (k + 1) % N == 0) the KL reference
    becomes the current policy; needs a reference in use (--use-kl-loss with --kl-loss-coef > 0, or --kl-coef)."""
    use_unbiased_kl: bool = False
    """slime's (DeepSeek-V3.2): each token's KL-loss estimate is multiplied by pi / pi_old (the policy
    loss's ratio, gradient through it), unbiased for tokens sampled from pi_old; needs --use-kl-loss."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus in the policy loss (0: none)."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty in the reward, per trained token, against the initial model (token-level
    estimators: reinforce_plus_plus(_baseline), ppo)."""
    kl_reward_type: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator of the reward penalty (--kl-coef)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount over trained tokens (reinforce_plus_plus, ppo)."""
    lambd: float = Field(1.0, ge=0, le=1)
    """GAE lambda (ppo)."""
    value_clip: float = Field(0.2, ge=0)
    """PPO value-loss clip range around the old values (0 disables)."""
    critic_lr: float | None = Field(None, gt=0)
    """Critic learning rate (ppo); default: the policy's --lr."""
    use_tis: bool = False
    """Correct the rollout/training mismatch with importance weights pi_old(train) / pi(rollout)."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """truncate (TIS): clamp the weights to [--tis-clip-low, --tis-clip]; mask (MIS): drop from the loss the
    tokens (or, at sequence level, the sequences) whose ratio is outside."""
    tis_level: Literal["token", "sequence", "geometric"] = "token"
    """The --use-tis ratio: token (each token's), sequence (the product over the sequence's trained tokens) or
    geometric (their geometric mean; use tight bounds such as --tis-clip-low 0.999 --tis-clip 1.001)."""
    tis_clip: float = Field(2.0, gt=0)
    """Upper bound of the --use-tis importance weights."""
    tis_clip_low: float = Field(0.0, ge=0)
    """Lower bound of the --use-tis importance weights."""
    custom_tis_function_path: str | None = None
    """--use-tis: slime's importance-weight function (e.g. its mis.py example's compute_mis_weights_with_cp)
    in place of --tis-mode/--tis-level's; it reads its bounds from --custom-config-path's keys."""
    rs_veto_threshold: float | None = Field(None, gt=0, lt=1)
    """--use-tis: a trajectory with any trained token whose own ratio pi_old(train) / pi(rollout) is below this
    leaves the loss whole (slime's veto of catastrophic mismatches, e.g. 1e-4), whatever --tis-mode and
    --tis-level; None: off."""
    use_rollout_logprobs: bool = False
    """The engine's logprobs of the sampled tokens are the old policy's (slime's): no old-logprob pass,
    the ratio is pi_train / pi_rollout; excludes --use-tis."""
    recompute_old_logprobs: bool = False
    """Always run the separate old-policy logprob pass before the optimizer steps. Without it the pass
    is skipped when the rollout is one optimizer step (--global-batch-size >= its samples) and nothing
    needs the old logprobs before it (no --kl-coef, --use-opd, critic or dropout): the training forward's
    own logprobs, detached, are the old policy's (ratio 1, the same gradient), as slime and verl do."""
    use_opd: bool = False
    """On-policy distillation: each trained token's advantage loses --opd-kl-coef x (student logprob -
    teacher logprob), the per-token reverse KL to the teacher (--opd-teacher-load), on top of any
    estimator (with a constant reward, distillation alone)."""
    opd_type: Literal["megatron", "torch", "sglang"] | None = None
    """Where the teacher runs: beside the policy in the trainer ("megatron", slime's name, also for the
    PyTorch trainer; "torch" is its alias), or "sglang" (slime's name): an engine group of its own serving
    --opd-teacher-load (SGLang with --rollout-engine sglang, else embedded) or the server at
    --opd-teacher-url, scoring the sampled tokens by prefill before each step. None with --use-opd: the trainer's."""
    opd_kl_coef: float = Field(1.0, ge=0)
    """Weight of the reverse-KL penalty of --use-opd."""
    opd_teacher_load: str | None = None
    """The teacher's HF checkpoint (same architecture and tokenizer as the policy)."""
    opd_teacher_url: str | None = None
    """--opd-type sglang: a teacher already serving SGLang's /generate at this URL (nothing is launched)."""
    judge_url: str | None = None
    """LLM judge reward (--rm-type llm-judge, or --custom-rm-path agentrl.judge:llm_judge): base URL of an
    OpenAI-compatible endpoint serving the judge, e.g. http://host:30000/v1."""
    judge_load: str | None = None
    """LLM judge reward: the judge's HF checkpoint, served by an engine group of its own that the run starts
    (SGLang with --rollout-engine sglang, else embedded); instead of --judge-url."""
    judge_model: str = "default"
    """The judge's model name in its requests."""
    judge_rubric: str = "Score how correct and complete the answer is for the question."
    """The judge's rubric: its text, or a file holding it."""
    judge_max_score: int = Field(10, ge=1)
    """The judge scores 0..N; the reward is score / N."""
    judge_timeout_s: float = Field(60.0, gt=0)
    """A judge request not answered in this time fails its trajectory (an infrastructure failure)."""
    judge_max_concurrency: int = Field(16, ge=1)
    """Judge requests in flight at once."""
    overlong_buffer_len: int | None = Field(None, ge=1)
    """DAPO's overlong reward shaping: a response longer than --overlong-max-len minus this many
    tokens loses reward linearly, --overlong-penalty-factor at --overlong-max-len and past it; None: off."""
    overlong_max_len: int | None = Field(None, ge=1)
    """Where the overlong buffer ends; None: --rollout-max-response-len."""
    overlong_penalty_factor: float = Field(1.0, ge=0)
    """Reward lost at --overlong-max-len (--overlong-buffer-len)."""
    custom_rm_path: str | None = None
    """Reward function overriding the env's: "module.fn" or "file.py:fn" with slime's signature
    `async def rm(args, sample) -> float | dict` (args is the resolved Config)."""
    custom_rm_timeout: float = Field(60.0, gt=0)
    """Seconds one call of the --custom-rm-path function may take; past it the sample scores 0
    with the reason in metadata["agent_fault"] (a reward function reads the model's output)."""
    rm_type: str | None = None
    """slime's rule-based reward (agentrl/rm_hub): deepscaler, dapo, math, f1, gpqa, ifbench, remote_rm, random,
    or boxed_X (X on the last \\boxed{} answer); a row's metadata rm_type overrides it; --custom-rm-path wins."""
    rm_url: str | None = None
    """--rm-type remote_rm: the URL POSTed {prompt, response, label}, answering the reward as JSON."""
    custom_reward_post_process_path: str | None = None
    """slime's `fn(args, samples) -> (raw_rewards, rewards)` replacing the group normalisation: its
    rewards are the group estimators' advantages and the token-level estimators' final rewards."""
    custom_config_path: str | None = None
    """slime's YAML of extra arguments: its keys set config fields and slime flags (overriding the
    command line); other keys reach slime's hooks as args attributes."""
    reward_key: str | None = None
    """A dict reward's key the advantage uses (slime's --reward-key); None: its "score"."""


class TrainConfig(Section):
    """The trainer: loss, backend, batch sizes, optimizer, weight sync to the engines, LoRA."""

    loss_type: Literal["policy_loss", "sft_loss"] = "policy_loss"
    """policy_loss: RL on env rollouts; sft_loss: supervised fine-tuning on the assistant turns of chat
    data (what `agentrl sft` runs; `agentrl train --loss-type sft_loss` runs it too, as in slime)."""
    trainer: Literal["torch", "megatron"] = "torch"
    """torch: the HF model in plain PyTorch; megatron: megatron-core with TP/PP/SP (Megatron flags pass through)."""
    global_batch_size: int = Field(32, ge=1)
    """Samples per optimizer step."""
    num_steps_per_rollout: int | None = Field(None, ge=1)
    """Optimizer steps per iteration; derived from the batch sizes when not given."""
    micro_batch_size: int = Field(32, ge=1)
    """Samples per forward/backward (gradient accumulation within a global batch)."""
    lr: float | None = Field(None, gt=0)
    """Learning rate; default 3e-3 for the built-in tiny model, 1e-6 for a --model checkpoint (1e-5 for SFT),
    times 10 with --lora-rank when only adapters train (LoRA's adapters learn at about 10x full
    fine-tuning's rate); with --lora-trainable-modules (the tiny model's default) the full rate: at
    3e-2 the tiny model's embeddings collapse the policy onto one word."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """Adam's beta1 (first-moment decay)."""
    adam_beta2: float = 0.999
    """Adam's beta2 (second-moment decay)."""
    clip_grad: float = Field(1.0, ge=0)
    """Gradient-norm clip (0 disables)."""
    weight_sync_bucket_mb: float = Field(512.0, gt=0)
    """Size of one weight-sync bucket sent to the engine. Each bucket costs a few ms of fixed
    overhead: 1.5B into SGLang on an H200 took 0.23 s with 64 MB buckets, 0.06 s with 1 GB
    (bench/results/weight_sync.md)."""
    weight_sync_mode: Literal["auto", "tensor", "distributed", "disk", "delta"] = "auto"
    """How new weights reach the engines: `tensor` (POST the tensors; CUDA IPC handles for SGLang,
    so the engine must share the trainer's GPUs: colocated), `distributed` (a process group with
    the engines: NCCL broadcast to SGLang on other GPUs, gloo to CPU engines), `disk` (an HF
    checkpoint every engine loads), `delta` (only the bytes changed since the last sync, through
    a shared folder, applied to a full checkpoint on each engine host that the engines then load:
    engines far from the trainer, not colocated; agentrl/weight_delta.py). `auto`: distributed for
    SGLang engines on GPUs of their own, else tensor."""
    weight_sync_dir: str | None = None
    """--weight-sync-mode disk and delta: the folder the trainer writes the weights to and the engines
    read them from (shared by every engine host for delta); default <output-dir>/weight_sync
    (disk) or <output-dir>/weight_delta (delta). slime's --update-weight-disk-dir."""
    weight_sync_local_dir: str | None = None
    """--weight-sync-mode delta: a folder on each engine host (the same path on every host; fast local
    disk) holding a full HF checkpoint, copied from the engines' model path on first use, that the
    deltas are applied to and the engines load; engines of one host share it. Default
    <output-dir>/weight_delta_local. slime's --update-weight-local-checkpoint-dir."""
    weight_delta_encoding: Literal["xor", "overwrite"] = "xor"
    """--weight-sync-mode delta: xor (new ^ old bytes: smallest, must be applied exactly once on its base,
    which the engine's version record ensures) or overwrite (changed positions and their new bytes:
    larger, applying it again changes nothing). slime's --update-weight-delta-encoding."""
    weight_delta_checksum: Literal["xxh3-128", "blake3", "adler32"] = "xxh3-128"
    """--weight-sync-mode delta: the checksum of each tensor's new bytes, verified by the engine host after
    applying (xxh3-128 needs the `xxhash` package, blake3 `blake3`). slime's --update-weight-delta-checksum."""
    weight_delta_keep_versions: int = Field(4, ge=1)
    """--weight-sync-mode delta: versions kept in --weight-sync-dir (older ones are deleted); an engine
    host whose local checkpoint is further behind cannot catch up and is refused, naming the versions."""
    update_weight_buffer_size: int | None = Field(None, ge=1)
    """slime's name for the weight-sync bucket, in bytes; when given it overrides --weight-sync-bucket-mb."""
    weight_check_interval: int = Field(5, ge=0)
    """Check the engines hold the trainer's weights after the first weight sync and every Nth one
    after: each engine samples a few tokens after two probe prompts and the trainer recomputes
    their logprobs (metrics weight_check/*); 0: never."""
    weight_check_max_diff: float = Field(0.25, gt=0)
    """The run fails when an engine's mean |logprob difference| on the probe exceeds this (bf16
    engines and trainers differ by ~0.01; wrong weights by whole nats)."""
    max_tokens_per_gpu: int | None = Field(None, ge=1)
    """Form micro-batches by a token budget instead of --micro-batch-size: Megatron packs sequences
    up to it; the PyTorch trainer takes as many samples as fit it padded (count x longest)."""
    balance_data: bool = False
    """slime's --balance-data: split each global batch across data-parallel ranks by the
    Karmarkar-Karp partition of estimated FLOPs (agentrl/balance.py: linear in the length plus
    attention's square) rather than the default greedy longest-first split by tokens; the loss
    is the same either way. One data-parallel rank: no effect. Megatron trainer."""
    balance_by_flops: bool = False
    """slime's --balance-by-flops (implies --balance-data; needs --max-tokens-per-gpu): each
    rank's micro-batches are as many as the token budget needs, balanced by estimated FLOPs
    instead of packed first-fit up to the budget, so a micro-batch may pass the budget (more
    memory). Megatron trainer."""
    save_hf: str | None = None
    """Megatron: also write an HF checkpoint here at every save ({rollout_id} is filled in)."""
    no_save_optim: bool = False
    """slime's: checkpoints hold no optimizer state (smaller); --load then starts the optimizer afresh
    (slime's --no-load-optim follows it), so the resume is not exact."""
    lora_rank: int = Field(0, ge=0)
    """LoRA adapter rank; 0 trains every weight. With a rank the base weights are frozen (no grads, no
    optimizer state) and only the adapters train (PyTorch: peft; Megatron: adapters on its parallel linears)."""
    lora_alpha: float = Field(16.0, gt=0)
    """LoRA scale numerator: the adapter's output is multiplied by lora_alpha / lora_rank."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training."""
    target_modules: list[str] = ["all-linear"]
    """Linear layers that get adapters, by peft's names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj, or all-linear (every one of them; never the LM head) [repeatable or comma-separated]."""
    lora_trainable_modules: list[str] = ["auto"]
    """With --lora-rank, whole modules trained beside the adapters (peft's modules_to_save), by the
    end of their HF name, at --lr. auto: on the built-in tiny model its tied embeddings and final
    norm, embed_tokens,model.norm: they cap every logit near 2.6 (embeddings of std 0.02 through the
    norm), which adapters on the linears cannot lift, so LoRA alone does not learn there
    (docs/benchmarks.md); on a --model checkpoint none (its logits are not capped, and whole
    embeddings would be most of an adapter sync). `none`: adapters only. The Megatron trainer takes
    the same HF names; a module it fuses with others (q_proj into linear_qkv) is trained only with
    all of them. With --lora-sync adapter these tensors reach the engines by the full-weight path in
    the same sync (SGLang's adapters carry only lora_A/lora_B) [repeatable or comma-separated]."""
    use_pytorch_profiler: bool = False
    """Profile the train steps from --profile-step-start to before --profile-step-end with torch.profiler
    on every trainer rank: a Chrome trace and a table of operators by self time per step, in --profile-dir
    (agentrl/profiling.py)."""
    profile_step_start: int = Field(10, ge=0)
    """First profiled train step, counted from 0 in this process (slime's and Megatron's default: 10)."""
    profile_step_end: int = Field(12, ge=1)
    """The train step after the last profiled one."""
    profile_target: list[Literal["train_overall", "train_actor", "train_log_probs"]] = ["train_overall"]
    """What --use-pytorch-profiler records: train_overall (the whole iteration, its phases labelled),
    train_log_probs (the logprob passes), train_actor (the optimizer steps)."""
    profile_dir: str | None = None
    """Where --use-pytorch-profiler writes; default <output-dir>/profile."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """How LoRA weights reach the engines: merged (W + B A in the base weights' names, through
    --weight-sync-mode: any engine) or adapter (only the adapter, a peft folder loaded with
    /load_lora_adapter; each request names the current version)."""


class RunConfig(Section):
    """The run: env, tools and sandboxes, folders, checkpoints, cluster and placement, debug modes, logging."""

    env: str = "target-token"
    """Registered env name (see `agentrl envs list`)."""
    env_module: list[str] = []
    """Modules or .py files to import before the env is looked up (repeatable)."""
    env_kwargs: dict[str, Any] = {}
    """Keyword arguments for the env's constructor (JSON on the command line)."""
    sandbox: Literal["docker", "local", "auto"] | None = None
    """Sandbox backend for envs with tools; one bounded, warm pool serves the run. None: the env's own choice
    of backend (its `sandbox` argument), still through one bounded pool."""
    sandbox_max_active: int | None = Field(None, ge=1)
    """Sandboxes alive at once (the pool's bound, so the Docker daemon is never flooded); None: sized to the
    machine and backend (docker: 2 per core, local: 4 per core, within half the RAM; 2 to 64)."""
    mcp_server: list[str] = []
    """External MCP servers for envs with tools: NAME=COMMAND ARGS... or NAME=URL (repeatable)."""
    output_dir: str | None = None
    """Run folder; default runs/<env>-<timestamp>."""
    save: str | None = None
    """Checkpoint folder; default <output_dir>/checkpoints."""
    save_interval: int | None = Field(None, ge=1)
    """Save every N iterations (and at the end); None: only at the end."""
    load: str | None = None
    """Resume from this checkpoint folder (latest iteration inside it); as in slime, a folder with no
    checkpoint yet starts from the reference, and an HF checkpoint folder is the model to start from."""
    start_rollout_id: int | None = Field(None, ge=0)
    """slime's: the first iteration's rollout id (the run goes on to --num-rollout), over the one --load
    restores; None: --load's, or 0. Weights, optimizer and data position still come from --load."""
    ref_load: str | None = None
    """slime's reference checkpoint, the KL reference (--use-kl-loss, --kl-coef): an HF folder (either trainer)
    or a Megatron distributed checkpoint (slime's torch_dist, an agentrl checkpoint; Megatron trainer). As in
    slime, an HF folder is also the model to start from when --load holds no checkpoint."""
    ray_address: str | None = None
    """Join a Ray cluster (HOST:PORT, started with `ray start --head`); None: start Ray locally."""
    ray_trainer_resource: str | None = None
    """A custom Ray resource the trainer's bundles ask for (a sliver of it): the trainer goes to
    the nodes started with it (`ray start --resources '{"NAME": 1000}'`); see docs/cluster.md."""
    ray_engine_resource: str | None = None
    """A custom Ray resource the engines' bundles ask for: the engines go to the nodes that have it."""
    colocate: bool = False
    """Trainer and engines time-share the same GPUs (engine memory released during training,
    trainer offloaded during rollout); without it they get disjoint GPUs."""
    colocate_offload: Literal["fit", "all"] = "fit"
    """--colocate with SGLang: `fit` keeps the trainer's state on the GPU during rollout as far
    as it fits beside what the engines take back (--sglang-mem-fraction-static of the GPU) and a
    headroom, and moves only the rest to host memory; `all` moves everything every rollout."""
    actor_num_nodes: int = Field(1, ge=1)
    """Nodes for the trainer."""
    actor_num_gpus_per_node: int = Field(1, ge=1)
    """GPUs per trainer node (used when the device is cuda)."""
    debug_rollout_only: bool = False
    """Generate and save rollouts; no training, the weights never change."""
    debug_train_only: bool = False
    """Train on saved rollouts (--load-debug-rollout-data) without any engine."""
    load_debug_rollout_data: str | None = None
    """A run folder (or its trajectories/ folder) whose saved rollouts --debug-train-only replays."""
    seed: int = 1234
    """Seed of the data order, the env episodes, sampling and model init. Each trajectory's
    requests carry a sampling_seed derived from it, so on the embedded engine (and on SGLang with
    --sglang-enable-deterministic-inference) a seed gives the same tokens however requests are batched."""
    progress: bool = True
    """Show the live progress display."""
    use_wandb: bool = False
    """Also log metrics to Weights & Biases (tensorboard/ is always written)."""
    wandb_project: str = "agentrl"
    """Weights & Biases project (--use-wandb)."""
    wandb_group: str | None = None
    """Weights & Biases run group (--use-wandb)."""
    wandb_mode: Literal["offline", "online", "disabled"] | None = None
    """None: online when WANDB_API_KEY is set, else offline (no network; `wandb sync DIR` uploads later)."""
    wandb_dir: str | None = None
    """wandb writes its run files under DIR/wandb/; default: the run folder (so <output_dir>/wandb/)."""


class EvalConfig(Section):
    """Evaluation during training (and for `agentrl eval`): eval sets, interval, sampling."""

    eval_interval: int | None = Field(None, ge=1)
    """Evaluate every N iterations (and after the last); None: no evaluation."""
    eval_prompt_data: list[str] = []
    """NAME PATH pairs (--eval-prompt-data aime aime.jsonl math500 m.jsonl); rows may name their env."""
    n_samples_per_eval_prompt: int = Field(1, ge=1)
    """Samples per eval prompt (pass@k is reported for k = this)."""
    eval_temperature: float | None = Field(None, ge=0)
    """None: the rollout temperature."""
    eval_max_response_len: int | None = Field(None, ge=1)
    """None: the rollout's."""
    eval_top_p: float | None = Field(None, gt=0, le=1)
    """None: the rollout's top-p."""
    eval_top_k: int | None = None
    """None: the rollout's top-k (-1: off)."""
    skip_eval_before_train: bool = False
    """With --eval-interval, the starting model is evaluated before the first iteration (as slime
    does; its figures go in iteration 0's metrics row as eval_before_train/NAME/...): this skips it."""
    eval_config: str | None = None
    """slime's YAML of eval sets (`eval: {defaults: {...}, datasets: [{name, path, ...}]}`), in place of
    --eval-prompt-data; per set: rm_type, n_samples_per_eval_prompt, input/label/metadata keys."""


SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig,
    "algo": AlgoConfig, "train": TrainConfig, "run": RunConfig, "eval": EvalConfig,
}
PAIRED_LISTS = {"eval_prompt_data"}  # flags taking several values at once (slime's NAME PATH pairs)
# what the renderer gives apply_chat_template itself: not --apply-chat-template-kwargs' to set
TEMPLATE_CALL_ARGS = {"conversation", "messages", "tools", "documents", "tokenize", "add_generation_prompt",
                      "continue_final_message", "return_dict", "chat_template"}
ALIASES = {"--hf-checkpoint": "model", "--model-path": "model", "--async": "async_rollout"}


class Config(Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    train: TrainConfig = TrainConfig()
    run: RunConfig = RunConfig()
    eval: EvalConfig = EvalConfig()
    sglang_args: dict[str, str | None] = {}
    """--sglang-* flags, passed to SGLang servers without the prefix."""
    router_args: dict[str, str | None] = {}
    """--router-* flags, passed to sglang-router without the prefix."""
    megatron_args: dict[str, Any] = {}
    """Megatron's own flags (--tensor-model-parallel-size, --sequence-parallel, --recompute-*, ...),
    by name without dashes, for the Megatron trainer."""

    @property
    def steps_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt // self.train.global_batch_size

    def dump(self, path: Path) -> None:
        path.write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))


def _field_index() -> dict[str, str]:
    """field name -> section; field names are unique across sections."""
    index: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for name in cls.model_fields:
            assert name not in index, f"config field {name} appears in two sections"
            index[name] = section
    return index


FIELDS = _field_index()


def _flat_to_nested(flat: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    nested: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for key, value in flat.items():
        name = key.replace("-", "_")
        if name in SECTIONS and isinstance(value, dict):
            for k, v in value.items():
                k = k.replace("-", "_")
                if k not in SECTIONS[name].model_fields:
                    raise ConfigError(f"{where}: unknown key {name}.{k}")
                nested[name][k] = v
        elif name in FIELDS:
            nested[FIELDS[name]][name] = value
        elif name in ("sglang_args", "router_args", "megatron_args"):
            nested.setdefault(name, {}).update(value)
        else:
            raise ConfigError(f"{where}: unknown key {key!r}")
    return nested


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) and k in SECTIONS else v
    return out


def load_yaml(path: str) -> dict[str, dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ConfigError(f"{where}: malformed YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys")
    return _flat_to_nested(data, path)


PASSTHROUGH_HELP = ("Arguments the trainer does not own pass through: --sglang-ARG to the SGLang servers, "
                    "--router-ARG to sglang-router, Megatron's own flags to the Megatron trainer.")


def build_parser(prog: str = "agentrl train", description: str = "Train an LLM agent with RL on an env.",
                 sections: tuple[str, ...] = tuple(SECTIONS)) -> argparse.ArgumentParser:
    """Flags of the fields of `sections`, each explained by its field's docstring. A command
    that leaves a section out (`agentrl sft`: no rollout) neither lists nor takes its flags;
    a YAML file (--config) may still set them."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=PASSTHROUGH_HELP,
                                     usage="%(prog)s [--config FILE] [--FLAG VALUE ...]",
                                     argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE",
                        help="YAML file with config keys (flat or by section); flags override it")
    parser.add_argument("--dry-run", action="store_true", help="validate, print the resolved config, and exit")
    for section in sections:
        cls = SECTIONS[section]
        group = parser.add_argument_group(section, cls.__doc__)
        for name, info in cls.model_fields.items():
            flags = ["--" + name.replace("_", "-")] + [a for a, f in ALIASES.items() if f == name]
            # argparse formats help with %: a literal one is written %%
            help_text = ((info.description or "") + f" (default: {info.default!r})").replace("%", "%%")
            kind = info.annotation
            if kind is bool:
                group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
            elif name in PAIRED_LISTS:
                group.add_argument(*flags, dest=name, nargs="+", action="extend", metavar="NAME PATH", help=help_text)
            elif get_origin(kind) is list:
                # slime's lists: several values after one flag, or the flag repeated
                group.add_argument(*flags, dest=name, nargs="+", action="extend", metavar="VALUE",
                                   help=help_text + " [several values, repeatable]")
            elif get_origin(kind) is dict:
                group.add_argument(*flags, dest=name, type=_json_dict(name), metavar="JSON", help=help_text + " [JSON]")
            else:
                group.add_argument(*flags, dest=name, help=help_text, metavar=_metavar(kind))
    return parser


def _metavar(kind) -> str:
    """{a,b,c} for a Literal field (an optional one too), else VALUE."""
    choices = [arg for arg in ([kind] if get_origin(kind) is Literal else get_args(kind)) if get_origin(arg) is Literal]
    if choices:
        return "{" + ",".join(map(str, get_args(choices[0]))) + "}"
    return "VALUE"


def _json_dict(name: str):
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--{name.replace('_', '-')}: not JSON: {exc}")
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"--{name.replace('_', '-')}: expected a JSON object")
        return value
    return parse


def _split_passthrough(argv: list[str]) -> tuple[list[str], dict[str, dict[str, str | None]]]:
    from agentrl.trainers.megatron.flags import is_megatron_flag

    rest, passthrough = [], {"sglang_args": {}, "router_args": {}, "megatron_args": {}}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].partition("=")[0].replace("-", "_")
        if arg.startswith("--") and name not in FIELDS and arg.partition("=")[0] not in ALIASES \
                and is_megatron_flag(name):  # Megatron's own flag, by name
            _, eq, value = arg.partition("=")
            if not eq:
                value, i = _passthrough_value(argv, i)
            passthrough["megatron_args"][name] = value
            i += 1
            continue
        for prefix, key in (("--sglang-", "sglang_args"), ("--router-", "router_args")):
            if arg.startswith(prefix):
                name, eq, value = arg[len(prefix):].partition("=")
                if not eq:
                    value, i = _passthrough_value(argv, i)
                passthrough[key][name] = value
                break
        else:
            rest.append(arg)
        i += 1
    return rest, passthrough


def _passthrough_value(argv: list[str], i: int) -> tuple[str | None, int]:
    """The words after argv[i] up to the next --flag, joined by spaces (a list flag takes several:
    --sglang-cuda-graph-bs 1 2 4 8), or None for a bare switch; and the index of the last word."""
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return (" ".join(argv[i + 1:j]) if j > i + 1 else None), j - 1


def parse_config(argv: list[str], env_defaults_for=None, parser: argparse.ArgumentParser | None = None
                 ) -> tuple[Config, argparse.Namespace]:
    """argv -> resolved Config. `env_defaults_for(env_name, env_modules)` supplies the env's
    default_config layer (the CLI passes a registry lookup; tests may pass None)."""
    from agentrl import slime_args

    argv, slime = slime_args.translate(argv, FIELDS, ALIASES)  # slime's launch-script flags (agentrl/slime_args.py)
    rest, passthrough = _split_passthrough(argv)
    passthrough["megatron_args"].update(slime.megatron)
    ns = (parser or build_parser()).parse_args(rest)
    flags = {k: v for k, v in vars(ns).items() if k in FIELDS}
    layers: dict = {s: {} for s in SECTIONS}
    if getattr(ns, "config", None):
        layers = _merge(layers, load_yaml(ns.config))
    layers = _merge(layers, _flat_to_nested(flags, "command line"))
    layers = _merge(layers, _flat_to_nested(slime.custom_config, "--custom-config-path"))  # over flags, as in slime
    layers = _merge(slime_args.defaults(slime, passthrough["megatron_args"]), layers)
    slime_args.prepare(layers, slime)
    env_name = layers["run"].get("env", RunConfig.model_fields["env"].default)
    if env_defaults_for is not None:
        env_layer = _flat_to_nested(env_defaults_for(env_name, layers["run"].get("env_module", [])),
                                    f"default_config of env {env_name!r}")
        layers = _merge(env_layer, layers)
    layers["sglang_args"] = {**layers.get("sglang_args", {}), **passthrough["sglang_args"]}
    layers["router_args"] = {**layers.get("router_args", {}), **passthrough["router_args"]}
    layers["megatron_args"] = {**layers.get("megatron_args", {}), **passthrough["megatron_args"]}
    slime_args.warmup(layers, slime, {"rollout": RolloutConfig, "train": TrainConfig})
    cfg = resolve(layers)
    slime_args.finish(cfg, slime)
    check_multimodal(cfg)  # after the model's config.json is checked: a slime script gets as far as its model
    ns.slime_notices, ns.slime_environ = slime.notices, slime.environ
    return cfg, ns


TINY_MODEL_LR, CHECKPOINT_LR, SFT_CHECKPOINT_LR = 3e-3, 1e-6, 1e-5
# LoRA's default rate over full fine-tuning's: its B starts at zero and its update is a product of two
# small matrices, so at the full model's rate it barely moves ("LoRA Without Regret", Thinking Machines
# 2025: the best LoRA rate is ~10x the full one, in RL too; Tinker and PEFT recipes set it apart likewise)
LORA_LR_FACTOR = 10.0
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_target_modules(names: list[str]) -> list[str]:
    """--target-modules -> the peft module names it means (comma lists split, all-linear expanded)."""
    wanted = [n.strip() for name in names for n in name.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in LORA_MODULES and n != "all-linear"]
    if unknown or not wanted:
        raise ConfigError(f"--target-modules: unknown {unknown or 'empty'}; choose from {', '.join(LORA_MODULES)} "
                          "or all-linear")
    return list(LORA_MODULES) if "all-linear" in wanted else list(dict.fromkeys(wanted))


TINY_LORA_MODULES = ["embed_tokens", "model.norm"]


def lora_trainable_modules(names: list[str], tiny: bool = True) -> list[str]:
    """--lora-trainable-modules -> peft's modules_to_save (comma lists split, `none` empties it;
    `auto`: the tied embeddings and final norm on the built-in tiny model, else none)."""
    wanted = [n.strip() for name in names for n in name.split(",") if n.strip()]
    if wanted == ["auto"]:
        return list(TINY_LORA_MODULES) if tiny else []
    return [] if wanted in ([], ["none"]) else list(dict.fromkeys(wanted))


def _given(section: Section, *names: str) -> str | None:
    """The flag of the first of `names` whose value is not its default, if any (by value, not by
    whether it was given: a run's config.yaml gives every field and must load back)."""
    return next((f"--{n.replace('_', '-')}" for n in names
                 if getattr(section, n) != type(section).model_fields[n].default), None)


def check_delta_sync(cfg: Config) -> None:
    """--weight-sync-mode delta: refuse, naming why, the setups it cannot serve."""
    from agentrl.engines.sglang import engine_arg_values
    from agentrl.weight_delta import check_checksum

    if cfg.run.colocate:
        raise ConfigError("--weight-sync-mode delta is for engines apart from the trainer (as slime asserts); with "
                          "--colocate the weights go by CUDA IPC (--weight-sync-mode tensor), only a handle moves")
    if cfg.train.lora_rank and cfg.train.lora_sync == "adapter":
        raise ConfigError("--weight-sync-mode delta patches full checkpoints; --lora-sync adapter sends adapter "
                          "folders: use --lora-sync merged with delta, or drop --weight-sync-mode delta")
    if cfg.rollout.rollout_engine == "sglang" and any(str(v).lower() == "fp8"
                                                      for v in engine_arg_values(cfg, "quantization").values()):
        raise ConfigError("--weight-sync-mode delta with --sglang-quantization fp8: the engines serve a block-fp8 "
                          "copy the trainer re-quantizes at every sync, and the deltas patch the bf16 checkpoint: "
                          "use --weight-sync-mode tensor or distributed")
    try:
        check_checksum(cfg.train.weight_delta_checksum)
    except Exception as exc:
        raise ConfigError(f"--weight-delta-checksum: {exc}") from None


def check_multimodal(cfg: Config) -> None:
    """--multimodal-keys: images, from --prompt-data rows, through the chat template, into the trainer (torch, or
    megatron for the Qwen2-VL / Qwen2.5-VL families: trainers/megatron/vision.py)."""
    keys = cfg.data.multimodal_keys
    if not keys:
        return
    flag = f"--multimodal-keys '{json.dumps(keys)}'"
    from agentrl.vision import MEDIA_TYPES

    if other := sorted(set(keys) - set(MEDIA_TYPES)):
        raise ConfigError(f"{flag}: agentrl carries images only (key 'image'), not {', '.join(map(repr, other))}")
    if not all(isinstance(v, str) and v for v in keys.values()):
        raise ConfigError(f"{flag}: each value is the row key of that media's list")
    if not cfg.data.prompt_data:
        raise ConfigError(f"{flag} names columns of --prompt-data's rows; give --prompt-data")
    if not cfg.data.apply_chat_template:
        raise ConfigError(f"{flag}: the images' placeholders come from the chat template; drop "
                          "--no-apply-chat-template")
    if cfg.algo.advantage_estimator == "ppo":
        raise ConfigError(f"{flag} with --advantage-estimator ppo: the critic reads text only; use a critic-free "
                          "estimator (grpo, ...)")
    if cfg.algo.use_opd:
        raise ConfigError(f"{flag} with --use-opd: the teacher scores text only (no images in its requests)")
    for hook in ("custom_generate_function_path", "rollout_function_path"):
        if getattr(cfg.rollout, hook):
            raise ConfigError(f"{flag} with --{hook.replace('_', '-')}: slime's hooks get agentrl's slime Sample, "
                              "which does not carry the images (multimodal_inputs); use agentrl's agent loop")


def resolve(layers: dict) -> Config:
    layers = {**layers, "train": dict(layers.get("train", {}))}
    train = layers["train"]
    has_model = bool(layers.get("model", {}).get("model"))
    # the trainer's and model's default resolved here, so config.yaml says what trained
    train["lora_trainable_modules"] = lora_trainable_modules(train.get("lora_trainable_modules", ["auto"]),
                                                             tiny=not has_model)
    if train.get("lr") is None:
        sft = train.get("loss_type") == "sft_loss"
        train["lr"] = (SFT_CHECKPOINT_LR if sft else CHECKPOINT_LR) if has_model else TINY_MODEL_LR
        if train.get("lora_rank") and not train["lora_trainable_modules"]:  # whole weights trained: full's rate
            train["lr"] = float(f"{train['lr'] * LORA_LR_FACTOR:.6g}")  # 1e-05, not 9.99..e-06
    algo = layers.get("algo", {})
    if algo.get("overlong_buffer_len") is not None and algo.get("overlong_max_len") is None:
        budget = layers.get("rollout", {}).get("rollout_max_response_len",
                                               RolloutConfig.model_fields["rollout_max_response_len"].default)
        layers["algo"] = {**algo, "overlong_max_len": budget}
    try:
        cfg = Config(**layers)
    except ValidationError as exc:
        problems = "; ".join(
            f"--{'.'.join(map(str, e['loc'][1:] or e['loc'])).replace('_', '-')}: {e['msg']} (got {e.get('input')!r})"
            for e in exc.errors()
        )
        raise ConfigError(f"invalid config: {problems}") from None
    lora_target_modules(cfg.train.target_modules)
    whole = cfg.train.lora_trainable_modules
    if whole and cfg.train.lora_rank and cfg.train.lora_sync == "adapter" and cfg.train.weight_sync_mode == "disk":
        raise ConfigError("--lora-sync adapter with --lora-trainable-modules needs --weight-sync-mode tensor or "
                          "distributed (the trained modules go by the full-weight path; disk loads whole checkpoints)")
    if cfg.train.weight_sync_mode == "delta":
        check_delta_sync(cfg)
    elif delta_flag := _given(cfg.train, "weight_sync_local_dir", "weight_delta_encoding", "weight_delta_checksum",
                              "weight_delta_keep_versions"):
        raise ConfigError(f"{delta_flag} shapes the delta weight sync, which is off: add --weight-sync-mode delta")
    hook = cfg.rollout.custom_generate_function_path or cfg.rollout.rollout_function_path
    if cfg.train.lora_rank and cfg.train.lora_sync == "adapter" and hook:
        # slime's functions post their own /generate requests, which name no adapter: they would
        # sample from the base model, off policy
        raise ConfigError(f"--lora-sync adapter cannot serve slime's hook {hook!r} (its requests name no adapter): "
                          "use --lora-sync merged")
    if cfg.train.loss_type == "sft_loss":
        return cfg  # no rollouts: the RL batch-size rules below do not apply
    total = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    if total % cfg.train.global_batch_size:
        raise ConfigError(
            f"batch sizes do not fit: rollout_batch_size ({cfg.rollout.rollout_batch_size}) x n_samples_per_prompt "
            f"({cfg.rollout.n_samples_per_prompt}) = {total} samples per rollout, which is not a multiple of "
            f"global_batch_size ({cfg.train.global_batch_size}). Choose --global-batch-size dividing {total}."
        )
    over = cfg.rollout.over_sampling_batch_size
    if over is not None and over < cfg.rollout.rollout_batch_size:
        raise ConfigError(f"--over-sampling-batch-size ({over}) must be at least --rollout-batch-size "
                          f"({cfg.rollout.rollout_batch_size})")
    if cfg.run.debug_train_only and not cfg.run.load_debug_rollout_data:
        raise ConfigError("--debug-train-only needs --load-debug-rollout-data RUN_DIR (a run with saved trajectories)")
    if cfg.run.debug_train_only and cfg.run.debug_rollout_only:
        raise ConfigError("--debug-train-only and --debug-rollout-only exclude each other")
    if len(cfg.eval.eval_prompt_data) % 2:
        raise ConfigError(f"--eval-prompt-data takes NAME PATH pairs, got {cfg.eval.eval_prompt_data}")
    if cfg.eval.eval_interval and not cfg.eval.eval_prompt_data:
        raise ConfigError("--eval-interval needs --eval-prompt-data NAME PATH")
    if cfg.run.colocate and cfg.rollout.async_rollout:
        raise ConfigError("--colocate time-shares the GPUs between rollout and training; it cannot overlap them "
                          "(--async): drop one of the two")
    if cfg.rollout.mask_offpolicy_in_partial_rollout and not cfg.rollout.partial_rollout:
        raise ConfigError("--mask-offpolicy-in-partial-rollout needs --partial-rollout")
    a = cfg.algo
    # a flag that only shapes a feature left off would be silently ignored
    for off, flag, feature, switch in (
            (not a.use_tis, _given(a, "tis_mode", "tis_level", "rs_veto_threshold"), "the --use-tis importance weights",
             "--use-tis"),
            (not a.use_opd, _given(a, "opd_type", "opd_teacher_load", "opd_kl_coef"), "on-policy distillation",
             "--use-opd"),
            (a.overlong_buffer_len is None, _given(a, "overlong_max_len", "overlong_penalty_factor"),
             "the overlong penalty", "--overlong-buffer-len N"),
            (cfg.data.difficulty_window is None, _given(cfg.data, "difficulty_revisit_prob"),
             "difficulty-aware sampling", "--difficulty-window N")):
        if off and flag:
            raise ConfigError(f"{flag} shapes {feature}, which is off: add {switch}")
    if cfg.data.difficulty_window is not None and cfg.rollout.n_samples_per_prompt < 2:
        raise ConfigError("--difficulty-window skips prompts whose groups gave all their samples one reward, which "
                          "every group of --n-samples-per-prompt 1 does: use 2 or more samples per prompt")
    if a.opd_teacher_url and not (a.use_opd and a.opd_type == "sglang"):
        raise ConfigError("--opd-teacher-url is the served teacher of --use-opd --opd-type sglang")
    if a.use_opd and a.opd_type == "sglang" and bool(a.opd_teacher_load) == bool(a.opd_teacher_url):
        raise ConfigError("--use-opd --opd-type sglang needs one of --opd-teacher-load PATH (an engine group of its "
                          "own is started for it) or --opd-teacher-url URL (a teacher already serving /generate)")
    if a.use_opd and a.opd_type != "sglang" and not a.opd_teacher_load:
        raise ConfigError("--use-opd needs --opd-teacher-load PATH (the teacher's HF checkpoint)")
    for flag, path in (("--opd-teacher-load", a.opd_teacher_load), ("--judge-load", a.judge_load)):
        if path and not Path(path).exists():
            raise ConfigError(f"{flag} {path}: no such folder")
    for flag, url in (("--judge-url", a.judge_url), ("--opd-teacher-url", a.opd_teacher_url)):
        if url and not url.startswith(("http://", "https://")):
            raise ConfigError(f"{flag} {url}: not an http:// or https:// URL")
    if a.custom_rm_path in ("agentrl.judge:llm_judge", "agentrl.judge.llm_judge") and not (a.judge_url or a.judge_load):
        raise ConfigError(f"--custom-rm-path {a.custom_rm_path} needs the judge: --judge-url URL (an OpenAI-compatible "
                          "endpoint) or --judge-load PATH (a judge engine group of its own)")
    if a.judge_url and a.judge_load:
        raise ConfigError("--judge-url (a judge already serving) and --judge-load (a judge engine group the run "
                          "starts) exclude each other: give one")
    if a.use_unbiased_kl and not (a.use_kl_loss and a.kl_loss_coef > 0):
        raise ConfigError("--use-unbiased-kl weights the KL loss by pi/pi_old, and there is no KL loss: add "
                          "--use-kl-loss --kl-loss-coef C (> 0)")
    r = cfg.rollout
    if cfg.run.start_rollout_id is not None and cfg.run.start_rollout_id >= r.num_rollout:
        raise ConfigError(f"--start-rollout-id {cfg.run.start_rollout_id}: the run ends before it (--num-rollout "
                          f"{r.num_rollout}): nothing would train")
    if r.rollout_max_prompt_len is not None and not cfg.data.prompt_data:
        raise ConfigError("--rollout-max-prompt-len filters --prompt-data's rows when they are loaded; without "
                          "--prompt-data the env makes its own prompts")
    if r.rollout_max_prompt_len is not None and r.rollout_max_context_len is not None \
            and r.rollout_max_prompt_len > r.rollout_max_context_len - 1:
        raise ConfigError(f"--rollout-max-prompt-len ({r.rollout_max_prompt_len}) must be below --rollout-max-context-len "
                          f"({r.rollout_max_context_len}): at least one generated token to train on (as slime asserts)")
    kw = cfg.data.apply_chat_template_kwargs
    if kw and not cfg.data.apply_chat_template:
        raise ConfigError("--apply-chat-template-kwargs: the chat template is off (--no-apply-chat-template)")
    if taken := sorted(set(kw) & TEMPLATE_CALL_ARGS):
        raise ConfigError(f"--apply-chat-template-kwargs: {', '.join(taken)} set by agentrl's renderer itself")
    if a.ref_update_interval and not ((a.use_kl_loss and a.kl_loss_coef > 0) or a.kl_coef > 0):
        raise ConfigError(f"--ref-update-interval {a.ref_update_interval} refreshes the KL reference, and none is in "
                          "use: add --use-kl-loss --kl-loss-coef C (> 0) or --kl-coef C (> 0)")
    if a.disable_rewards_normalization and a.advantage_estimator in ("reinforce_plus_plus", "ppo"):
        raise ConfigError(f"--disable-rewards-normalization drops the group baseline of the group estimators; "
                          f"{a.advantage_estimator} has none to drop")
    if a.disable_rewards_normalization and a.custom_reward_post_process_path:
        raise ConfigError("--disable-rewards-normalization: --custom-reward-post-process-path already replaces the "
                          "group normalisation (its rewards are used as they are): drop one")
    if a.advantage_estimator == "cispo" and a.dual_clip_c is not None:
        raise ConfigError("--dual-clip-c bounds the PPO surrogate; cispo's loss has none (its ratio is a clipped, "
                          "detached weight): drop --dual-clip-c")
    if cfg.algo.overlong_buffer_len is not None:
        if cfg.algo.overlong_buffer_len >= cfg.algo.overlong_max_len:
            raise ConfigError(f"--overlong-buffer-len ({cfg.algo.overlong_buffer_len}) must be shorter than the length "
                              f"it ends at, --overlong-max-len ({cfg.algo.overlong_max_len}; default "
                              "--rollout-max-response-len): the penalty would start before the first token")
    if cfg.train.use_pytorch_profiler and cfg.train.profile_step_end <= cfg.train.profile_step_start:
        raise ConfigError(f"--profile-step-end ({cfg.train.profile_step_end}) must be after --profile-step-start "
                          f"({cfg.train.profile_step_start}): the steps profiled are start..end-1")
    steps = total // cfg.train.global_batch_size
    if cfg.train.num_steps_per_rollout is not None and cfg.train.num_steps_per_rollout != steps:
        raise ConfigError(
            f"--num-steps-per-rollout {cfg.train.num_steps_per_rollout} contradicts the batch sizes: "
            f"{cfg.rollout.rollout_batch_size} x {cfg.rollout.n_samples_per_prompt} / {cfg.train.global_batch_size} "
            f"= {steps} steps per rollout"
        )
    return cfg
