"""Multi-turn token-in/token-out: masks, continuity, template drift, failures."""

import asyncio
import copy

import pytest

import agentrl
from agentrl.errors import EngineError, TemplateDriftError
from agentrl.rollout.agent_loop import REPLY_DRIFTS_LOUD, LoopSettings, Renderer, run_trajectory
from agentrl.rollout.client import GenerateResult
from agentrl.types import SampleStatus


class ScriptedClient:
    """Answers /generate with scripted texts (ending in EOS), recording what it was sent."""

    def __init__(self, tokenizer, replies, fail_at=None):
        self.tok, self.replies, self.fail_at = tokenizer, list(replies), fail_at
        self.calls = []

    async def generate(self, input_ids, sampling_params, *, session_id=None, rid=None, lora_path=None,
                       image_data=None):
        self.calls.append((list(input_ids), session_id))
        if self.fail_at is not None and len(self.calls) - 1 == self.fail_at:
            raise EngineError("engine died")
        ids = self.tok.encode(self.replies.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        ids = ids[: sampling_params["max_new_tokens"]]
        finish = "stop" if ids[-1] == self.tok.eos_token_id else "length"
        return GenerateResult(ids, [-0.5] * len(ids), finish, len(input_ids), 0, "3")


class CountEnv(agentrl.Env):
    """Multi-turn: asks for three answers, rewards the count of 'yes'."""

    max_turns = 3

    def reset(self, *, seed=None, options=None):
        self.turn, self.score = 0, 0
        return [{"role": "system", "content": "be brief"}, {"role": "user", "content": options["prompt"]}], {}

    def step(self, action):
        self.turn += 1
        self.score += action.strip() == "yes"
        done = self.turn == 3
        return f"turn {self.turn} noted", self.score / 3 if done else 0.0, done, False, {}


def play(env, client, tokenizer, max_len=200, max_turns=3, **kw):
    renderer = Renderer(tokenizer, True)
    settings = LoopSettings(max_response_len=max_len, max_turns=max_turns, sampling_params={"temperature": 1.0})
    return asyncio.run(run_trajectory(env, {"prompt": "answer yes"}, renderer=renderer, client=client,
                                      settings=settings, trajectory_id="traj-1", group_id=0, seed=0, **kw))


def test_multi_turn_masks_and_token_continuity(tokenizer):
    client = ScriptedClient(tokenizer, ["yes", "no", "yes"])
    s = play(CountEnv(), client, tokenizer)
    assert s.status == SampleStatus.COMPLETED and s.num_turns == 3 and s.reward == pytest.approx(2 / 3)
    # Every turn's request extends the previous one exactly: nothing re-tokenized.
    for (prev, _), (cur, _) in zip(client.calls, client.calls[1:]):
        assert cur[: len(prev)] == prev
    assert all(key == "traj-1" for _, key in client.calls)  # session id = trajectory id
    # Policy tokens: mask 1 with their logprobs and version; env tokens: mask 0.
    eos = tokenizer.eos_token_id
    policy = [t for t, m in zip(s.response_tokens, s.loss_mask) if m]
    assert policy == sum((tokenizer.encode(w) + [eos] for w in ["yes", "no", "yes"]), [])
    assert all(lp == -0.5 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m)
    assert all(v == 3 for v, m in zip(s.policy_versions, s.loss_mask) if m)
    env_text = tokenizer.decode([t for t, m in zip(s.response_tokens, s.loss_mask) if not m])
    assert "turn 1 noted" in env_text and "<|im_start|>assistant" in env_text
    # The whole trajectory is exactly what the chat template renders for the conversation.
    rendered = tokenizer.apply_chat_template(s.messages, tokenize=False)
    assert tokenizer.decode(s.tokens) == rendered.rstrip("\n")
    assert tokenizer.decode(s.prompt_tokens).endswith("<|im_start|>assistant\n")


def test_template_that_rewrites_earlier_turns_is_reported(tokenizer):
    drifting = copy.deepcopy(tokenizer)
    # Like templates that drop past reasoning: earlier assistant turns lose their <think> block.
    drifting.chat_template = tokenizer.chat_template.replace(
        "{{ message.content }}",
        "{% if message.role == 'assistant' %}{{ message.content.split('</think>')[-1] }}"
        "{% else %}{{ message.content }}{% endif %}")
    # a reply it rewrites is the model's doing once (scored 0); in most turns, the template's: the run stops
    renderer = Renderer(drifting, True)
    settings = LoopSettings(max_response_len=200, max_turns=3, sampling_params={"temperature": 1.0})
    n = REPLY_DRIFTS_LOUD
    with pytest.raises(TemplateDriftError, match=rf"in {n} of {n} turns; the latest: turn 1: the chat template "
                                                 r"re-rendered earlier tokens.*first difference at token \d+"):
        for i in range(n):
            s = asyncio.run(run_trajectory(CountEnv(), {"prompt": "answer yes"}, renderer=renderer,
                                           client=ScriptedClient(drifting, ["<think>hmm</think>yes"] * 3),
                                           settings=settings, trajectory_id=f"t{i}", group_id=0, seed=0))
            assert s.reward == 0.0 and "TemplateDriftError" in s.metadata["agent_fault"]


def trimming(tokenizer):
    """A template that trims the assistant's content, as Llama 3's does (`| trim`)."""
    out = copy.deepcopy(tokenizer)
    out.chat_template = tokenizer.chat_template.replace(
        "{{ message.content }}",
        "{% if message.role == 'assistant' %}{{ message.content | trim }}{% else %}{{ message.content }}{% endif %}")
    assert out.chat_template != tokenizer.chat_template
    return out


def test_a_reply_the_template_rewrites_is_the_agents_fault(tokenizer):
    """The model ends its reply on a space, which a trimming template drops when it renders the
    turn again: what the model wrote cannot be continued. The trajectory ends scored 0, the
    reason recorded, and the run goes on (this raised TemplateDriftError out of the loop)."""
    tok = trimming(tokenizer)
    s = play(CountEnv(), ScriptedClient(tok, ["yes", "yes ", "yes"]), tok)
    assert s.status == SampleStatus.COMPLETED and s.reward == 0.0 and s.num_turns == 2
    assert s.metadata["agent_fault"].startswith("TemplateDriftError: turn 2: the chat template re-rendered")
    s.validate()


class EndsWith(ScriptedClient):
    """Each reply ends at token `end` (a stop), as SGLang returns it."""

    def __init__(self, tokenizer, replies, end):
        super().__init__(tokenizer, replies)
        self.end = end

    async def generate(self, input_ids, sampling_params, **kw):
        ids = self.tok.encode(self.replies.pop(0), add_special_tokens=False) + [self.end]
        return GenerateResult(ids, [-0.5] * len(ids), "stop", len(input_ids), 0, "3")


def test_a_stop_token_that_does_not_end_turns_stays_in_the_reply(tokenizer):
    """A turn that stopped at a token the template does not close replies with (here a tokenizer
    whose eos was read as <|im_start|>, as transformers 5.12 read SmolLM2's GGUF on the GPU; a stray
    --rollout-stop-token-ids the same) keeps the token in the reply's text: the next rendering
    extends what the model saw (this raised TemplateDriftError and stopped the run)."""
    wrong = copy.deepcopy(tokenizer)
    wrong.eos_token = "<|im_start|>"
    assert wrong.eos_token_id != tokenizer.eos_token_id
    s = play(CountEnv(), EndsWith(wrong, ["yes"] * 3, wrong.eos_token_id), wrong)
    assert s.status == SampleStatus.COMPLETED and s.num_turns == 3, s.metadata
    assert [m["content"] for m in s.messages if m["role"] == "assistant"] == ["yes<|im_start|>"] * 3
    assert wrong.apply_chat_template(s.messages, tokenize=False).startswith(wrong.decode(s.tokens))


def test_the_models_own_eos_ends_a_turn(tokenizer, tmp_path):
    """SGLang stops at the model folder's eos ids too (Gemma ends a turn at <end_of_turn>, its
    generation_config's, not the tokenizer's <eos>): a turn that stopped there is closed by the
    template once, not twice."""
    other = copy.deepcopy(tokenizer)
    other.eos_token = "<|endoftext|>"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (tmp_path / "generation_config.json").write_text(f'{{"eos_token_id": [{other.eos_token_id}, {im_end}]}}')
    other.name_or_path = str(tmp_path)
    renderer = Renderer(other, True)
    assert renderer.eos_ids == {other.eos_token_id, im_end} and renderer.ends_turn(im_end)
    assert not renderer.ends_turn(other.eos_token_id)
    settings = LoopSettings(max_response_len=200, max_turns=3, sampling_params={"temperature": 1.0})
    s = asyncio.run(run_trajectory(CountEnv(), {"prompt": "answer yes"}, renderer=renderer,
                                   client=EndsWith(other, ["yes"] * 3, im_end), settings=settings,
                                   trajectory_id="t", group_id=0, seed=0))
    assert s.status == SampleStatus.COMPLETED and s.reward == 1.0
    assert [m["content"] for m in s.messages if m["role"] == "assistant"] == ["yes"] * 3
    assert "<|im_end|><|im_end|>" not in other.decode(s.tokens)


def test_length_budget_truncates(tokenizer):
    client = ScriptedClient(tokenizer, ["yes yes yes yes yes yes yes yes"] * 3)
    s = play(CountEnv(), client, tokenizer, max_len=6)
    assert s.status == SampleStatus.TRUNCATED and s.response_length == 6 and s.num_turns == 1


class WorkEnv(CountEnv):
    """Scores its state when a limit cuts the episode off: the 'yes' count so far (a code env's file)."""

    max_turns = 5

    async def atruncated(self, reason):
        self.reasons = [*getattr(self, "reasons", []), reason]
        if self.score == 0:
            from agentrl.errors import AgentFault
            raise AgentFault("nothing to grade: the agent broke its workspace")
        return {"score": self.score / 10, "yes": float(self.score)}


def test_a_cut_off_episode_is_scored_by_the_env(tokenizer):
    # the turn limit (2 of the env's 3 turns): the state is graded, once, and the parts kept
    env = WorkEnv()
    s = play(env, ScriptedClient(tokenizer, ["yes", "yes"]), tokenizer, max_turns=2)
    assert s.status == SampleStatus.TRUNCATED and s.metadata["truncation"] == "max_turns"
    assert env.reasons == ["max_turns"] and s.reward == {"yes": 2.0, "score": 0.2}
    assert s.metadata["truncated_reward"] == 0.2
    # the token budget too; and the env's own fault while grading scores 0, not FAILED
    env = WorkEnv()
    s = play(env, ScriptedClient(tokenizer, ["no no no no no no no"]), tokenizer, max_len=4)
    assert env.reasons == ["max_response_len"] and s.status == SampleStatus.TRUNCATED and s.reward == 0.0
    assert s.metadata["agent_fault"] == "AgentFault: nothing to grade: the agent broke its workspace"
    # a finished episode is not asked again; an env without the hook gives nothing more
    env = WorkEnv()
    s = play(env, ScriptedClient(tokenizer, ["yes", "no", "yes"]), tokenizer, max_turns=5)
    assert s.status == SampleStatus.COMPLETED and s.reward == 2 / 3 and not hasattr(env, "reasons")
    s = play(CountEnv(), ScriptedClient(tokenizer, ["yes", "yes"]), tokenizer, max_turns=2)
    assert s.status == SampleStatus.TRUNCATED and s.reward == 0.0 and "truncated_reward" not in s.metadata


def test_env_exception_marks_failed_with_traceback(tokenizer):
    class Broken(CountEnv):
        def step(self, action):
            raise RuntimeError("env exploded")

    s = play(Broken(), ScriptedClient(tokenizer, ["yes"]), tokenizer)
    assert s.status == SampleStatus.FAILED and not s.trainable
    assert "env exploded" in s.metadata["error"] and "Traceback" in s.metadata["traceback"]


def test_engine_failure_marks_failed(tokenizer):
    s = play(CountEnv(), ScriptedClient(tokenizer, ["yes", "yes"], fail_at=1), tokenizer)
    assert s.status == SampleStatus.FAILED and "engine died" in s.metadata["error"]


def test_async_env_is_awaited_and_sync_env_does_not_block_the_loop(tokenizer):
    class SlowSync(CountEnv):
        max_turns = 1

        def step(self, action):
            import time
            time.sleep(0.5)
            return [], 1.0, True, False, {}

    async def go():
        renderer = Renderer(tokenizer, True)
        settings = LoopSettings(max_response_len=50, max_turns=1, sampling_params={})
        jobs = [run_trajectory(SlowSync(), {"prompt": "x"}, renderer=renderer,
                               client=ScriptedClient(tokenizer, ["yes"]), settings=settings,
                               trajectory_id=f"t{i}", group_id=0, seed=0) for i in range(4)]
        import time
        t0 = time.perf_counter()
        out = await asyncio.gather(*jobs)
        return out, time.perf_counter() - t0

    out, seconds = asyncio.run(go())
    assert all(s.reward == 1.0 for s in out)
    assert seconds < 1.5  # four 0.5 s steps ran in threads, not one after another


def test_an_env_with_nothing_to_close_is_closed_without_a_thread(monkeypatch):
    """Env.aclose runs the sync close in a worker thread only when there is one to run (the
    env's own close, or the event loop its sync API made): not one thread per trajectory."""
    threads = []
    real = asyncio.to_thread

    async def spy(fn, *args, **kwargs):
        threads.append(fn)
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", spy)

    class AsyncOnly(agentrl.Env):
        async def areset(self, *, seed=None, options=None):
            return "hi", {}

    class WithClose(CountEnv):
        closed = False

        def close(self):
            self.closed = True

    asyncio.run(AsyncOnly().aclose())
    assert threads == []
    env = WithClose()
    asyncio.run(env.aclose())
    assert env.closed and len(threads) == 1
    used_sync = AsyncOnly()
    used_sync.reset()  # runs areset on the env's own loop, which close must close
    asyncio.run(used_sync.aclose())
    assert len(threads) == 2 and used_sync._sync_loop is None


def test_clients_speak_the_generate_client_protocol():
    """The loop needs only GenerateClient.generate: EngineClient and this file's scripted client
    take the same parameters (names, kinds, defaults), so either drives run_trajectory."""
    import inspect

    from agentrl.rollout.client import EngineClient, GenerateClient

    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    want = params(GenerateClient.generate)
    assert params(EngineClient.generate) == want
    assert params(ScriptedClient.generate) == want
    assert inspect.iscoroutinefunction(EngineClient.generate) and inspect.iscoroutinefunction(ScriptedClient.generate)


def test_a_resume_that_splits_a_character_keeps_the_text_whole(tokenizer):
    """--partial-rollout: a weight update aborts a generation between the two byte tokens of
    'é'; the resumed generation brings the second. The turn's text is decoded whole, so the
    next turn's rendering still extends it (decoding the pieces apart gave two U+FFFD and a
    TemplateDriftError)."""
    from agentrl.rollout.control import RolloutControl

    word = tokenizer.encode("café", add_special_tokens=False)
    assert tokenizer.decode(word[:-1]).endswith("\ufffd")  # the split falls inside the character

    class SplitClient(ScriptedClient):
        async def generate(self, input_ids, sampling_params, *, session_id=None, rid=None, lora_path=None):
            self.calls.append((list(input_ids), session_id))
            if len(self.calls) == 1:  # aborted by a weight update after half of 'é'
                return GenerateResult(word[:-1], [-0.5] * (len(word) - 1), "abort", len(input_ids), 0, "0")
            if len(self.calls) == 2:
                ids = word[-1:] + [self.tok.eos_token_id]
                return GenerateResult(ids, [-0.5] * len(ids), "stop", len(input_ids), 0, "1")
            return await super().generate(input_ids, sampling_params, session_id=session_id, rid=rid)

    control = RolloutControl()
    control.partial_rollout = True
    client = SplitClient(tokenizer, ["yes", "yes"])
    s = play(CountEnv(), client, tokenizer, control=control)
    assert s.status == SampleStatus.COMPLETED and s.num_turns == 3, s.metadata
    assert s.metadata["resumed"] == 1
    assert "café" in tokenizer.decode(s.tokens)


def test_the_latest_routed_experts_reach_the_sample(tokenizer):
    """R3: each turn's reply covers every token so far but the last (SGLang's routed_experts); the
    sample keeps the latest reply's, which covers the trajectory up to its last generated token."""

    class RoutingClient(ScriptedClient):
        async def generate(self, input_ids, sampling_params, **kw):
            result = await super().generate(input_ids, sampling_params, **kw)
            self.covered = len(input_ids) + len(result.output_ids) - 1
            result.routed_experts = [[len(self.calls), t] for t in range(self.covered)]  # [tokens][layers * top-k]
            return result

    client = RoutingClient(tokenizer, ["yes", "no", "yes"])
    s = play(CountEnv(), client, tokenizer)
    assert len(client.calls) == 3 and {r[0] for r in s.routed_experts} == {3}
    assert len(s.routed_experts) == client.covered <= len(s.tokens) - 1
    assert play(CountEnv(), ScriptedClient(tokenizer, ["yes"] * 3), tokenizer).routed_experts is None  # not asked


class FaultEnv(agentrl.Env):
    """Turn 1 echoes a lone surrogate (a decoded \\ud800 escape) back; turn 2's grading is broken by the agent."""

    max_turns = 3

    def reset(self, *, seed=None, options=None):
        return options["prompt"], {}

    def step(self, action):
        if action.strip() == "yes":
            return [{"role": "tool", "content": "echo: \ud800 \udfff"}], 0.5, False, False, {}
        from agentrl.errors import AgentFault
        raise AgentFault("the agent's answer broke its grader")


def test_agent_fault_from_any_env_scores_zero_and_surrogates_are_replaced(tokenizer):
    s = play(FaultEnv(), ScriptedClient(tokenizer, ["yes", "no"]), tokenizer)
    # not FAILED (which masks the group and lets a policy veto it): completed, scored 0 for the faulty turn
    assert s.status == SampleStatus.COMPLETED and s.reward == 0.5
    assert s.metadata["agent_fault"] == "AgentFault: the agent's answer broke its grader"
    assert "echo: \ufffd \ufffd" in s.messages[2]["content"]  # the tokenizer raises TypeError on lone surrogates


def test_token_texts_from_the_table_are_each_tokens_own_decoding(tokenizer):
    """Renderer.token_texts (what the env's Action.token_texts reads) gives decode([t]) for every
    token, the first time and from its table after, and the env is handed it by the loop."""
    renderer = Renderer(tokenizer, False)
    ids = list(range(len(tokenizer))) + [5, 5, tokenizer.eos_token_id]
    expected = tuple(tokenizer.decode([t], clean_up_tokenization_spaces=False) for t in ids)
    assert renderer.token_texts(ids) == expected
    assert renderer.token_texts(ids[::-1]) == expected[::-1]  # from the table now
    assert renderer.token_texts([]) == ()

    class Texts(agentrl.Env):
        max_turns = 1

        def reset(self, *, seed=None, options=None):
            return "say it", {}

        def step(self, action):
            self.seen = (action.token_ids, action.token_texts)
            return [], 1.0, True, False, {}

    env = Texts()
    sample = asyncio.run(run_trajectory(
        env, {}, renderer=renderer, client=ScriptedClient(tokenizer, ["the cat, the hat"]),
        settings=LoopSettings(max_response_len=50, max_turns=1, sampling_params={}, apply_chat_template=False),
        trajectory_id="t", group_id=0, seed=0))
    token_ids, texts = env.seen
    assert sample.status == SampleStatus.COMPLETED and token_ids and token_ids == tuple(sample.response_tokens[:-1])
    assert texts == tuple(tokenizer.decode([t]) for t in token_ids)


def test_token_texts_past_a_full_table_are_still_each_tokens_decoding(tokenizer, monkeypatch):
    import agentrl.rollout.agent_loop as loop

    monkeypatch.setattr(loop, "PIECE_CACHE_SIZE", 10)
    renderer = Renderer(tokenizer, False)
    ids = list(range(40))
    expected = tuple(renderer.decode([t]) for t in ids)
    assert renderer.token_texts(ids[:8]) == expected[:8]  # fits: kept
    assert renderer.token_texts(ids) == expected and len(renderer._pieces) == 8  # does not fit: decoded, not kept
