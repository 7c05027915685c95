"""Supervised fine-tuning (SFT) warm start: teach a model the chat and tool-call format before RL.

    agentrl sft --prompt-data FILE.jsonl [--model DIR] [--trainer torch|megatron] [--num-epoch N]

Each row holds a conversation, ``{"messages": [{"role", "content"}, ...], "tools": [...]}``
(keys: ``--input-key``, ``--tool-key``). It becomes the `Sample` the RL agent loop would have
recorded had the policy written its assistant turns: the chat template's text before the
first assistant turn is the prompt; each assistant turn is trained (loss mask 1), from its
first token to its end-of-turn token; everything the template puts between assistant turns
(role headers, user and tool messages) is context (mask 0), and only each new suffix is
tokenized, as `agentrl.rollout.agent_loop` does. The loss is the mean NLL of the trained
tokens of each global batch (`agentrl.algorithms.sft_loss`), one optimizer step per batch,
on either trainer (`train_sft`). Checkpoints are the trainers' own (`iter_NNNNNN/model` is
an HF folder): `agentrl train --model DIR/iter_NNNNNN/model` starts RL from it, `agentrl sft
--load DIR` resumes the SFT run. Leaves out: sequence truncation, packing of several
conversations into one sample, learning-rate schedules on the torch trainer.
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime
from pathlib import Path
from agentrl.config import Config, DataConfig
from agentrl.errors import ConfigError, DatasetError, TemplateDriftError
from agentrl.rollout.agent_loop import Renderer
from agentrl.types import Sample

ROLES = ("system", "user", "assistant", "tool")
#: the config layer `agentrl sft` puts under the YAML file and the flags (slime's SFT settings)
SFT_DEFAULTS = {"loss_type": "sft_loss", "input_key": "messages"}


# -- data --------------------------------------------------------------------------------------
def read_conversations(path: str, *, input_key: str = "messages", tool_key: str = "tools"
                       ) -> list[tuple[str, list[dict], list[dict] | None]]:
    """(where, messages, tools) per row of a JSONL or parquet file; a bad row raises
    DatasetError naming file, line and field."""
    from agentrl.data import numbered_rows

    out = []
    for where, row in numbered_rows(path):
        if input_key not in row:
            raise DatasetError(f"{where}: no {input_key!r} key (set --input-key); keys are {sorted(row)}")
        messages = row[input_key]
        if not isinstance(messages, list) or not messages:
            raise DatasetError(f"{where}: {input_key!r} must be a non-empty list of chat messages, "
                               f"got {messages!r:.80}")
        for i, m in enumerate(messages):
            field = f"{input_key}[{i}]"
            if not isinstance(m, dict):
                raise DatasetError(f"{where}: {field} must be an object with 'role' and 'content', got {m!r:.80}")
            if m.get("role") not in ROLES:
                raise DatasetError(f"{where}: {field}.role is {m.get('role')!r}; expected one of {', '.join(ROLES)}")
            if not isinstance(m.get("content"), str) and not (m["role"] == "assistant" and m.get("tool_calls")):
                raise DatasetError(f"{where}: {field}.content must be a string, got {m.get('content')!r:.80}")
        if messages[0]["role"] == "assistant":
            raise DatasetError(f"{where}: {input_key}[0] is an assistant message; a conversation starts with a "
                               "system or user message (the prompt)")
        if not any(m["role"] == "assistant" for m in messages):
            raise DatasetError(f"{where}: {input_key!r} has no assistant message: nothing to train on")
        tools = row.get(tool_key)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise DatasetError(f"{where}: {tool_key!r} must be a list of tool JSON schemas (set --tool-key)")
        out.append((where, messages, tools or None))
    if not out:
        raise DatasetError(f"{path}: no rows")
    return out


def conversation_sample(renderer: Renderer, messages: list[dict], tools: list[dict] | None = None,
                        sample_id: str = "") -> Sample:
    """The Sample of one conversation: assistant turns trained (mask 1), the rest context.

    An assistant turn is the template's text for it up to and including the first special
    token (its end-of-turn token, e.g. <|im_end|>), as the policy would have generated it
    and stopped; with no special token there (no chat template), the content and the EOS.
    Messages after the last assistant turn train nothing and are left out.
    """
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    seen = renderer.render(messages[:first], tools)  # the prompt, ending in the assistant header
    sample = Sample(prompt_tokens=renderer.encode(seen), trajectory_id=sample_id, messages=messages[:last + 1])
    specials = _special_texts(renderer.tokenizer)
    for turn, k in enumerate(i for i in range(first, last + 1) if messages[i]["role"] == "assistant"):
        if k > first:  # the context since the previous assistant turn, up to this one's header
            extra, seen = renderer.extension(sample, seen, messages[:k], tools, turn)
            sample.append_observation(extra)
        new = renderer.suffix(sample, seen, messages[:k + 1], tools, turn)
        ends = [new.find(t) + len(t) for t in specials if t in new]
        text = new[:min(ends)] if ends else str(messages[k].get("content") or "") + renderer.tokenizer.eos_token
        ids = renderer.encode(text)
        sample.append_generated(ids, [0.0] * len(ids), policy_version=0)
        seen += renderer.decode(ids)
    sample.num_turns = sum(m["role"] == "assistant" for m in sample.messages)
    sample.validate()
    return sample


def _special_texts(tokenizer) -> list[str]:
    texts = set(tokenizer.all_special_tokens)
    texts |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return [t for t in texts if t]


def load_sft_samples(data: DataConfig, tokenizer) -> list[Sample]:
    """Every row of --prompt-data as a Sample, checked before training starts."""
    renderer = Renderer(tokenizer, data.apply_chat_template, data.apply_chat_template_kwargs)
    samples = []
    for where, messages, tools in read_conversations(data.prompt_data, input_key=data.input_key,
                                                     tool_key=data.tool_key):
        try:
            samples.append(conversation_sample(renderer, messages, tools, sample_id=where))
        except TemplateDriftError as exc:
            raise DatasetError(f"{where}: {exc}") from None
        except Exception as exc:  # the chat template rejected the conversation
            raise DatasetError(f"{where}: the chat template cannot render this conversation: "
                               f"{type(exc).__name__}: {exc}") from exc
    return samples


# -- the loop ----------------------------------------------------------------------------------
def sft(cfg: Config) -> Path:
    """Epochs over the conversations (shuffled per epoch, seeded), one optimizer step per
    global batch; metrics.jsonl / tensorboard per step; checkpoints every --save-interval
    steps and at the end. Every rank of a multi-process Megatron run calls this; rank 0 writes."""
    from agentrl.data import PromptSource
    from agentrl.metrics import RunLog
    from agentrl.models import load_tokenizer
    from agentrl.progress import Progress
    from agentrl.build import build_trainer, latest_checkpoint, resolve_device, resolve_model, seed_everything

    if not cfg.data.prompt_data:
        raise ConfigError("agentrl sft needs --prompt-data FILE.jsonl (rows of chat messages)")
    if cfg.train.loss_type != "sft_loss":
        raise ConfigError(f"agentrl sft trains with --loss-type sft_loss, not {cfg.train.loss_type}")
    if cfg.data.multimodal_keys:
        raise ConfigError("--multimodal-keys: agentrl sft trains on text conversations; images are RL's only "
                          "(agentrl train)")
    out = Path(cfg.run.output_dir or f"runs/sft-{datetime.now():%Y%m%d-%H%M%S}")
    save_dir = Path(cfg.run.save or out / "checkpoints")
    progress = Progress(enabled=False)
    seed_everything(cfg.run.seed)
    ckpt = latest_checkpoint(Path(cfg.run.load)) if cfg.run.load else None
    if ckpt is not None and json.loads((ckpt / "trainer_state.json").read_text()).get("loss_type") != "sft_loss":
        raise ConfigError(f"--load {ckpt}: not an SFT checkpoint (--load resumes an SFT run); to fine-tune its "
                          f"weights give --model {ckpt / 'model'}")
    model_path = ckpt / "model" if ckpt else resolve_model(cfg, progress)
    samples = load_sft_samples(cfg.data, load_tokenizer(model_path))
    source = PromptSource([{"prompt": s.trajectory_id, "index": i} for i, s in enumerate(samples)],
                          shuffle=cfg.data.rollout_shuffle, seed=cfg.run.seed)
    total = len(samples) * cfg.data.num_epoch
    gbs = cfg.train.global_batch_size
    num_steps = math.ceil(total / gbs)

    device = resolve_device(cfg)
    trainer = build_trainer(cfg, model_path, device, sft=True)
    step = 0
    if ckpt is not None:
        state = trainer.load(ckpt)
        step = state["step"]
        source.load_state_dict(state["data"])
    main = getattr(trainer, "rank", 0) == 0
    runlog = None
    if main:
        out.mkdir(parents=True, exist_ok=True)
        cfg.dump(out / "config.yaml")
        runlog = RunLog(out)
        tokens = sum(s.num_trained_tokens for s in samples)
        progress.note(f"SFT: {len(samples)} conversations ({tokens} trained tokens) x {cfg.data.num_epoch} "
                      f"epoch(s) = {num_steps} steps of {gbs}; model {model_path}"
                      + (f"; resumed from {ckpt} at step {step}" if ckpt else ""))
    try:
        while step < num_steps:
            t0 = time.perf_counter()
            batch = [samples[t["index"]] for t in source.next_batch(min(gbs, total - step * gbs))]
            metrics = trainer.train_sft(batch)
            seconds = time.perf_counter() - t0
            step += 1
            trained = sum(s.num_trained_tokens for s in batch)
            row = {"rollout_id": step - 1, "epoch": (source.consumed - 1) // len(samples), **metrics,
                   "samples": len(batch), "trained_tokens": trained, "step_s": seconds,
                   "tokens_per_s": sum(len(s.tokens) for s in batch) / seconds if seconds > 0 else 0.0}
            if main:
                runlog.log(row)
                progress.console.print(
                    f"step {step}/{num_steps}: loss {row.get('loss', 0.0):.4f}  epoch {row['epoch']}  "
                    f"grad_norm {row.get('grad_norm', 0.0):.3f}  {trained} tokens  {seconds:.2f}s  "
                    f"{row['tokens_per_s']:.0f} tok/s", highlight=False, markup=False, soft_wrap=True)
            if step == num_steps or (cfg.run.save_interval and step % cfg.run.save_interval == 0):
                trainer.save(save_dir / f"iter_{step:06d}",
                             {"loss_type": "sft_loss", "step": step, "data": source.state_dict()})
    finally:
        if runlog is not None:
            runlog.close()
    if main:
        progress.note(f"run folder: {out} (metrics.jsonl, tensorboard/); checkpoint: {save_dir / f'iter_{step:06d}'}"
                      f" (start RL with: agentrl train --model {save_dir / f'iter_{step:06d}' / 'model'} ...)")
    return out


def sft_parser():
    from agentrl.config import build_parser

    # no rollout, RL algorithm or eval: their flags are not sft's (a --config file may still hold them)
    return build_parser("agentrl sft", "Supervised fine-tuning on chat data (loss on the assistant turns), "
                                       "e.g. to teach a base model the tool-call format before RL.",
                        sections=("model", "data", "train", "run"))
