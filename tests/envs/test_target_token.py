"""target-token's figures: the best prompt-ignoring policy's reward comes from the task
distribution, and `above_chance` is one no prompt-ignoring policy can raise."""

import itertools

import pytest

from agentrl.env import Action
from agentrl.envs.target_token import TARGETS, TargetTokenEnv


def play(env, task, response: str):
    """One episode; the response's tokens are its words (as the tokenizer's token_texts give them)."""
    env.reset(options=task)
    words = response.split()
    action = Action.build(response, list(range(len(words))), lambda ids: " " + words[ids[0]])
    _, reward, terminated, _, info = env.step(action)
    assert terminated
    return reward, info["metrics"]["above_chance"]


def mean_scores(policy, targets=TARGETS, n=4000):
    env = TargetTokenEnv(targets)
    tasks = itertools.islice(TargetTokenEnv.dataset(targets=targets, seed=3), n)
    scores = [play(env, task, policy(task)) for task in tasks]
    return sum(r for r, _ in scores) / n, sum(a for _, a in scores) / n


@pytest.mark.parametrize("targets", [TARGETS, ("the", "the", "the", "and")])
def test_prompt_ignoring_policies_score_at_most_chance_and_zero_above_it(targets):
    chance = TargetTokenEnv.chance_reward(targets=targets)
    assert chance == pytest.approx(max(targets.count(w) for w in targets) / len(targets))
    constants = [" ".join([w] * 6) for w in dict.fromkeys(targets)]
    constants += ["xyz " * 6, " ".join(list(dict.fromkeys(targets)) * 2), "the the and zzz"]
    rewards = []
    for response in constants:
        reward, above = mean_scores(lambda task: response, targets)
        rewards.append(reward)
        assert reward <= chance + 0.03, (response, reward, chance)
        if len(set(targets)) == len(targets):  # uniform targets: above_chance is 0 for all of them
            assert abs(above) < 0.03, (response, above)
    assert max(rewards) == pytest.approx(chance, abs=0.03)  # the bound is reached: all on the likeliest word
    # reading the prompt beats every one of them, on both figures
    reward, above = mean_scores(lambda task: " ".join([task["label"]] * 6), targets)
    assert reward == 1.0 and above == 1.0


def test_half_right_half_wrong_scores_half_the_reward_and_less_above_chance():
    env = TargetTokenEnv()
    reward, above = play(env, {"prompt": "Repeat the word: and", "label": "and"}, "and and the of")
    assert reward == 0.5 and above == pytest.approx((2 - 2 / 7) / 4)
    assert play(env, {"prompt": "x", "label": "and"}, "")[0] == 0.0


def test_an_episode_runs_on_the_event_loop_without_a_worker_thread(tokenizer):
    """reset and step take microseconds: run on the event loop, never queued for the thread pool
    (on a GPU run, 256 of them waited there ~0.2 s each and held the GIL while replies came in)."""
    import asyncio
    import concurrent.futures

    from agentrl.rollout.agent_loop import LoopSettings, Renderer, run_trajectory
    from agentrl.rollout.client import GenerateResult

    class NoThreads(concurrent.futures.ThreadPoolExecutor):
        def submit(self, fn, *args, **kwargs):
            raise AssertionError(f"a worker thread was asked to run {fn}")

    word = tokenizer.encode(" the", add_special_tokens=False)
    other = tokenizer.encode(" and", add_special_tokens=False)

    class Client:
        async def generate(self, input_ids, sampling_params, *, session_id=None, rid=None, lora_path=None):
            ids = (word * 3 + other)[:sampling_params["max_new_tokens"]]
            return GenerateResult(ids, [-0.1] * len(ids), "length", len(input_ids), 0, "0")

    async def episode():
        asyncio.get_running_loop().set_default_executor(NoThreads())
        return await run_trajectory(
            TargetTokenEnv(), {"prompt": "Repeat the word: the", "label": "the"},
            renderer=Renderer(tokenizer, False), client=Client(), trajectory_id="t", group_id=0, seed=1,
            settings=LoopSettings(max_response_len=4 * len(word), max_turns=1, sampling_params={},
                                  apply_chat_template=False))

    sample = asyncio.run(episode())
    assert sample.status.value == "completed", sample.metadata.get("error")
    assert sample.reward == pytest.approx(3 / 4) and sample.metadata["env_metrics"]["above_chance"] > 0
