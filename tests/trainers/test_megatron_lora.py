"""LoRA on the Megatron trainer (CPU, gloo; megatron_cpu_shim.py): adapters on the fused linears
export as a peft adapter that peft itself loads onto the HF model and that gives the Megatron
model's logprobs; the base is frozen (the optimizer holds the adapters only); the merged export
equals peft's merge; TP=2 + SP and PP=2 give the one-process figures and the same adapter;
checkpoints resume the adapter and its optimizer state; LoRA learns a target token by RL.

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
from test_lora import learn_target_token, randomize_adapter  # noqa: E402

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
    return TrainConfig(**{"lr": 1e-2, "global_batch_size": 6, "micro_batch_size": 2, "lora_rank": 4,
                          "lora_alpha": 8.0, **kw})


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


def test_checkpoint_resumes_adapter_and_optimizer(tiny_model, tmp_path):
    from safetensors.torch import load_file

    samples = make_samples()
    mt = megatron(tiny_model, target_modules=ALL)
    mt.train_sft(samples)
    mt.save(tmp_path / "ckpt", {"rollout_id": 1})
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"model", "adapter", "megatron", "trainer_state.json"} <= files
    # model/ is the frozen base (what engines and the resumed trainer start from), adapter/ the peft adapter
    base = load_file(str(tmp_path / "ckpt" / "model" / "model.safetensors"))
    from agentrl.trainers.megatron.weights import HFCheckpoint
    assert all(torch.equal(base[k], HFCheckpoint(tiny_model).get(k)) for k in base)
    mt.train_sft(samples)  # the step a resumed run must reproduce (Adam's moments included)
    want = mt.compute_logprobs(samples)

    resumed = megatron(tmp_path / "ckpt" / "model", target_modules=ALL)
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
def test_parallel_layouts_equal_one_process(tiny_model, tmp_path, layout):
    """TP=2 (+ SP): column layers' B and row layers' A split over the ranks; PP=2: each stage its
    layers. The same adapter (loaded from one peft folder) gives the one-process logprobs, loss,
    grad norm, and after the step the same exported adapter."""
    from safetensors.torch import load_file

    start = megatron(tiny_model, target_modules=ALL)
    randomize(start, seed=5)
    folder = start.save_adapter(tmp_path / "start")
    ref = megatron(tiny_model, target_modules=ALL, lr=PARALLEL_LR)
    ref.load_adapter_weights(folder)
    samples = make_samples()
    before = ref.compute_logprobs(samples)
    metrics = ref.train_sft(samples)
    after = ref.compute_logprobs(samples)
    ref.save_adapter(tmp_path / "ref_after")

    args = {"tp2_sp": {"tensor_model_parallel_size": "2", "sequence_parallel": None},
            "pp2": {"pipeline_model_parallel_size": "2"}}[layout]
    result = run_ranks(2, ["--megatron", json.dumps(args), "--adapter", str(folder), "--lr", str(PARALLEL_LR),
                           "--save", str(tmp_path / "after")], tmp_path / "out.json",
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
    assert result["merged_matches"]


def test_megatron_lora_learns_target_token(tiny_model):
    learn_target_token(megatron(tiny_model, target_modules=ALL, lr=2e-2, global_batch_size=8, micro_batch_size=4))
