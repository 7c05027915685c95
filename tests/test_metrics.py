"""Where metrics go: tensorboard always, wandb with --use-wandb (offline without an API key,
no network needed), and one summary line per iteration on the console."""

import json
import re
import struct
import subprocess

import pytest

from spine_helpers import agentrl_cli, run_env


def wandb_records(path):
    """The records of a wandb run file (run-<id>.wandb: a LevelDB-style log of 32 KiB blocks,
    each record a 7-byte header (crc, length, type) and a piece of a protobuf Record)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pieces, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        pieces += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            out.append(record)
            pieces = b""
    return out


@pytest.mark.e2e
def test_offline_wandb_run_holds_the_iteration_metrics_and_the_console_has_a_line_each(tmp_path):
    out = tmp_path / "run"
    env = run_env()
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        env.pop(key, None)
    proc = subprocess.run([agentrl_cli(), "train", "--use-wandb", "--wandb-project", "p", "--wandb-group", "g",
                           "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                           "--global-batch-size", "4", "--no-progress", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # the console's summary line, one per iteration, whole
        # target-token's: the best prompt-ignoring reward and the above-chance figure beside the reward
        start = (f"iter {m['rollout_id']}: reward {m['reward_mean']:.3f} (prompt-ignoring best 0.125)  "
                 f"above chance {m['env/above_chance_mean']:.3f}  len {m['response_len_mean']:.1f}  turns 1.0")
        assert re.search("^" + re.escape(start) + r".* tok/s  rollout [\d.]+s train [\d.]+s sync [\d.]+s$",
                         proc.stderr, re.M), proc.stderr[-2000:]
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list(out.rglob("*"))
    records = wandb_records(files[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "p" and run.run_group == "g" and run.display_name == "run"
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in records
               if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [0, 1]
    for h, m in zip(history, metrics):
        for key in ("reward_mean", "response_len_mean", "loss", "ppo_kl", "rollout_s", "policy_version"):
            assert h[key] == m[key], key


def test_console_line_per_iteration(capsys):
    from agentrl.progress import Progress

    progress = Progress(enabled=False)
    progress.iteration_done({"rollout_id": 3, "reward_mean": 0.25, "response_len_mean": 12.0, "turns_mean": 1.5,
                             "tokens_per_s": 900.0, "rollout_s": 1.25, "train_s": 0.5, "weight_sync_s": 0.04,
                             "status_failed": 2, "eval/easy/reward_mean": 0.75})
    line = capsys.readouterr().err.strip()
    assert line == ("iter 3: reward 0.250  len 12.0  turns 1.5  900 tok/s  rollout 1.2s train 0.5s sync 0.04s"
                    "  failed 2  eval easy 0.750")


def test_rollout_tok_s_is_over_the_requests_span_when_the_producer_ran_ahead(capsys):
    """--async: the producer makes the next batch while the trainer trains, so the loop's wait for
    it (rollout_s) is near zero; tok/s (metric and console) divides the tokens by the span of the
    requests that made them (first request to last reply), not by that wait (#34: 767k tok/s)."""
    import asyncio
    import time

    from agentrl.batches import rollout_metrics
    from agentrl.data import PromptSource
    from agentrl.progress import Progress
    from agentrl.rollout.producer import RolloutProducer
    from agentrl.types import Sample, SampleStatus
    from waiting import await_until

    GENERATE_S, TOKENS = 0.2, 50

    async def run_group(task, group_id, attempt):  # two trajectories, each one request, as the agent loop stamps it
        async def one(k):
            sample = Sample(prompt_tokens=[1], group_id=group_id, trajectory_id=f"g{group_id}-{k}", reward=float(k),
                            status=SampleStatus.COMPLETED)
            stages = sample.metadata.setdefault("stages", {})
            stages["first_request_at"] = time.time()
            await asyncio.sleep(GENERATE_S)  # the engine generating
            stages["last_reply_at"] = time.time()
            sample.append_generated([7] * TOKENS, [-1.0] * TOKENS, 0)
            return sample
        return list(await asyncio.gather(one(0), one(1)))

    async def main():
        producer = RolloutProducer(source=PromptSource([{"prompt": f"p{i}"} for i in range(10)], shuffle=False),
                                   run_group=run_group, over_sampling=2, keep_generating=True,
                                   report=lambda text: None)
        await producer.next_batch(2)  # batch 0; batch 1 is generated from here on, during the "training step"
        await await_until(lambda: len(producer._done) == 2, timeout_s=10, interval_s=0.01)
        t0 = time.perf_counter()
        batch = await producer.next_batch(2)
        waited = time.perf_counter() - t0
        await producer.aclose()
        return batch, waited

    batch, waited = asyncio.run(main())
    m = rollout_metrics(1, batch, waited)
    generated = 4 * TOKENS
    assert waited < 0.05 and m["rollout_s"] == waited  # the batch was ready: next to no wait
    assert GENERATE_S <= m["generation_span_s"] < GENERATE_S + 0.15  # the two groups' requests ran together
    assert m["tokens_per_s"] == pytest.approx(generated / m["generation_span_s"])
    assert m["tokens_per_s"] < generated / GENERATE_S < generated / waited / 4  # not tokens / the wait
    Progress(enabled=False).iteration_done({**m, "train_s": 0.5})
    assert f"  {m['tokens_per_s']:.0f} tok/s  rollout 0.0s" in capsys.readouterr().err
    # no stamps recorded (a path that records none): by the wait, as before
    for s in batch:
        s.metadata.pop("stages")
    assert rollout_metrics(1, batch, 0.5)["tokens_per_s"] == generated / 0.5
