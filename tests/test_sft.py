"""`agentrl sft`: the loss mask covers exactly the assistant tokens (tokenised as the RL agent
loop does), the loss is the mean NLL of those tokens, a few steps make it drop, both trainers
agree, checkpoints resume and feed `agentrl train --model`, bad rows name file and line.

Tolerances (fp32 on CPU): the trainer's SFT loss within 1e-5 (relative) of a direct
log_softmax calculation; the Megatron trainer's loss and grad norm within 1e-5 (relative) of
the PyTorch trainer's on the first step; on the second (after one Adam step) the loss within
1e-5 and the grad norm within 1e-4 (Adam amplifies float rounding, see tests/trainers/test_megatron.py)."""

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
import torch

import agentrl
from agentrl.config import AlgoConfig, DataConfig, TrainConfig
from agentrl.errors import DatasetError
from agentrl.rollout.agent_loop import LoopSettings, Renderer, run_trajectory
from agentrl.rollout.client import GenerateResult
from agentrl.sft import conversation_sample, load_sft_samples, read_conversations
from spine_helpers import agentrl_cli, run_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "sft" / "math_python_sft.jsonl"
SHIM = ROOT / "tests" / "trainers" / "megatron_cpu_shim.py"


def example_rows(n: int, start: int = 0) -> list[dict]:
    return [json.loads(x) for x in EXAMPLE.read_text().splitlines()[start:start + n]]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def short_rows(n: int) -> list[dict]:
    """The example's conversations without the (long) tool schemas: quick to train on."""
    return [{"messages": r["messages"][1:]} for r in example_rows(n)]


def samples_of(tmp_path: Path, tokenizer, rows: list[dict]):
    return load_sft_samples(DataConfig(prompt_data=str(write_rows(tmp_path / "d.jsonl", rows)),
                                       input_key="messages"), tokenizer)


def runs(sample, tokenizer) -> list[tuple[int, str]]:
    """(mask, decoded text) of each run of equal mask values in the response."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(sample.response_tokens, sample.loss_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return [(m, tokenizer.decode(ids)) for m, ids in out]


# -- tokenisation ----------------------------------------------------------------------------
def test_mask_is_exactly_the_assistant_tokens(tokenizer):
    row = example_rows(1)[0]
    _, messages, tools = read_conversations(str(EXAMPLE))[0]
    s = conversation_sample(Renderer(tokenizer), messages, tools)
    call, final = (m["content"] for m in row["messages"] if m["role"] == "assistant")
    assert runs(s, tokenizer) == [
        (1, call + "<|im_end|>"),
        (0, "\n<|im_start|>tool\n" + row["messages"][3]["content"] + "<|im_end|>\n<|im_start|>assistant\n"),
        (1, final + "<|im_end|>"),
    ]
    prompt = tokenizer.decode(s.prompt_tokens)
    assert prompt.endswith("<|im_start|>assistant\n") and row["messages"][1]["content"] in prompt
    assert '"name": "python"' in prompt  # the tool schemas went through the chat template
    rendered = tokenizer.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
    assert tokenizer.decode(s.tokens) + "\n" == rendered  # the whole conversation, nothing else


class ScriptedClient:
    def __init__(self, tokenizer, replies):
        self.tok, self.replies = tokenizer, list(replies)

    async def generate(self, input_ids, sampling_params, *, session_id=None, rid=None, lora_path=None):
        ids = self.tok.encode(self.replies.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        return GenerateResult(ids, [-0.5] * len(ids), "stop", len(input_ids), 0, "0")


class ToolEcho(agentrl.Env):
    """Two tool rounds, then done: what a tool env's trajectory looks like."""

    max_turns = 3
    TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]

    def reset(self, *, seed=None, options=None):
        self.turn = 0
        return [{"role": "system", "content": "use tools"}, {"role": "user", "content": options["prompt"]}], \
            {"tools": self.TOOLS}

    def step(self, action):
        self.turn += 1
        return [{"role": "tool", "name": "python", "content": f"out {self.turn}"}], 0.0, self.turn == 3, False, {}


def test_sft_and_rl_tokenise_a_conversation_identically(tokenizer):
    replies = ['<tool_call>{"name": "python", "arguments": {"code": "1+1"}}</tool_call>', "again", "done: 2"]
    rl = asyncio.run(run_trajectory(
        ToolEcho(), {"prompt": "add"}, renderer=Renderer(tokenizer), client=ScriptedClient(tokenizer, replies),
        settings=LoopSettings(max_response_len=500, max_turns=3, sampling_params={}), trajectory_id="t",
        group_id=0, seed=0))
    s = conversation_sample(Renderer(tokenizer), rl.messages, ToolEcho.TOOLS)
    assert s.prompt_tokens == rl.prompt_tokens
    assert s.response_tokens == rl.response_tokens and s.loss_mask == rl.loss_mask


# -- the loss and learning -------------------------------------------------------------------
def direct_nll(model_dir, samples) -> float:
    """Mean NLL of the mask-1 tokens, straight from the HF model's logits."""
    from agentrl.models import load_model

    model = load_model(model_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=torch.tensor([s.tokens])).logits[0].double()
            logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(s.tokens[1:])[:, None])[:, 0]
            mask = torch.tensor([0] * (len(s.prompt_tokens) - 1) + s.loss_mask, dtype=torch.double)
            total += float(-(logp * mask).sum())
            count += int(mask.sum())
    return total / count


def mean_nll(trainer, samples) -> float:
    logps = trainer.compute_logprobs(samples)
    return -sum(x for lp, s in zip(logps, samples) for x, m in zip(lp, s.loss_mask) if m) / \
        sum(s.num_trained_tokens for s in samples)


@pytest.mark.slow
def test_loss_is_the_nll_and_a_few_steps_make_it_drop(tiny_model, tokenizer, tmp_path):
    from agentrl.trainers.torch_trainer import TorchTrainer

    samples = samples_of(tmp_path, tokenizer, short_rows(6))
    train, held_out = samples[:4], samples[4:]
    trainer = TorchTrainer(str(tiny_model), train=TrainConfig(lr=1e-2, global_batch_size=4, micro_batch_size=2),
                           algo=AlgoConfig(), temperature=1.0)
    expected = direct_nll(tiny_model, train)
    before_held_out = mean_nll(trainer, held_out)
    first = trainer.train_sft(train)  # two micro-batches; the loss of the weights before the step
    assert first["loss"] == pytest.approx(expected, rel=1e-5)
    losses = [first["loss"]] + [trainer.train_sft(train)["loss"] for _ in range(4)]
    after, after_held_out = mean_nll(trainer, train), mean_nll(trainer, held_out)
    print(f"SFT on 4 conversations, 5 steps: NLL {expected:.3f} -> {after:.3f}; held-out "
          f"{before_held_out:.3f} -> {after_held_out:.3f}; losses {[round(x, 3) for x in losses]}")
    assert trainer.version == 5
    assert after < 0.75 * expected and after_held_out < 0.8 * before_held_out


# -- the command -----------------------------------------------------------------------------
def sft_cfg(*argv):
    from agentrl.config import parse_config
    from agentrl.sft import SFT_DEFAULTS, sft_parser

    return parse_config(list(argv), env_defaults_for=lambda *_: dict(SFT_DEFAULTS), parser=sft_parser())[0]


def metrics(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def test_flags_and_resume_at_the_same_step(tmp_path):
    from agentrl.sft import sft

    data = write_rows(tmp_path / "d.jsonl", [GOOD] * 6)
    cfg = sft_cfg("--prompt-data", str(data), "--global-batch-size", "4", "--num-epoch", "2", "--save-interval", "2")
    assert cfg.data.input_key == "messages" and cfg.train.loss_type == "sft_loss"  # slime's SFT settings
    a, b = tmp_path / "a", tmp_path / "b"
    sft(cfg.model_copy(update={"run": cfg.run.model_copy(update={"output_dir": str(a), "progress": False})}))
    rows = metrics(a)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]  # 12 samples / 4 per step
    assert [r["epoch"] for r in rows] == [0, 1, 1] and [r["samples"] for r in rows] == [4, 4, 4]
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == ["iter_000002", "iter_000003"]
    assert list((a / "tensorboard").glob("events.out.tfevents.*"))

    resumed = cfg.run.model_copy(update={"output_dir": str(b), "load": str(a / "checkpoints" / "iter_000002")})
    sft(cfg.model_copy(update={"run": resumed}))
    (last,) = metrics(b)
    assert last["rollout_id"] == 2 and last["loss"] == pytest.approx(rows[2]["loss"], rel=1e-6)


@pytest.mark.slow
def test_megatron_trainer_runs_sft_like_the_pytorch_trainer(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core")
    from agentrl.sft import sft

    monkeypatch.syspath_prepend(str(SHIM.parent))
    import megatron_cpu_shim

    megatron_cpu_shim.apply()  # megatron-core on CPU (test-only)
    data = write_rows(tmp_path / "d.jsonl", short_rows(4))
    cfg = sft_cfg("--prompt-data", str(data), "--global-batch-size", "4", "--micro-batch-size", "2", "--num-epoch", "2",
                  "--lr", "1e-3", "--no-progress")
    for trainer in ("torch", "megatron"):
        sft(cfg.model_copy(update={"train": cfg.train.model_copy(update={"trainer": trainer}),
                                   "run": cfg.run.model_copy(update={"output_dir": str(tmp_path / trainer)})}))
    torch_rows, megatron_rows = metrics(tmp_path / "torch"), metrics(tmp_path / "megatron")
    print("SFT steps, torch:", [(r["loss"], r["grad_norm"]) for r in torch_rows], "megatron:",
          [(r["loss"], r["grad_norm"]) for r in megatron_rows])
    assert len(torch_rows) == len(megatron_rows) == 2
    for a, b in zip(torch_rows, megatron_rows):  # step 2 runs on the weights after one Adam step
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    ckpt = tmp_path / "megatron" / "checkpoints" / "iter_000002"
    assert (ckpt / "megatron").is_dir() and (ckpt / "model" / "model.safetensors").exists()


@pytest.mark.e2e
def test_checkpoint_is_a_model_for_agentrl_train(tmp_path, capsys):
    from agentrl.cli import main

    data = write_rows(tmp_path / "d.jsonl", [GOOD, GOOD])
    out = tmp_path / "sft"
    assert main(["sft", "--prompt-data", str(data), "--global-batch-size", "2", "--output-dir", str(out)]) == 0
    assert "step 1/1: loss" in capsys.readouterr().err
    model = out / "checkpoints" / "iter_000001" / "model"
    rl = tmp_path / "rl"
    proc = subprocess.run([agentrl_cli(), "train", "--model", str(model), "--env", "target-token", "--num-rollout", "1",
                           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
                           "--rollout-max-response-len", "4", "--lr", "1e-3", "--no-progress", "--output-dir",
                           str(rl)], capture_output=True, text=True, timeout=300, env=run_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert metrics(rl)[0]["rollout_id"] == 0 and yaml_model(rl) == str(model)


def yaml_model(run: Path) -> str:
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())["model"]["model"]


# -- bad input -------------------------------------------------------------------------------
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize("bad,message", [
    ({"prompt": "hi"}, r"bad\.jsonl:2: no 'messages' key \(set --input-key\)"),
    ({"messages": "hi"}, r"bad\.jsonl:2: 'messages' must be a non-empty list"),
    ({"messages": [{"from": "human", "value": "hi"}]}, r"bad\.jsonl:2: messages\[0\]\.role is None"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "gpt", "content": "yo"}]},
     r"bad\.jsonl:2: messages\[1\]\.role is 'gpt'; expected one of system, user, assistant, tool"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
     r"bad\.jsonl:2: messages\[0\]\.content must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"bad\.jsonl:2: 'messages' has no assistant message"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, r"bad\.jsonl:2: messages\[0\] is an assistant"),
    ({**GOOD, "tools": {"name": "python"}}, r"bad\.jsonl:2: 'tools' must be a list of tool JSON schemas"),
])
def test_a_bad_row_is_named_by_file_line_and_field(tmp_path, bad, message):
    path = write_rows(tmp_path / "bad.jsonl", [GOOD, bad])
    with pytest.raises(DatasetError, match=message):
        read_conversations(str(path))


@pytest.mark.e2e
def test_the_command_reports_a_bad_row(tmp_path, capsys):
    from agentrl.cli import main

    path = write_rows(tmp_path / "bad.jsonl", [GOOD, GOOD, {"messages": [{"role": "user"}]}])
    assert main(["sft", "--prompt-data", str(path), "--output-dir", str(tmp_path / "run")]) == 2
    assert f"agentrl sft: error: {path}:3: messages[0].content must be a string" in capsys.readouterr().err
    # slime's way: `agentrl train --loss-type sft_loss` runs the same SFT
    assert main(["train", "--loss-type", "sft_loss", "--input-key", "messages", "--prompt-data", str(path)]) == 2
    assert f"{path}:3: messages[0].content" in capsys.readouterr().err
    (tmp_path / "broken.jsonl").write_text(json.dumps(GOOD) + "\n{oops\n")
    assert main(["sft", "--prompt-data", str(tmp_path / "broken.jsonl")]) == 2
    assert "broken.jsonl:2: not valid JSON" in capsys.readouterr().err
