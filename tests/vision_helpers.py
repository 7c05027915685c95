"""Images for the vision-language tests (tests/test_vision.py, tests/engines/test_vision_engine.py,
tests/trainers/test_megatron_vlm.py): one solid colour each, so a test knows what only the image
tells; and the colour-parity task their `agentrl train` runs learn."""

import io
import json
from pathlib import Path

COLOURS = {"red": (230, 20, 20), "blue": (20, 20, 230)}


def png(colour: str, size: tuple[int, int] = (16, 16)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, COLOURS[colour]).save(buf, format="PNG")
    return buf.getvalue()


PARITY_RM = '''
async def parity(args, sample, **kwargs):
    """1 when the reply's first token's parity is the image's colour (red: even, blue: odd)."""
    return float(bool(sample.response_tokens) and sample.response_tokens[0] % 2 == (sample.label == "blue"))
'''


def colour_parity_task(folder: Path, vlm: Path, out: Path) -> list[str]:
    """geo3k's flags (--input-key problem --label-key answer --multimodal-keys '{"image": "images"}',
    parquet rows of HF image dicts) on the colour-parity task: every prompt reads "<image>Which colour
    is this?", the image is red or blue, and the reward asks for an even first token on red and an odd
    one on blue, so an image-blind policy scores 0.5. Writes the data and the reward module
    (colour_rm.py) into `folder` (the caller puts it on PYTHONPATH); returns `agentrl train`'s arguments."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"problem": "<image>Which colour is this?", "answer": colour,
             "images": [{"bytes": png(colour), "path": None}]} for colour in ("red", "blue") * 4]
    pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    (folder / "colour_rm.py").write_text(PARITY_RM)
    return ["--model", str(vlm), "--prompt-data", str(folder / "train.parquet"), "--input-key", "problem",
            "--label-key", "answer", "--multimodal-keys", '{"image": "images"}', "--env", "slime",
            "--custom-rm-path", "colour_rm.parity", "--num-rollout", "20", "--rollout-batch-size", "8",
            "--n-samples-per-prompt", "8", "--global-batch-size", "64", "--rollout-max-response-len", "1",
            "--lr", "0.01", "--output-dir", str(out), "--no-progress"]


def assert_learned_the_colours(out: Path) -> list[float]:
    """The run's 20 iterations: every weight check's engine-vs-trainer logprobs within 1e-3, and the
    reward of the last 4 well above the image-blind 0.5. Returns the rewards."""
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 20
    checks = [m["weight_check/mean_abs_diff"] for m in metrics if "weight_check/mean_abs_diff" in m]
    assert checks and max(checks) < 1e-3, checks
    rewards = [m["reward_mean"] for m in metrics]
    assert sum(rewards[-4:]) / 4 > 0.75, rewards  # chance (or any image-blind policy): 0.5
    return rewards
