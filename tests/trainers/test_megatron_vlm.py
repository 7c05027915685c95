"""The Megatron trainer on a vision-language model (one CPU process, gloo; megatron_cpu_shim.py):
a tiny random Qwen2-VL (models.build_tiny_vlm) built as megatron-core's GPTModel with multimodal
RoPE plus the HF vision tower (trainers/megatron/vision.py). Its logprobs with an image equal the
HF model's own (Qwen2VLForConditionalGeneration with pixel_values) on a micro-batch packing a
sample with an image and one without (Qwen2.5-VL too); HF weights load and export exactly,
`visual.*` included; a training step moves the loss and the tower; a distributed checkpoint resumes
exactly; TP=2 with sequence parallelism and DP=2 (two gloo ranks) take the one-process step; and
`agentrl train --trainer megatron` learns the colour-parity task only the image tells."""

import pytest
import torch

megatron_trainer = pytest.importorskip("agentrl.trainers.megatron.trainer")  # imports megatron-core

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

from agentrl.config import AlgoConfig, TrainConfig  # noqa: E402
from agentrl.errors import ConfigError  # noqa: E402
from megatron_helpers import (image_sample, make_vlm_samples, one_process_reference, run_ranks,  # noqa: E402
                              text_sample)

MegatronTrainer = megatron_trainer.MegatronTrainer
LOGPROB_TOL = 1e-5
TEMPERATURE = 0.8


def make(vlm, **train) -> MegatronTrainer:
    tc = TrainConfig(lr=1e-2, global_batch_size=2, **{"max_tokens_per_gpu": 512, **train})
    return MegatronTrainer(str(vlm), train=tc, algo=AlgoConfig(), temperature=TEMPERATURE, device="cpu",
                           dtype="float32")


def hf_logprobs(model, processor, samples) -> list[list[float]]:
    """The HF model's own forward, one sample at a time (an image sample: pixel_values,
    image_grid_thw and the processor's mm_token_type_ids, as transformers runs it)."""
    from agentrl.vision import pixel_inputs

    out = []
    for s in samples:
        ids = torch.tensor([s.tokens])
        kwargs = {}
        if s.images:
            kwargs = dict(pixel_inputs(processor, s.images), mm_token_type_ids=(ids == processor.image_token_id).int())
        with torch.no_grad():
            logits = model(input_ids=ids, **kwargs).logits[0].float() / TEMPERATURE
        p = len(s.prompt_tokens)
        logp = torch.log_softmax(logits[p - 1:-1], -1).gather(-1, torch.tensor(s.response_tokens)[:, None])
        out.append(logp[:, 0].tolist())
    return out


def max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_logprobs_with_an_image_equal_the_hf_models_in_one_packed_micro_batch(vlm, processor):
    from transformers import Qwen2VLForConditionalGeneration

    mt = make(vlm)
    samples = [image_sample(processor, "red", [40, 41, 42, 43]), text_sample(processor, [50, 51, 52])]
    (batch,) = mt._batches(samples, [0, 1])  # both samples in one packed micro-batch
    assert batch.indices == [0, 1] and batch.position_ids.shape == (3, 1, batch.num_tokens)
    assert int(batch.images.mask.sum()) == 6 and batch.images.grid_thw.tolist() == [[1, 6, 4]]
    ours = mt.compute_logprobs(samples)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(str(vlm), dtype=torch.float32).eval()
    ref = hf_logprobs(hf, processor, samples)
    print(f"tiny qwen2-vl: max |megatron - hf| logprob = {max_diff(ours, ref):.2e}")
    assert max_diff(ours, ref) < LOGPROB_TOL
    # the image is read: another colour, other logprobs (the text sample's stay the same)
    blue = mt.compute_logprobs([image_sample(processor, "blue", [40, 41, 42, 43]), samples[1]])
    assert max_diff(blue[:1], ours[:1]) > 1e-3 and max_diff(blue[1:], ours[1:]) < 1e-6


def tiny_qwen2_5_vl(folder, vlm):
    """A random tiny Qwen2.5-VL (windowed vision attention, an RMSNorm'd tower, untied LM head) with
    the tiny Qwen2-VL's tokenizer and processor."""
    import json
    import shutil

    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    shutil.copytree(vlm, folder)
    qwen2 = json.loads((folder / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "model.safetensors").unlink()
    text = {k: qwen2["text_config"][k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                "num_attention_heads", "num_key_value_heads", "rope_parameters",
                                                "eos_token_id", "pad_token_id")}
    torch.manual_seed(2)
    config = Qwen2_5_VLConfig(
        text_config={**text, "tie_word_embeddings": False}, tie_word_embeddings=False,
        vision_config=dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=8, fullatt_block_indexes=[1]),
        **{k: qwen2[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")})
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder)
    return folder


def test_qwen2_5_vl_logprobs_equal_the_hf_models(vlm, processor, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from agentrl.trainers.megatron.weights import HFCheckpoint

    path = tiny_qwen2_5_vl(tmp_path / "qwen2_5_vl", vlm)
    mt = make(path)
    assert mt.family.name == "qwen2_5_vl" and not mt.layout.tied
    samples = [text_sample(processor, [50, 51, 52]), image_sample(processor, "blue", [40, 41, 42, 43])]
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    diff = max_diff(mt.compute_logprobs(samples), hf_logprobs(hf, processor, samples))
    print(f"tiny qwen2.5-vl: max |megatron - hf| logprob = {diff:.2e}")
    assert diff < LOGPROB_TOL
    exported, ckpt = dict(mt.named_tensors()), HFCheckpoint(path)
    assert sorted(exported) == sorted(ckpt.keys()) and "lm_head.weight" in exported
    assert all(torch.equal(exported[n], ckpt.get(n)) for n in exported)


def test_an_image_token_the_model_wrote_stays_text(vlm, processor):
    """As the engine fed it (and the torch trainer computes it): only the prompt's placeholders are images."""
    from agentrl.trainers.torch_trainer import TorchTrainer

    mt = make(vlm)
    samples = [image_sample(processor, "red", [40, processor.image_token_id, 42]), text_sample(processor, [50, 51])]
    (batch,) = mt._batches(samples, [0, 1])
    assert int(batch.images.mask.sum()) == 6
    tt = TorchTrainer(str(vlm), train=TrainConfig(lr=1e-3), algo=AlgoConfig(), temperature=TEMPERATURE)
    assert max_diff(mt.compute_logprobs(samples), tt.compute_logprobs(samples)) < LOGPROB_TOL


def test_hf_weights_load_and_export_exactly_and_a_step_moves_the_loss_and_the_tower(vlm, processor, tmp_path):
    from transformers import Qwen2VLForConditionalGeneration

    from agentrl.trainers.megatron.weights import HFCheckpoint

    mt = make(vlm)
    ckpt = HFCheckpoint(vlm)
    exported = dict(mt.named_tensors())  # what the weight sync sends: the checkpoint's names, visual.* too
    assert sorted(exported) == sorted(ckpt.keys()) and any(n.startswith("visual.") for n in exported)
    assert all(torch.equal(exported[n], ckpt.get(n)) for n in exported)

    samples = [image_sample(processor, "red", [40, 41, 42, 43]), text_sample(processor, [50, 51, 52])]
    before = mt.compute_logprobs(samples)
    metrics = mt.train_sft(samples)  # one optimizer step on the NLL of the response tokens
    after = mt.compute_logprobs(samples)
    mean = lambda rows: sum(x for r in rows for x in r) / sum(len(r) for r in rows)  # noqa: E731
    print(f"sft step: loss {metrics['loss']:.4f}, mean logprob {mean(before):.4f} -> {mean(after):.4f}")
    assert mean(after) > mean(before) + 0.05
    moved = {n for n, t in mt.named_tensors() if not torch.equal(t, ckpt.get(n))}
    assert any(n.startswith("visual.") for n in moved) and "model.embed_tokens.weight" in moved

    # the trained model saved as an HF checkpoint: transformers loads it and gives the trainer's logprobs
    folder = mt.save_hf(tmp_path / "hf")
    assert (folder / "preprocessor_config.json").exists()
    hf = Qwen2VLForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert max_diff(hf_logprobs(hf, processor, samples), after) < LOGPROB_TOL


def test_a_checkpoint_in_transformers_4_5x_names_loads_the_same(vlm, processor, tmp_path):
    """`model.language_model.*` / `model.visual.*` (what transformers 4.52-4.57 saved): the same
    weights; the export keeps the names the engines take (`model.layers.*`, `visual.*`)."""
    import shutil

    from safetensors.torch import load_file, save_file

    old = tmp_path / "old-names"
    shutil.copytree(vlm, old)
    tensors = load_file(str(old / "model.safetensors"))
    renamed = {("model.language_model." + n[6:] if n.startswith("model.") else "model." + n): t
               for n, t in tensors.items()}
    assert len(renamed) == len(tensors) and "model.visual.patch_embed.proj.weight" in renamed
    save_file(renamed, str(old / "model.safetensors"), metadata={"format": "pt"})
    samples = [image_sample(processor, "red", [40, 41, 42, 43]), text_sample(processor, [50, 51, 52])]
    a, b = make(vlm), make(old)
    assert max_diff(a.compute_logprobs(samples), b.compute_logprobs(samples)) == 0
    assert sorted(n for n, _ in b.named_tensors()) == sorted(tensors)


def test_a_checkpoint_resumes_exactly_the_tower_included(vlm, processor, tmp_path):
    """The distributed checkpoint holds the tower (`visual.*`, replicated) and its optimizer state: a
    trainer started from the checkpoint's HF copy and loaded from it takes the same next step."""
    from megatron.core import dist_checkpointing

    samples = [image_sample(processor, "red", [40, 41, 42, 43]), text_sample(processor, [50, 51, 52])]
    a = make(vlm)
    a.train_sft(samples)
    a.save(tmp_path / "ckpt", {"rollout_id": 1})
    saved = dist_checkpointing.load_tensors_metadata(str(tmp_path / "ckpt" / "megatron"))
    assert any(k.startswith("visual.") for k in saved)
    a.train_sft(samples)
    b = make(tmp_path / "ckpt" / "model")
    b.load(tmp_path / "ckpt")
    b.train_sft(samples)
    assert max_diff(b.compute_logprobs(samples), a.compute_logprobs(samples)) < 1e-6


def test_layouts_the_vision_tower_is_not_wired_for_are_refused(vlm):
    for margs, flag in [({"pipeline_model_parallel_size": "2"}, "--pipeline-model-parallel-size"),
                        ({"context_parallel_size": "2"}, "--context-parallel-size")]:
        with pytest.raises(ConfigError, match=flag):
            MegatronTrainer(str(vlm), train=TrainConfig(), algo=AlgoConfig(), temperature=1.0, device="cpu",
                            dtype="float32", megatron_args=margs)
    with pytest.raises(ConfigError, match="--lora-rank with a vision-language model"):
        MegatronTrainer(str(vlm), train=TrainConfig(lora_rank=4), algo=AlgoConfig(), temperature=1.0, device="cpu",
                        dtype="float32")


# -- two ranks (gloo), against the one-process trainer -----------------------------------------------
ALGO = {"entropy_coef": 0.01, "use_tis": True, "tis_clip": 1.5}  # a loss that is not ~0 on-policy


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2_sp", "dp2"])
def test_two_ranks_take_the_one_process_step(vlm, processor, tmp_path, layout):
    """TP=2 with sequence parallelism (the image embeddings scattered with the sequence; every TP rank
    runs the tower on every image, its gradient the whole one) and DP=2 (each rank its share of the
    samples, the tower's gradients all-reduced): the one-process logprobs, loss, grad norm and step."""
    import json

    reference = one_process_reference(vlm, ALGO, make_vlm_samples(processor))
    megatron = {"tensor_model_parallel_size": "2", "sequence_parallel": None} if layout == "tp2_sp" else {}
    result = run_ranks(2, ["--model", str(vlm), "--vision", "--megatron", json.dumps(megatron), "--algo",
                           json.dumps(ALGO)], tmp_path / f"{layout}.json")
    m, r = result["metrics"], reference["metrics"]
    print(f"{layout}: loss {m['loss']:.6f} vs {r['loss']:.6f}; grad norm {m['grad_norm']:.6f} vs "
          f"{r['grad_norm']:.6f}; logprobs after the step {max_diff(result['after'], reference['after']):.1e}")
    assert result["roundtrip"] and result["names"] == reference["names"]
    assert max_diff(result["before"], reference["before"]) < LOGPROB_TOL
    for key in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert m[key] == pytest.approx(r[key], rel=1e-5, abs=1e-7), key
    assert max_diff(result["after"], reference["after"]) < 1e-4


@pytest.mark.e2e
@pytest.mark.slow
def test_agentrl_train_with_the_megatron_trainer_learns_what_only_the_image_tells(vlm, tmp_path):
    """tests/test_vision.py's colour-parity run (vision_helpers.colour_parity_task: an image-blind
    policy scores 0.5) with `--trainer megatron` (in its Ray actor on CPU: megatron_cpu_shim.child_env):
    the reward climbs well above 0.5, and every weight check finds the engine's logprobs (weights
    synced from the Megatron model's HF export, `visual.*` included) equal to the trainer's."""
    import subprocess

    from spine_helpers import agentrl_cli, run_env
    from vision_helpers import assert_learned_the_colours, colour_parity_task

    env = megatron_cpu_shim.child_env(run_env())
    env["PYTHONPATH"] = ":".join([env["PYTHONPATH"], str(tmp_path)])
    out = tmp_path / "run"
    proc = subprocess.run([agentrl_cli(), "train", *colour_parity_task(tmp_path, vlm, out), "--trainer", "megatron",
                           "--max-tokens-per-gpu", "4096"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = assert_learned_the_colours(out)
    print("megatron colour parity rewards:", [round(r, 3) for r in rewards])
