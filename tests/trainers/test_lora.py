"""LoRA (--lora-rank): the PyTorch trainer trains peft adapters on a frozen base; the adapter
alone reaches the embedded engine through SGLang's /load_lora_adapter and requests name it;
checkpoints hold it in peft's format; merged export equals the adapted model."""

import asyncio

import pytest
import torch

from agentrl.config import AlgoConfig, TrainConfig, lora_target_modules, parse_config
from agentrl.errors import ConfigError
from agentrl.types import Sample, SampleStatus

TOLERANCE = 1e-4  # fp32 CPU, as tests/test_parity.py


def lora_trainer(model_path, **train):
    from agentrl.trainers.torch_trainer import TorchTrainer

    cfg = TrainConfig(**{"lr": 1e-2, "micro_batch_size": 8, "global_batch_size": 8, "lora_rank": 4, "lora_alpha": 8.0,
                         **train})
    return TorchTrainer(str(model_path), train=cfg, algo=AlgoConfig(), temperature=1.0)


def randomize_adapter(trainer, seed=0, marker="lora_"):
    """peft (and the Megatron adapters) start B at zero, so the adapter adds nothing: give the
    parameters whose name holds `marker` weights that change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if marker in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def learn_target_token(trainer, steps: int = 12, seed: int = 0) -> list[float]:
    """RL on one decision: after a fixed prompt the policy picks one of 8 candidate tokens (sampled
    from its own distribution over them), reward 1 for the target. Returns the expected reward
    (the policy's probability of the target among the candidates) before each step and at the
    end, and asserts it rose from ~1/8 to most of the mass."""
    import math

    prompt, candidates, target = [5, 17, 42, 9, 23], [101, 102, 103, 104, 105, 106, 107, 108], 104
    g = torch.Generator().manual_seed(seed)

    def one(token, reward=0.0, logprob=0.0):
        return Sample(prompt_tokens=prompt, response_tokens=[token], loss_mask=[1], rollout_logprobs=[logprob],
                      reward=reward, group_id=0, status=SampleStatus.COMPLETED)

    def policy() -> torch.Tensor:
        logps = torch.tensor([lp[0] for lp in trainer.compute_logprobs([one(t) for t in candidates])])
        return logps, torch.softmax(logps, 0)

    expected = []
    for _ in range(steps):
        logps, probs = policy()
        expected.append(float(probs[candidates.index(target)]))
        picks = torch.multinomial(probs, 8, replacement=True, generator=g).tolist()
        trainer.train_rollout([one(candidates[i], float(candidates[i] == target), float(logps[i])) for i in picks])
    expected.append(float(policy()[1][candidates.index(target)]))
    print("expected reward per step: " + " ".join(f"{r:.2f}" for r in expected))
    assert abs(expected[0] - 1 / 8) < 0.1 and expected[-1] > 0.6 and not math.isnan(expected[-1])
    return expected


@pytest.mark.slow
def test_torch_lora_learns_target_token(tiny_model):
    learn_target_token(lora_trainer(tiny_model, lr=5e-3))


def maximise_one_token(trainer, steps: int = 30) -> tuple[float, float]:
    """P(the named word) after target-token's prompt, before and after `steps` Adam steps on -log P."""
    from agentrl.models import load_tokenizer

    tokens = load_tokenizer(trainer.ref_path)("Repeat the word: " + " ".join(["the"] * 8))["input_ids"]
    ids, target = torch.tensor([tokens]), tokens[-1]

    def p():
        return torch.softmax(trainer.model(input_ids=ids).logits[0, -1].float(), -1)[target]

    with torch.no_grad():
        before = float(p())
    for _ in range(steps):
        trainer.optimizer.zero_grad()
        (-p().log()).backward()
        trainer.optimizer.step()
    with torch.no_grad():
        return before, float(p())


@pytest.mark.slow
def test_lora_with_the_tiny_models_embeddings_learns_as_full_fine_tuning(tiny_model):
    """The tiny model's tied embeddings (std 0.02) through its final norm cap every logit near 2.6:
    adapters on the linears alone cannot raise one token's probability past a few percent, with
    the embeddings and norm trained whole (--lora-trainable-modules auto) LoRA gets where full
    fine-tuning does (each at its default rate)."""
    from agentrl.trainers.torch_trainer import TorchTrainer

    def trainer(**train):
        torch.manual_seed(0)
        return TorchTrainer(str(tiny_model), train=TrainConfig(**train), algo=AlgoConfig(), temperature=1.0)

    full = maximise_one_token(trainer(lr=3e-3))
    adapters_only = maximise_one_token(trainer(lr=3e-3, lora_rank=8, lora_alpha=16, lora_trainable_modules=["none"]))
    lora = maximise_one_token(trainer(lr=3e-3, lora_rank=8, lora_alpha=16))
    print(f"P(target) full {full}, LoRA adapters only {adapters_only}, LoRA + embeddings and norm {lora}")
    assert max(full[0], adapters_only[0], lora[0]) < 0.01
    assert full[1] > 0.95 and lora[1] > 0.95 and adapters_only[1] < 0.1


def test_target_modules_flags():
    assert lora_target_modules(["all-linear"]) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"]
    assert lora_target_modules(["q_proj,v_proj", "q_proj"]) == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="lm_head"):
        lora_target_modules(["lm_head"])
    cfg, _ = parse_config(["--lora-rank", "8", "--lora-alpha", "32", "--target-modules", "q_proj",
                           "--target-modules", "v_proj", "--lora-sync", "adapter"])
    assert (cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.target_modules) == (8, 32.0, ["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="target-modules"):
        parse_config(["--lora-rank", "8", "--target-modules", "qkv"])
    with pytest.raises(ConfigError, match="--lora-sync merged"):  # slime's requests name no adapter
        parse_config(["--lora-rank", "8", "--lora-sync", "adapter", "--custom-generate-function-path", "m.generate"])
    cfg, _ = parse_config(["--lora-rank", "8", "--trainer", "megatron"])  # both trainers take LoRA, the same way
    assert (cfg.train.trainer, cfg.train.lora_rank, cfg.train.lora_trainable_modules) == (
        "megatron", 8, ["embed_tokens", "model.norm"])
    # --lora-trainable-modules: auto is the tiny model's tied embeddings and final norm (either trainer),
    # none on a checkpoint; lists as --target-modules; none
    assert parse_config(["--lora-rank", "8"])[0].train.lora_trainable_modules == ["embed_tokens", "model.norm"]
    assert parse_config(["--lora-rank", "8", "--model", "/ckpt"])[0].train.lora_trainable_modules == []
    cfg, _ = parse_config(["--lora-rank", "8", "--lora-trainable-modules", "embed_tokens,model.norm", "model.norm"])
    assert cfg.train.lora_trainable_modules == ["embed_tokens", "model.norm"]
    assert parse_config(["--lora-rank", "8", "--lora-trainable-modules", "none"])[0].train.lora_trainable_modules == []
    cfg, _ = parse_config(["--lora-rank", "8", "--trainer", "megatron", "--lora-trainable-modules", "model.norm",
                           "--model", "/ckpt"])
    assert cfg.train.lora_trainable_modules == ["model.norm"] and cfg.train.lr == 1e-6  # modules trained: full's rate
    with pytest.raises(ConfigError, match="--weight-sync-mode tensor or distributed"):
        parse_config(["--lora-rank", "8", "--lora-sync", "adapter", "--weight-sync-mode", "disk"])


@pytest.mark.parametrize("whole", [["none"], ["auto"]])
def test_base_frozen_only_adapters_train(tiny_model, whole):
    """The base is frozen; the adapters train, and (default `auto`) copies of the tied embeddings
    (still tied to the LM head) and of the final norm."""
    trainer = lora_trainer(tiny_model, target_modules=["q_proj", "v_proj"], lora_trainable_modules=whole)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    adapters = {n for n in trainable if ".lora_A." in n or ".lora_B." in n}
    assert adapters and all(("q_proj" in n or "v_proj" in n) for n in adapters)
    wholes = {f"base_model.model.model.{m}.modules_to_save.default.weight" for m in ("embed_tokens", "norm")}
    assert trainable - adapters == (wholes if whole == ["auto"] else set())
    base = trainer.model.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight  # peft's copy, still tied
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    named = dict(trainer.model.named_parameters())
    assert optimized == {id(named[n]) for n in trainable}
    base_before = {n: t.clone() for n, t in trainer._base_tensors()}
    sample = Sample(prompt_tokens=[5, 6, 7], response_tokens=[8, 9, 10], loss_mask=[1, 1, 1],
                    rollout_logprobs=[-1.0, -1.0, -1.0], reward=1.0, status=SampleStatus.COMPLETED)
    trainer.train_sft([sample] * 2)
    for n, p in trainer.model.named_parameters():
        assert (p.grad is not None) == p.requires_grad, n  # no grads for the base
    state = trainer.optimizer.state_dict()["state"]
    assert len(state) == len(trainable)  # no optimizer state for the base
    assert all(torch.equal(t, base_before[n]) for n, t in trainer._base_tensors())
    assert any(p.abs().sum() > 0 for n, p in trainer.model.named_parameters() if ".lora_B." in n)
    for n in trainable - adapters:  # the trained copies moved, the base's (in _base_tensors) did not
        assert not torch.equal(named[n], base_before[n.removeprefix("base_model.model.").replace(".modules_to_save.default.", ".")])


def test_merged_export_equals_adapted_model(tiny_model, tmp_path):
    from agentrl.models import load_model

    trainer = lora_trainer(tiny_model)
    randomize_adapter(trainer)
    randomize_adapter(trainer, seed=5, marker="modules_to_save")  # the trained final norm is exported too
    plain = load_model(str(tiny_model))
    merged = dict(trainer.named_tensors())
    assert set(merged) == {n for n, _ in plain.named_parameters()}  # the engine's names, no peft ones
    plain.load_state_dict(merged, strict=False)
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        assert not torch.allclose(want, load_model(str(tiny_model))(input_ids=ids).logits, atol=1e-3)
        torch.testing.assert_close(plain(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)
    folder = trainer.save_hf(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(load_model(str(folder))(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)


def test_checkpoint_is_peft_and_resumes(tiny_model, tmp_path):
    from peft import PeftModel

    from agentrl.models import load_model

    trainer = lora_trainer(tiny_model)
    randomize_adapter(trainer, seed=1)
    randomize_adapter(trainer, seed=4, marker="modules_to_save")  # the trained final norm goes along
    trainer.version = 3
    trainer.save(tmp_path / "ckpt", {"rollout_id": 3})
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        # peft itself loads the checkpoint's adapter onto the checkpoint's (base) model
        peft_model = PeftModel.from_pretrained(load_model(str(tmp_path / "ckpt" / "model")),
                                               str(tmp_path / "ckpt" / "adapter"))
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    # `agentrl train --load` builds the trainer from ckpt/model and loads the rest
    resumed = lora_trainer(tmp_path / "ckpt" / "model")
    assert resumed.load(tmp_path / "ckpt")["rollout_id"] == 3 and resumed.version == 3
    with torch.no_grad():
        torch.testing.assert_close(resumed.model(input_ids=ids).logits, want, atol=1e-6, rtol=1e-6)


def test_engine_serves_adapter_on_policy(tiny_model, tokenizer, tmp_path):
    """The adapter alone goes to the engine (the same endpoints as SGLang's), requests name it,
    and the engine's rollout logprobs equal the trainer's recomputed ones with it applied."""
    from aiohttp.test_utils import TestClient, TestServer

    from agentrl.engines.embedded import EmbeddedEngine
    from agentrl.weight_transfer import lora_adapter_name, sync_lora_adapter

    trainer = lora_trainer(tiny_model)
    randomize_adapter(trainer, seed=2)
    engine = EmbeddedEngine(str(tiny_model), enable_lora=True, prefix_cache_tokens=4096)
    plain_engine = EmbeddedEngine(str(tiny_model), prefix_cache_tokens=0)
    prompt = tokenizer.encode("tell me about the river")

    async def go():
        from agentrl.rollout.client import EngineClient

        async with TestClient(TestServer(engine.app())) as http, TestClient(TestServer(plain_engine.app())) as plain:
            client = EngineClient(str(http.make_url("")).rstrip("/"))
            try:
                def generate(lora=None, rid=None):
                    body = {"input_ids": prompt, "return_logprob": True, "rid": rid,
                            "sampling_params": {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}}
                    return http.post("/generate", json=body | ({"lora_path": lora} if lora else {}))

                # as SGLang: naming an adapter never loaded is an error; so is LoRA on an engine without it
                resp = await generate("agentrl-lora-v1")
                assert resp.status == 400 and "never been loaded" in (await resp.json())["error"]["message"]
                resp = await plain.post("/generate", json={"input_ids": prompt, "lora_path": "x"})
                assert resp.status == 400 and "--enable-lora" in (await resp.json())["error"]["message"]
                resp = await plain.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
                assert resp.status == 400 and not (await resp.json())["success"]

                folder = trainer.save_adapter(tmp_path / "v1")
                stats = await sync_lora_adapter([client], str(folder), version=1)
                assert 0 < stats["weight_sync_mb"] < 1  # the adapter, not the model
                resp = await http.post("/load_lora_adapter", json={"lora_name": lora_adapter_name(1),
                                                                   "lora_path": str(folder)})
                assert resp.status == 400 and "already loaded" in (await resp.json())["error_message"]
                replies = await asyncio.gather(*[generate(lora_adapter_name(1), rid=f"a{i}") for i in range(4)],
                                               generate(None, rid="base"))
                bodies = [await r.json() for r in replies]
                assert all(b["meta_info"]["weight_version"] == "1" for b in bodies)
                # a new version replaces the old: the old name is dropped from the loaded set
                randomize_adapter(trainer, seed=3)
                folder2 = trainer.save_adapter(tmp_path / "v2")
                await sync_lora_adapter([client], str(folder2), version=2, previous=1)
                resp = await http.post("/unload_lora_adapter", json={"lora_name": lora_adapter_name(1)})
                assert resp.status == 400 and "does not exist" in (await resp.json())["error_message"]
                again = await (await generate(lora_adapter_name(2), rid="b")).json()
                return bodies, again
            finally:
                await client.close()

    bodies, again = asyncio.run(go())

    def as_sample(body):
        pairs = body["meta_info"]["output_token_logprobs"]
        out = [p[1] for p in pairs]
        return Sample(prompt_tokens=prompt, response_tokens=out, loss_mask=[1] * len(out),
                      rollout_logprobs=[p[0] for p in pairs], reward=0.0, status=SampleStatus.COMPLETED)

    adapted, base = [as_sample(b) for b in bodies[:4]], as_sample(bodies[4])
    trainer.load_adapter_weights(tmp_path / "v1")
    recomputed = trainer.compute_logprobs(adapted)
    diffs = [abs(a - b) for s, r in zip(adapted, recomputed) for a, b in zip(r, s.rollout_logprobs)]
    assert len(diffs) == 48 and max(diffs) < TOLERANCE, max(diffs)
    # the base request in the same batch got the base model, not the adapter
    with trainer.model.disable_adapter():
        base_lp = trainer.compute_logprobs([base])[0]
    assert max(abs(a - b) for a, b in zip(base_lp, base.rollout_logprobs)) < TOLERANCE
    assert max(abs(a - b) for a, b in zip(trainer.compute_logprobs([base])[0], base.rollout_logprobs)) > 1e-3
    trainer.load_adapter_weights(tmp_path / "v2")
    v2 = as_sample(again)
    assert max(abs(a - b) for a, b in zip(trainer.compute_logprobs([v2])[0], v2.rollout_logprobs)) < TOLERANCE


def sync_adapter_and_sample(cfg, trainer, engine, prompt: list[int], *, temperature: float) -> tuple[dict, Sample]:
    """TrainerSync's version 1 from `trainer` into `engine` (served in-process), then 12 tokens of
    `prompt` under that version's adapter: the sync's stats and the reply as a Sample whose rollout
    logprobs are the engine's."""
    from aiohttp.test_utils import TestClient, TestServer

    from agentrl.weight_sync import TrainerSync
    from agentrl.weight_transfer import lora_adapter_name

    async def go():
        async with TestClient(TestServer(engine.app())) as http:
            stats = await TrainerSync(cfg, trainer).sync([str(http.make_url("")).rstrip("/")], version=1)
            body = {"input_ids": prompt, "return_logprob": True, "lora_path": lora_adapter_name(1),
                    "sampling_params": {"temperature": temperature, "max_new_tokens": 12, "ignore_eos": True}}
            return stats, await (await http.post("/generate", json=body)).json()

    stats, reply = asyncio.run(go())
    pairs = reply["meta_info"]["output_token_logprobs"]
    return stats, Sample(prompt_tokens=prompt, response_tokens=[p[1] for p in pairs], loss_mask=[1] * len(pairs),
                         rollout_logprobs=[p[0] for p in pairs], reward=0.0, status=SampleStatus.COMPLETED)


def test_adapter_sync_carries_the_trained_norm(tiny_model, tokenizer, tmp_path):
    """--lora-sync adapter with modules trained whole (the tiny model's embeddings and final norm):
    TrainerSync sends them by the full-weight path (SGLang's adapters hold only lora_A/lora_B) and
    the adapter folder in the same sync, so the engine's logprobs under the new version are the trainer's."""
    from agentrl.engines.embedded import EmbeddedEngine

    cfg, _ = parse_config(["--lora-rank", "4", "--lora-alpha", "8", "--lora-sync", "adapter",
                           "--output-dir", str(tmp_path)])
    assert cfg.train.lora_trainable_modules == ["embed_tokens", "model.norm"]
    trainer = lora_trainer(tiny_model)
    randomize_adapter(trainer, seed=2)
    randomize_adapter(trainer, seed=3, marker="embed_tokens.modules_to_save")
    with torch.no_grad():  # a trained norm: far from the base's ones
        trainer.model.get_base_model().model.norm.modules_to_save["default"].weight.mul_(3.0)
    engine = EmbeddedEngine(str(tiny_model), enable_lora=True, prefix_cache_tokens=4096)
    prompt = tokenizer.encode("tell me about the river")

    stats, sample = sync_adapter_and_sample(cfg, trainer, engine, prompt, temperature=1.0)
    assert stats["failed_engines"] == [] and stats["weight_sync_modules_mb"] > 0
    assert stats["weight_sync_s"] >= stats["weight_sync_modules_s"] > 0
    trained = dict(trainer.trained_module_tensors())
    assert list(trained) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert float(trained["model.norm.weight"].mean()) == 3.0
    torch.testing.assert_close(engine.model.model.norm.weight, trained["model.norm.weight"])  # not the base's 1s
    torch.testing.assert_close(engine.model.model.embed_tokens.weight, trained["model.embed_tokens.weight"])
    recomputed = trainer.compute_logprobs([sample])[0]
    assert max(abs(a - b) for a, b in zip(recomputed, sample.rollout_logprobs)) < TOLERANCE


def test_logprobs_are_computed_without_dropout(tiny_model):
    """--lora-dropout acts in the training steps only: the recomputed logprobs (the PPO ratio's
    old side, the on-policy check against the engine's) are those of the whole adapter, the
    same every time, and the model goes back to training mode."""
    trainer = lora_trainer(tiny_model, lora_dropout=0.5)
    randomize_adapter(trainer)
    samples = [Sample(prompt_tokens=[5, 6, 7, 8], response_tokens=[9, 10, 11, 12, 13], loss_mask=[1] * 5,
                      rollout_logprobs=[0.0] * 5)]
    first, second = trainer.compute_logprobs(samples), trainer.compute_logprobs(samples)
    assert first == second and trainer.model.training
    trainer.model.eval()
    with torch.no_grad():  # the adapter without dropout, by hand
        expected = trainer.compute_logprobs(samples)
    assert first == expected


def test_synced_adapter_is_in_the_engines_dtype_checkpoint_in_float32(tiny_model, tmp_path):
    """peft trains the adapters in float32 over a bfloat16 base: the adapter the engines load is
    bfloat16 (half the bytes; what they compute in), the checkpoint's keeps float32 for an exact resume."""
    from safetensors.torch import load_file

    from agentrl.trainers.torch_trainer import TorchTrainer

    trainer = TorchTrainer(str(tiny_model), train=TrainConfig(lr=1e-2, micro_batch_size=8, global_batch_size=8,
                                                              lora_rank=4, lora_alpha=8.0),
                           algo=AlgoConfig(), temperature=1.0, dtype="bfloat16")
    randomize_adapter(trainer, seed=1)
    synced = load_file(str(trainer.save_adapter(tmp_path / "sync") / "adapter_model.safetensors"))
    trainer.save(tmp_path / "ckpt", {})
    kept = load_file(str(tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors"))
    # the checkpoint also holds the modules trained whole (--lora-trainable-modules); the sync folder adapters only
    assert synced.keys() == {k for k in kept if ".lora_" in k} and synced
    assert set(kept) - set(synced) == {f"base_model.model.{m}.weight" for m in ("model.norm", "model.embed_tokens",
                                                                                "lm_head")}  # peft names the tied head too
    assert {t.dtype for t in synced.values()} == {torch.bfloat16}
    assert {t.dtype for k, t in kept.items() if ".lora_" in k} == {torch.float32}
    assert kept["base_model.model.model.norm.weight"].dtype == torch.bfloat16  # peft's copies train in the model's dtype
    for k in synced:
        torch.testing.assert_close(synced[k], kept[k].to(torch.bfloat16), atol=0, rtol=0)
