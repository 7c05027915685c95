"""`vlm_sglang`: vision-language RL (--multimodal-keys, agentrl/vision.py) against real SGLang
0.5.15 on one GPU: a random Qwen2-VL with Qwen2-VL's own image geometry (14-pixel patches, 2x2
merge: a 56x56 image is 4 tokens) and SGLang's head size (64), served colocated by SGLang, trained
on the GPU by the PyTorch trainer (`torch`) or the Megatron trainer (`megatron`: megatron-core's
GPTModel with multimodal RoPE and the HF vision tower inside, trainers/megatron/vision.py, its
micro-batches packed). The CPU end-to-end test's task (tests/test_vision.py): every
prompt reads "<image>Which colour is this?", the image is red or blue, and the reward asks for an
even first token on red and an odd one on blue, so any policy blind to the image scores 0.5.

Checked: SGLang expands each image to the processor's token count (the agent loop fails a
trajectory where it does not, so every trajectory completing says so), the trainer's logprobs of
SGLang's tokens with the images agree with SGLang's, the weight check's probe (with its images)
too, and the reward climbs above the image-blind 0.5.

    bash scripts/gpu/run.sh vlm_sglang                    (both trainers)
    bash scripts/gpu/run.sh "vlm_sglang and megatron"     (the Megatron trainer's)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from gpu_helpers import COLOCATE, KIT, OUT, SGLANG, agentrl_train, iters, mean, needs_gpus, trajectories

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the CPU test's colours and reward
from vision_helpers import COLOURS, PARITY_RM, png  # noqa: E402

pytestmark = needs_gpus()

# SGLang's kernels want head sizes of 64 and up; Qwen2-VL's mrope sections sum to half of it
TEXT = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]})
VISION = dict(depth=2, embed_dim=128, hidden_size=256, num_heads=2, patch_size=14)


# the Megatron trainer packs each step's 128 samples (~30 tokens each) into one micro-batch
TRAINERS = {"torch": [], "megatron": ["--max-tokens-per-gpu", "8192"]}


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_vlm_sglang_learns_what_only_the_image_tells(monkeypatch, trainer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from agentrl.models import build_tiny_vlm
    from agentrl.vision import load_processor, open_data_url

    model = build_tiny_vlm(KIT / "models" / "qwen2-vl-gpu", text=TEXT, vision=VISION)
    data = OUT / "vlm_data"
    data.mkdir(parents=True, exist_ok=True)
    rows = [{"problem": "<image>Which colour is this?", "answer": colour,
             "images": [{"bytes": png(colour, (56, 56)), "path": None}]} for colour in ("red", "blue") * 8]
    pq.write_table(pa.Table.from_pylist(rows), data / "train.parquet")
    (data / "colour_rm.py").write_text(PARITY_RM)
    monkeypatch.setenv("PYTHONPATH", ":".join(p for p in [str(data), os.environ.get("PYTHONPATH")] if p))
    n = iters(20)
    name = "vlm_sglang" if trainer == "torch" else f"vlm_sglang_{trainer}"
    run, rows = agentrl_train(
        name, "--model", str(model), "--trainer", trainer, *TRAINERS[trainer], "--device", "cuda",
        "--dtype", "bfloat16",
        # the vision tower's attention: triton (the kit's sgl_kernel has no FA3, SGLang's default there)
        *SGLANG, "--sglang-mm-attention-backend", "triton_attn", *COLOCATE,
        "--prompt-data", str(data / "train.parquet"), "--input-key", "problem",
        "--label-key", "answer", "--multimodal-keys", '{"image": "images"}', "--env", "slime",
        "--custom-rm-path", "colour_rm.parity", "--num-rollout", str(n), "--rollout-batch-size", "16",
        "--n-samples-per-prompt", "8", "--global-batch-size", "128", "--rollout-max-response-len", "1",
        "--lr", "3e-3", "--weight-check-interval", "1", timeout_s=560)
    rewards = [r["reward_mean"] for r in rows]
    diffs = [r["train_rollout_logprob_abs_diff"] for r in rows if "train_rollout_logprob_abs_diff" in r]
    checks = [r["weight_check/mean_abs_diff"] for r in rows if "weight_check/mean_abs_diff" in r]
    (OUT / f"{name}.json").write_text(json.dumps({"reward_mean": rewards, "logprob_abs_diff": diffs,
                                                  "weight_check": checks}))
    print(f"{trainer} trainer: reward:", " ".join(f"{x:.2f}" for x in rewards),
          "; engine-vs-trainer logprob diff:", " ".join(f"{x:.4f}" for x in diffs), "; weight check:", " ".join(f"{x:.4f}" for x in checks))
    assert len(rows) == n and all(r["status_failed"] == 0 for r in rows), [r.get("status_failed") for r in rows]
    assert diffs and max(diffs) < 0.05, diffs  # bf16 on both sides
    assert checks and max(checks) < 0.05, checks
    assert mean(rewards[-5:]) > 0.7, rewards  # any image-blind policy: 0.5
    first = trajectories(run, 0)[0]
    (image,) = first["images"]
    assert open_data_url(image).getpixel((0, 0)) == COLOURS[first["metadata"]["label"]]
    assert first["prompt_tokens"].count(load_processor(model).image_token_id) == 4
