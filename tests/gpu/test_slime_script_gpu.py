"""A slime launch script's arguments, unchanged, through `agentrl train` on GPUs (issue 33):
slime's examples/fully_async/run-qwen2.5-0.5B-fully_async.sh as tests/data/slime_scripts/
holds it (its scripts/models/qwen2.5-0.5B.sh sourced), on a random-init model of
Qwen2.5-0.5B's shape (so every model-shape flag checks equal) with the tiny tokenizer.

Changed, and only these: the script's /root and /tmp paths point at this test's model and
data; `--async` is appended, since the script runs slime's train_async.py, whose agentrl
equivalent it is (docs/slime.md); `--rollout-num-gpus 1` (the script gives 7 of 8 GPUs) is
appended; and SGLang's kernel backends of the kit (gpu_helpers.SGLANG). Its `--ref-load`
torch_dist is not read (`--kl-loss-coef 0.00`: no KL term, as in slime). slime's rollout function
(`slime.rollout.fully_async_rollout`) runs when AGENTRL_SLIME_SRC names a slime checkout
(on PYTHONPATH for the run); without one the script's hook is dropped and agentrl's own
rollout plays its part (said in the output). Checks: what ran is what slime runs (Megatron,
SGLang, bf16, the deepscaler reward), every iteration trained, engine and trainer logprobs
agree. Bounded at 400 s (it takes about half that: two processes' start, 3 iterations of
32 x 1024 tokens on a 0.5B shape)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from gpu_helpers import KIT, OUT, SGLANG, agentrl_train, needs_gpus, random_model, tiny_qwen2_config, trajectories

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the checked-in script arguments
from slime_scripts import HF_CONFIGS, checked_in  # noqa: E402

pytestmark = needs_gpus(2, "the slime script scenario needs 2 GPUs (trainer and engine apart)")


def qwen25_05b_shape() -> Path:
    """Random-init Qwen2.5-0.5B (its config.json's shape, vocab 151936) with the tiny tokenizer."""
    shape = {k: v for k, v in HF_CONFIGS["fully-async"].items() if k != "model_type"}
    return random_model(KIT / "models" / "qwen2.5-0.5b-shape-tinytok", lambda: tiny_qwen2_config(shape, max_positions=None))


def test_fully_async_script_runs_unchanged(tmp_path):
    root = tmp_path / "fs"
    args = [str(root) + a if a.startswith(("/root/", "/tmp/")) else a for a in checked_in("fully-async")]
    model = Path(args[args.index("--hf-checkpoint") + 1])
    model.parent.mkdir(parents=True, exist_ok=True)
    model.symlink_to(qwen25_05b_shape(), target_is_directory=True)
    data = Path(args[args.index("--prompt-data") + 1])
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer in "
                                                    "\\boxed{}."}], "label": str(a + b)}) + "\n"
                            for a in range(8) for b in range(8)))
    slime = os.environ.get("AGENTRL_SLIME_SRC")
    if slime:
        os.environ["PYTHONPATH"] = f"{slime}:{os.environ.get('PYTHONPATH', '')}"
    else:
        i = args.index("--rollout-function-path")
        print(f"no AGENTRL_SLIME_SRC: dropping the script's {args[i]} {args[i + 1]} (agentrl's rollout instead)")
        del args[i:i + 2]
    run, rows = agentrl_train("slime_fully_async", *args, "--async", "--rollout-num-gpus", "1", *SGLANG,
                              timeout_s=400)
    cfg = (run / "config.yaml").read_text()
    for line in ("trainer: megatron", "rollout_engine: sglang", "dtype: bfloat16", "rm_type: deepscaler",
                 "env: slime", "balance_data: true", "async_rollout: true"):
        assert line in cfg, line
    assert len(rows) == 3 and all(r["trained_samples"] == 32 for r in rows), rows
    rewards = {t["reward"] for i in range(3) for t in trajectories(run, i)}
    assert rewards <= {0, 0.0, 1, 1.0}, rewards  # deepscaler's 1/0
    diffs = [r["train_rollout_logprob_abs_diff"] for r in rows]
    print(f"logprob |engine - trainer| per iteration: {diffs}; iteration s: {[round(r['iteration_s'], 1) for r in rows]}")
    assert max(diffs) < 0.05, diffs
    (OUT / "slime_fully_async.config.yaml").write_text(cfg)
