"""Difficulty-aware sampling (--difficulty-window): the producer tells the prompt source how each
group went, and the source skips prompts whose recent groups carried no signal (every sample the
same reward: always or never solved). On a dataset of mixed difficulty, fewer zero-variance
groups reach the trainer; the choices survive a resume."""

import asyncio
import json
import random

import pytest

from agentrl.data import PromptSource
from agentrl.errors import ConfigError
from agentrl.rollout.producer import RolloutProducer
from agentrl.types import Sample

GROUP = 4  # samples per group


def mixed_tasks() -> list[dict]:
    """30 prompts: 10 always solved, 10 never, 10 solved half the time."""
    return [{"prompt": f"{kind}{i}", "kind": kind} for kind in ("easy", "hard", "mid") for i in range(10)]


async def run_group(task: dict, group_id: int, attempt: int) -> list[Sample]:
    rng = random.Random(group_id)
    rewards = {"easy": [1.0] * GROUP, "hard": [0.0] * GROUP,
               "mid": [float(rng.random() < 0.5) for _ in range(GROUP)]}[task["kind"]]
    await asyncio.sleep(0)
    return [Sample(prompt_tokens=[1], response_tokens=[2], loss_mask=[1], rollout_logprobs=[-1.0], policy_versions=[0],
                   reward=r, group_id=group_id, trajectory_id=f"g{group_id}-{k}", metadata={"prompt": task["prompt"]})
            for k, r in enumerate(rewards)]


def zero_variance_share(source: PromptSource, batches: int = 40, groups: int = 6) -> tuple[float, list[str]]:
    """The share of zero-variance groups among those handed out in the second half of the batches."""
    producer = RolloutProducer(source=source, run_group=run_group, over_sampling=groups, report=lambda text: None)

    async def main():
        out = [await asyncio.wait_for(producer.next_batch(groups), 30) for _ in range(batches)]
        await producer.aclose()
        return out

    flat = zero = 0
    prompts = []
    for batch in asyncio.run(main())[batches // 2:]:  # the second half: after each prompt was seen twice
        by_group: dict[int, list[float]] = {}
        for s in batch:
            by_group.setdefault(s.group_id, []).append(s.reward_value)
            prompts.append(s.metadata["prompt"])
        flat += len(by_group)
        zero += sum(max(r) == min(r) for r in by_group.values())
    return zero / flat, prompts


def test_difficulty_sampling_cuts_zero_variance_groups_on_mixed_difficulty():
    plain, _ = zero_variance_share(PromptSource(mixed_tasks(), seed=0))
    source = PromptSource(mixed_tasks(), seed=0, difficulty_window=2, revisit_prob=0.1)
    aware, _ = zero_variance_share(source)
    print(f"zero-variance groups: plain {plain:.2f}, difficulty-aware {aware:.2f}; {source.metrics()}")
    assert plain > 0.6  # 2/3 of the prompts can give no signal
    # expected about (10 mid x 1/8 flat + 20 settled x 0.1 revisits) / 12 draws an epoch = 0.27
    assert aware < plain / 2
    assert source.metrics()["difficulty/skipped"] > 0 and source.metrics()["difficulty/settled_tasks"] >= 15


def test_off_by_default_and_a_prompt_with_signal_is_never_skipped():
    source = PromptSource(mixed_tasks(), seed=0)
    source.observe(source.tasks[0], [1.0] * GROUP)
    assert source.metrics() == {} and "settled" not in source.state_dict()
    source = PromptSource(mixed_tasks(), seed=0, difficulty_window=2, revisit_prob=0.0)
    for task in source.tasks:
        source.observe(task, [1.0] * GROUP if task["kind"] != "mid" else [0.0, 1.0, 1.0, 1.0])
    assert source.metrics()["difficulty/settled_tasks"] == 0  # one flat group is not enough at window 2
    for task in source.tasks:
        source.observe(task, [1.0] * GROUP if task["kind"] != "mid" else [0.0, 1.0, 1.0, 1.0])
    assert {t["kind"] for t in source.next_batch(25)} == {"mid"}


def test_every_prompt_settled_still_fills_the_batch():
    source = PromptSource(mixed_tasks(), seed=0, difficulty_window=1, revisit_prob=0.0)
    for task in source.tasks:
        source.observe(task, [0.0] * GROUP)
    assert len(source.next_batch(7)) == 7


def test_the_skip_history_resumes():
    a = PromptSource(mixed_tasks(), seed=3, difficulty_window=1, revisit_prob=0.2)
    for task in a.next_batch(30):
        a.observe(task, [1.0] * GROUP if task["kind"] == "easy" else [0.0, 1.0, 0.0, 0.0])
    b = PromptSource(mixed_tasks(), seed=3, difficulty_window=1, revisit_prob=0.2)
    b.load_state_dict(a.state_dict())
    assert [t["prompt"] for t in a.next_batch(40)] == [t["prompt"] for t in b.next_batch(40)]


def test_a_generated_task_stream_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--difficulty-window.*--prompt-data"):
        PromptSource(generator=lambda: iter([{}]), difficulty_window=2)


def test_the_skip_history_survives_a_checkpoint_file(tmp_path):
    """What a checkpoint writes (RunState.data in trainer_state.json, JSON: the task indices become
    strings) and --load reads back gives a source that makes the same choices."""
    from agentrl.train import RunState

    a = PromptSource(mixed_tasks(), seed=3, difficulty_window=2, revisit_prob=0.2)
    for _ in range(2):
        for task in a.next_batch(30):
            a.observe(task, [1.0] * GROUP if task["kind"] != "mid" else [0.0, 1.0, 0.0, 0.0])
    assert a.metrics()["difficulty/settled_tasks"] == 20
    ckpt = tmp_path / "iter_000002"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps(RunState(rollout_id=2, data=a.state_dict()).to_dict()))
    b = PromptSource(mixed_tasks(), seed=3, difficulty_window=2, revisit_prob=0.2)
    b.load_state_dict(RunState.read(ckpt).data)
    assert b.metrics() == a.metrics()
    expected = [t["prompt"] for t in a.next_batch(40)]
    assert [t["prompt"] for t in b.next_batch(40)] == expected
    # the history is what made those choices: the position alone does not
    fresh = PromptSource(mixed_tasks(), seed=3, difficulty_window=2, revisit_prob=0.2)
    fresh.load_state_dict({k: v for k, v in RunState.read(ckpt).data.items() if k not in ("settled", "skipped")})
    assert [t["prompt"] for t in fresh.next_batch(40)] != expected
