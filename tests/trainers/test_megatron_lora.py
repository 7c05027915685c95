"""LoRA on the Megatron trainer (CPU, gloo; megatron_cpu_shim.py): adapters on the fused linears
export as a peft adapter that peft itself loads onto the HF model and that gives the Megatron
model's logprobs; the base is frozen (the optimizer holds the adapters only); the merged export
equals peft's merge; TP=2 + SP and PP=2 give the one-process figures and the same adapter;
checkpoints resume the adapter and its optimizer state; LoRA learns a target token by RL.
--lora-trainable-modules (HF names, trained whole): only those modules move, the step equals the
PyTorch trainer's (peft's modules_to_save), checkpoints resume them, and --lora-sync adapter
sends exactly the adapter plus them.

Tolerances as tests/trainers/test_megatron.py: logprobs within 1e-5 of the HF (peft) model's,
1e-4 after Adam steps."""

import json

import pytest
import torch

megatron_trainer = pytest.importorskip("agentrl.trainers.megatron.trainer")  # imports megatron-core
pytest.importorskip("peft")

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

from agentrl.config import AlgoConfig, TrainConfig  # noqa: E402
from megatron_helpers import make_samples, run_ranks  # noqa: E402
from test_lora import learn_target_token, randomize_adapter, sync_adapter_and_sample  # noqa: E402

MegatronTrainer = megatron_trainer.MegatronTrainer
LOGPROB_TOL = 1e-5
STEP_TOL = 1e-4
# peft computes B(A x) in another order than Megatron's adapters; with adapters as large as
# randomize() makes them (0.3 a weight) fp32 rounding reaches a few 1e-5 in a logprob
PEFT_TOL = 1e-4
# a parallel step's lr: Adam's first update is about lr * sign(grad), so float noise in a
# near-zero gradient element (reduced in another order over TP/SP) moves it by up to lr
PARALLEL_LR = 1e-5
ALL = ["all-linear"]
SOME = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # k_proj and gate_proj left out: zero rows in between


def lora_train(**kw):
    """Adapters only unless the test names --lora-trainable-modules (`auto` would add the tiny model's
    embeddings and final norm)."""
    return TrainConfig(**{"lr": 1e-2, "global_batch_size": 6, "micro_batch_size": 2, "lora_rank": 4,
                          "lora_alpha": 8.0, "lora_trainable_modules": ["none"], **kw})


def megatron(model, megatron_args=None, **kw):
    return MegatronTrainer(str(model), train=lora_train(**kw), algo=AlgoConfig(), temperature=0.8, device="cpu",
                           dtype="float32", megatron_args=megatron_args)


def randomize(trainer, seed=0):
    randomize_adapter(trainer, seed, marker=".lora.")


def peft_logprobs(model_path, adapter, samples, temperature=0.8):
    """Logprobs of the HF model with the adapter loaded by peft itself (PeftModel.from_pretrained)."""
    from peft import PeftModel

    from agentrl.models import load_model
    from agentrl.trainers.torch_trainer import TorchTrainer

    tt = TorchTrainer(str(model_path), train=TrainConfig(lr=1e-6), algo=AlgoConfig(), temperature=temperature)
    tt.model = PeftModel.from_pretrained(load_model(str(model_path)), str(adapter)).eval()
    return tt.compute_logprobs(samples)


def max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("targets", [ALL, SOME])
def test_exported_adapter_is_peft_and_gives_megatron_logprobs(tiny_model, tmp_path, targets):
    from safetensors.torch import load_file

    mt = megatron(tiny_model, target_modules=targets, max_tokens_per_gpu=48)
    samples = make_samples()
    base = mt.compute_logprobs(samples)
    randomize(mt)
    adapted = mt.compute_logprobs(samples)
    assert max_diff(adapted, base) > 0.05  # the adapters change the model
    folder = mt.save_adapter(tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    keys = set(load_file(str(folder / "adapter_model.safetensors")))
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] if targets == ALL else SOME
    want = {f"base_model.model.model.layers.{i}.{'mlp' if m in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}"
            f".{m}.lora_{w}.weight" for i in range(mt.hf_config.num_hidden_layers) for m in modules for w in "AB"}
    assert keys == want
    ref = peft_logprobs(tiny_model, folder, samples)
    print(f"{targets}: max |megatron+lora - peft| logprob = {max_diff(adapted, ref):.2e}")
    assert max_diff(adapted, ref) < PEFT_TOL
    # a peft adapter read back into the trainer gives the same model (what resume from a folder does)
    fresh = megatron(tiny_model, target_modules=targets)
    fresh.load_adapter_weights(folder)
    assert max_diff(fresh.compute_logprobs(samples), adapted) == 0.0


def test_base_frozen_optimizer_holds_adapters_only_and_merge_equals_peft(tiny_model, tmp_path):
    from peft import PeftModel

    from agentrl.models import load_model
    from agentrl.trainers.megatron.weights import HFCheckpoint

    mt = megatron(tiny_model, target_modules=ALL)
    adapters = {n: p for n, p in mt.model.named_parameters() if ".lora." in n}
    trainable = {n for n, p in mt.model.named_parameters() if p.requires_grad}
    assert trainable == set(adapters)
    # r * (in + out) per adapted HF linear
    hf = load_model(str(tiny_model))
    want = sum(4 * (m.in_features + m.out_features) for n, m in hf.named_modules()
               if n.endswith(("_proj",)) and isinstance(m, torch.nn.Linear))
    optimized = [p for g in mt.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in optimized) == sum(p.numel() for p in adapters.values()) == want
    base = {n: t.clone() for b in mt.hf_buckets(merged=False) for n, t in b}
    samples = make_samples()
    mt.train_sft(samples)
    for n, p in mt.model.named_parameters():  # DDP gave grad buffers to the adapters only
        assert hasattr(p, "main_grad") == p.requires_grad == (".lora." in n), n
        assert p.grad is None or ".lora." in n, n
    state = mt.optimizer.optimizer.state  # the torch Adam inside Megatron's optimizer
    assert sum(v["exp_avg"].numel() for v in state.values()) == want  # Adam state for the adapters only
    after = {n: t for b in mt.hf_buckets(merged=False) for n, t in b}
    ckpt = HFCheckpoint(tiny_model)
    assert all(torch.equal(after[k], base[k]) and torch.equal(after[k], ckpt.get(k)) for k in base)  # base untouched
    assert any(p.abs().sum() > 0 for n, p in adapters.items() if n.endswith(".B"))  # B moved off zero
    # merged export (--lora-sync merged) = peft's merge_and_unload of the exported adapter
    folder = mt.save_adapter(tmp_path / "adapter")
    merged_ref = PeftModel.from_pretrained(load_model(str(tiny_model)), str(folder)).merge_and_unload().state_dict()
    merged = dict(mt.named_tensors())
    assert set(merged) == set(ckpt.keys())
    worst = max((merged[k] - merged_ref[k]).abs().max().item() for k in merged)
    assert worst < 1e-6, worst
    assert any(not torch.equal(merged[k], ckpt.get(k)) for k in merged)


@pytest.mark.parametrize("whole", [["none"], ["auto"]])
def test_checkpoint_resumes_adapter_and_optimizer(tiny_model, tmp_path, whole):
    """(auto: the tiny model's embeddings and final norm trained whole, their Adam state resumed too.)"""
    from safetensors.torch import load_file

    samples = make_samples()
    mt = megatron(tiny_model, target_modules=ALL, lora_trainable_modules=whole)
    mt.train_sft(samples)
    mt.save(tmp_path / "ckpt", {"rollout_id": 1})
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"model", "adapter", "megatron", "trainer_state.json"} <= files
    # model/ is the frozen base (what engines and the resumed trainer start from; the modules trained
    # whole as trained), adapter/ the peft adapter
    base = load_file(str(tmp_path / "ckpt" / "model" / "model.safetensors"))
    from agentrl.trainers.megatron.weights import HFCheckpoint
    trained = dict(mt.trained_module_tensors())
    assert sorted(trained) == ([] if whole == ["none"] else ["model.embed_tokens.weight", "model.norm.weight"])
    assert all(torch.equal(base[k], trained[k] if k in trained else HFCheckpoint(tiny_model).get(k)) for k in base)
    mt.train_sft(samples)  # the step a resumed run must reproduce (Adam's moments included)
    want = mt.compute_logprobs(samples)

    resumed = megatron(tmp_path / "ckpt" / "model", target_modules=ALL, lora_trainable_modules=whole)
    assert resumed.load(tmp_path / "ckpt")["rollout_id"] == 1 and resumed.version == 1
    adapter = load_file(str(tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors"))
    from agentrl.trainers.megatron.lora import gather_adapter
    got = gather_adapter(resumed.model)
    assert set(got) == set(adapter) and all(torch.equal(got[k], adapter[k]) for k in got)
    resumed.train_sft(samples)
    print(f"resumed step vs continued: {max_diff(resumed.compute_logprobs(samples), want):.1e}")
    assert max_diff(resumed.compute_logprobs(samples), want) < 1e-6
    # a full-weight checkpoint cannot resume a LoRA run
    plain = MegatronTrainer(str(tiny_model), train=TrainConfig(lr=1e-3, global_batch_size=6, micro_batch_size=2),
                            algo=AlgoConfig(), temperature=0.8, device="cpu", dtype="float32")
    plain.save(tmp_path / "full", {"rollout_id": 0})
    with pytest.raises(FileNotFoundError, match="adapter"):
        megatron(tiny_model, target_modules=ALL).load(tmp_path / "full")


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
@pytest.mark.slow
def test_parallel_layouts_equal_one_process(tiny_model, tmp_path, layout):
    """TP=2 (+ SP): column layers' B and row layers' A split over the ranks; PP=2: each stage its
    layers. The same adapter (loaded from one peft folder) gives the one-process logprobs, loss,
    grad norm, and after the step the same exported adapter. The tiny model's embeddings and final
    norm train whole too (--lora-trainable-modules auto): the embedding split over the vocabulary
    (TP), the final norm's gradient summed over SP's ranks, and (PP) the tied LM head's copy on the
    last stage, its gradient summed with the first stage's: the same trained modules."""
    from safetensors.torch import load_file

    start = megatron(tiny_model, target_modules=ALL)
    randomize(start, seed=5)
    folder = start.save_adapter(tmp_path / "start")
    ref = megatron(tiny_model, target_modules=ALL, lr=PARALLEL_LR, lora_trainable_modules=["auto"])
    ref.load_adapter_weights(folder)
    samples = make_samples()
    before = ref.compute_logprobs(samples)
    metrics = ref.train_sft(samples)
    after = ref.compute_logprobs(samples)
    ref.save_adapter(tmp_path / "ref_after")
    ref_whole = dict(ref.trained_module_tensors())

    args = {"tp2_sp": {"tensor_model_parallel_size": "2", "sequence_parallel": None},
            "pp2": {"pipeline_model_parallel_size": "2"}}[layout]
    result = run_ranks(2, ["--megatron", json.dumps(args), "--adapter", str(folder), "--lr", str(PARALLEL_LR),
                           "--save", str(tmp_path / "after"), "--whole", "auto"], tmp_path / "out.json",
                       worker="megatron_lora_worker.py")
    print(f"{layout}: loss {result['metrics']['loss']:.6f} vs {metrics['loss']:.6f}; grad norm "
          f"{result['metrics']['grad_norm']:.6f} vs {metrics['grad_norm']:.6f}")
    # TP=2 splits every matmul's reduction over two ranks: another fp32 summation order. Seen on
    # a 2-core machine: logprobs 2.1e-5 apart (|logprob| ~6), grad norm 6.5e-6 relative
    assert max_diff(result["before"], before) < 5 * LOGPROB_TOL
    for key in ("loss", "grad_norm"):
        assert result["metrics"][key] == pytest.approx(metrics[key], rel=3e-5), key
    assert max_diff(result["after"], after) < STEP_TOL
    mine, theirs = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("after", "ref_after"))
    assert set(mine) == set(theirs)
    assert max((mine[k] - theirs[k]).abs().max().item() for k in mine) < STEP_TOL
    whole = load_file(str(tmp_path / "after" / "whole.safetensors"))
    assert sorted(whole) == sorted(ref_whole) == ["model.embed_tokens.weight", "model.norm.weight"]
    from agentrl.trainers.megatron.weights import HFCheckpoint
    base = HFCheckpoint(tiny_model)
    for k in whole:  # each moved by its Adam step (~lr an element), as the one process's did
        mine_moved, ref_moved = whole[k] - base.get(k), ref_whole[k] - base.get(k)
        print(f"{layout} {k}: moved {ref_moved.norm():.2e}, apart {(mine_moved - ref_moved).norm():.2e}")
        assert ref_moved.abs().max() > 0.5 * PARALLEL_LR
        assert (mine_moved - ref_moved).norm() < 0.05 * ref_moved.norm()
    assert result["merged_matches"]


@pytest.mark.slow
def test_megatron_lora_learns_target_token(tiny_model):
    learn_target_token(megatron(tiny_model, target_modules=ALL, lr=2e-2, global_batch_size=8, micro_batch_size=4))


# -- --lora-trainable-modules: whole modules trained beside the adapters ------------------------
WHOLE = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]  # `auto` on the tiny model


def test_trainable_modules_take_hf_names(tiny_model):
    """The HF names peft's modules_to_save takes, mapped to Megatron's parameters; a module Megatron
    fuses with others trains only with all of them; a name that matches nothing is refused."""
    from transformers import AutoConfig

    from agentrl.errors import ConfigError
    from agentrl.trainers.megatron.families import family_for
    from agentrl.trainers.megatron.families.common import Layout
    from agentrl.trainers.megatron.lora import whole_trained

    hf_config = AutoConfig.from_pretrained(tiny_model)
    family, layers = family_for(hf_config), hf_config.num_hidden_layers
    layout = Layout.from_hf(hf_config, 1, padded_vocab=hf_config.vocab_size)

    def trained(*names):
        return whole_trained(list(names), family, layout, layers)

    assert trained("embed_tokens", "model.norm") == set(WHOLE)
    assert trained("input_layernorm") == {f"decoder.layers.{i}.input_layernorm.weight" for i in range(layers)}
    assert trained("layers.1.mlp") == {"decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc2.weight"}
    assert trained("q_proj", "k_proj", "v_proj") == {f"decoder.layers.{i}.self_attention.linear_qkv.{w}"
                                                     for i in range(layers) for w in ("weight", "bias")}
    assert trained("norm") == {"decoder.final_layernorm.weight"}  # a name's end at a dot: not input_layernorm
    with pytest.raises(ConfigError, match=r"q_proj.*linear_qkv.*k_proj"):
        trained("q_proj")
    with pytest.raises(ConfigError, match=r"no module \['lm_head'\] \(its LM head is the tied embed_tokens\)"):
        trained("lm_head")
    with pytest.raises(ConfigError, match=r"no module \['model.nrom'\]"):
        trained("model.norm", "model.nrom")


def test_trainable_modules_train_and_the_rest_stays_frozen(tiny_model):
    from agentrl.trainers.megatron.weights import HFCheckpoint

    mt = megatron(tiny_model, target_modules=SOME, lora_trainable_modules=["auto"])
    named = dict(mt.model.named_parameters())
    adapters = {n for n in named if ".lora." in n}
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable == adapters | set(WHOLE)
    optimized = {id(p) for g in mt.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(named[n]) for n in trainable}
    ckpt = HFCheckpoint(tiny_model)
    mt.train_sft(make_samples())
    state = mt.optimizer.optimizer.state
    assert sum(v["exp_avg"].numel() for v in state.values()) == sum(named[n].numel() for n in trainable)
    after = {n: t for b in mt.hf_buckets(merged=False) for n, t in b}
    moved = {k for k in after if not torch.equal(after[k], ckpt.get(k))}
    assert moved == {"model.embed_tokens.weight", "model.norm.weight"}  # the rest of the base did not move
    whole = dict(mt.trained_module_tensors())
    assert list(whole) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert all(torch.equal(whole[k], after[k]) for k in whole)


def test_trainable_modules_step_matches_the_pytorch_trainer(tiny_model, tmp_path):
    """The same adapter and the tiny model's embeddings and final norm trained whole: one GRPO step
    of the Megatron trainer equals peft's (modules_to_save) in the PyTorch trainer."""
    from agentrl.trainers.torch_trainer import TorchTrainer

    train = lora_train(lr=1e-3, target_modules=ALL, lora_trainable_modules=["auto"])
    mt = MegatronTrainer(str(tiny_model), train=train, algo=AlgoConfig(), temperature=0.8, device="cpu",
                         dtype="float32")
    randomize(mt, seed=7)
    folder = mt.save_adapter(tmp_path / "start")
    tt = TorchTrainer(str(tiny_model), train=train, algo=AlgoConfig(), temperature=0.8)
    tt.load_adapter_weights(folder)
    samples = make_samples()
    start = tt.compute_logprobs(samples)
    assert max_diff(mt.compute_logprobs(samples), start) < PEFT_TOL
    before = {k: t.clone() for k, t in tt.trained_module_tensors()}
    m1, m2 = mt.train_rollout(samples), tt.train_rollout(samples)
    print(f"grad norm megatron {m1['grad_norm']:.6f} torch {m2['grad_norm']:.6f}")
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
    # Adam's first step is about lr * sign(grad): a near-zero gradient element summed in another
    # order (the CPU's thread count) moves by up to lr either way, so the two steps agree to a
    # small part of what the step moved the logprobs, not to a fixed 1e-4 (CI: 3.5e-4 once)
    after = tt.compute_logprobs(samples)
    step = max_diff(after, start)
    print(f"logprobs moved by {step:.6f}; megatron vs torch after the step {max_diff(mt.compute_logprobs(samples), after):.6f}")
    assert step > 10 * STEP_TOL
    assert max_diff(mt.compute_logprobs(samples), after) < max(STEP_TOL, 0.01 * step)
    mine, theirs = dict(mt.trained_module_tensors()), dict(tt.trained_module_tensors())
    assert list(mine) == list(theirs) == ["model.embed_tokens.weight", "model.norm.weight"]
    for k in mine:
        moved = (theirs[k] - before[k]).abs().max().item()
        assert moved > 0.5e-3, k  # Adam's first step: about lr
        assert (mine[k] - theirs[k]).abs().max().item() < 0.1 * moved, k


def test_adapter_sync_sends_the_adapter_and_the_trained_modules(tiny_model, tokenizer, tmp_path):
    """--lora-sync adapter from the Megatron trainer: the engine gets exactly the peft adapter (its
    folder) plus the modules trained whole (by the full-weight path), and samples on policy."""
    from safetensors.torch import load_file

    from agentrl.config import parse_config
    from agentrl.engines.embedded import EmbeddedEngine

    cfg, _ = parse_config(["--trainer", "megatron", "--lora-rank", "4", "--lora-alpha", "8", "--lora-sync", "adapter",
                           "--output-dir", str(tmp_path)])
    assert cfg.train.lora_trainable_modules == ["embed_tokens", "model.norm"]  # auto: as the PyTorch trainer's
    mt = megatron(tiny_model, target_modules=ALL, lora_trainable_modules=cfg.train.lora_trainable_modules)
    randomize(mt, seed=2)
    with torch.no_grad():  # trained modules off the base's (not far: randomize's adapters are large already,
        mt.model.decoder.final_layernorm.weight.mul_(1.5)  # and larger logits amplify fp32 rounding)
        mt.model.embedding.word_embeddings.weight.mul_(1.5)
    engine = EmbeddedEngine(str(tiny_model), enable_lora=True, prefix_cache_tokens=4096)
    full_path = []
    load_named = engine._load_named
    engine._load_named = lambda named: (full_path.extend(n for n, _ in named), load_named(named))
    prompt = tokenizer.encode("tell me about the river")

    stats, sample = sync_adapter_and_sample(cfg, mt, engine, prompt, temperature=0.8)
    assert stats["failed_engines"] == [] and stats["weight_sync_modules_mb"] > 0
    assert full_path == ["model.embed_tokens.weight", "model.norm.weight"]
    adapter = load_file(str(tmp_path / "lora_sync" / "v1" / "adapter_model.safetensors"))
    assert set(adapter) == set(megatron_trainer_adapter_keys(mt))
    torch.testing.assert_close(engine.model.model.norm.weight, mt.model.decoder.final_layernorm.weight.detach())
    torch.testing.assert_close(engine.model.model.embed_tokens.weight, mt.model.embedding.word_embeddings.weight.detach())
    diff = max(abs(a - b) for a, b in zip(mt.compute_logprobs([sample])[0], sample.rollout_logprobs))
    print(f"engine vs trainer logprob: {diff:.1e}")
    assert diff < PEFT_TOL


def megatron_trainer_adapter_keys(mt):
    """peft's names of every adapter matrix of the trainer (all-linear)."""
    from agentrl.trainers.megatron.lora import peft_key

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return [peft_key(i, m, w) for i in range(mt.hf_config.num_hidden_layers) for m in modules for w in "AB"]
