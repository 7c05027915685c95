"""The gateway's token rules and wire format, through the official `openai` client: exact tokens,
continuation, prefix breaks, template drift, budgets, stop sequences, streaming, OpenAI errors."""

import asyncio
import copy
import json

import aiohttp
import openai
import pytest
from helpers import ScriptedEngine, new_session, open_gateway
from waiting import await_until

from agentrl.gateway.protocol import RequestError, parse_request

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def run(coro):
    return asyncio.run(coro)


async def _conversation(tokenizer, engine, turns, *, edit=None, stream=False, **session_kw):
    """Plays `turns` requests the way an agent does (the history it was given, plus a tool or
    user message); `edit(messages, i)` may change the history before request i. Returns the
    session, its samples and the replies."""
    gateway = await open_gateway()
    session = new_session(tokenizer, engine, **session_kw)
    base, key = gateway.open(session)
    replies = []
    try:
        async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as client:
            messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2?"}]
            for i in range(turns):
                if edit is not None:
                    messages = edit(messages, i)
                if stream:
                    chunks = [c async for c in await client.chat.completions.create(
                        model="any", messages=messages, tools=TOOLS, stream=True)]
                    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
                    message = {"role": "assistant", "content": text or None}
                    if calls:
                        message["tool_calls"] = [tc.model_dump(exclude={"index"}) for tc in calls]
                else:
                    reply = await client.chat.completions.create(model="any", messages=messages, tools=TOOLS)
                    message = reply.choices[0].message.model_dump(exclude_none=True)
                replies.append(message)
                messages = messages + [message]
                if message.get("tool_calls"):
                    messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "3"})
                else:
                    messages.append({"role": "user", "content": f"and now {i}?"})
        return session, gateway.close(key), replies
    finally:
        await gateway.aclose()


@pytest.mark.parametrize("stream", [False, True])
def test_turns_continue_one_token_sequence(tokenizer, stream):
    engine = ScriptedEngine(tokenizer, [CALL, "it is 3", "done"])
    session, samples, replies = run(_conversation(tokenizer, engine, 3, stream=stream))
    assert session.prefix_breaks == 0 and len(samples) == 1
    sample = samples[0]
    sample.validate()
    # every request the engine got extends the previous request plus the tokens it sampled
    for (prev, _, _), (cur, _, _) in zip(engine.calls, engine.calls[1:]):
        assert cur[:len(prev)] == prev
    assert sample.tokens[:len(engine.calls[-1][0])] == engine.calls[-1][0]
    # the sampled tokens are in the record exactly as generated, with their logprobs, mask 1
    for reply_text in (CALL, "it is 3", "done"):
        ids = tokenizer.encode(reply_text, add_special_tokens=False) + [tokenizer.eos_token_id]
        at = next(i for i in range(len(sample.response_tokens)) if sample.response_tokens[i:i + len(ids)] == ids)
        assert sample.loss_mask[at:at + len(ids)] == [1] * len(ids)
        assert sample.rollout_logprobs[at:at + len(ids)] == pytest.approx([-0.25 - 0.001 * i for i in range(len(ids))])
    assert sample.num_trained_tokens == sum(len(tokenizer.encode(t, add_special_tokens=False)) + 1
                                            for t in (CALL, "it is 3", "done"))
    # the tool call came back parsed, the text outside it as content
    assert replies[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert not replies[0].get("content") and replies[1]["content"] == "it is 3"
    assert engine.calls[0][2] == "t0"  # the session's trajectory id is the routing key
    # its requests' span, as the agent loop records it (rollout tok/s divides by it: agentrl.batches)
    stages = sample.metadata["stages"]
    assert 0 <= stages["last_reply_at"] - stages["first_request_at"] < 60


def test_reserialized_arguments_and_extra_fields_still_continue(tokenizer):
    """Frameworks rebuild the messages they were given: other JSON spacing, ids, extra keys."""
    def rebuild(messages, i):
        out = copy.deepcopy(messages)
        for m in out:
            for call in m.get("tool_calls") or []:
                call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]), indent=2)
            if m["role"] == "assistant":
                m["content"] = m.get("content") or ""
                m["refusal"] = None
        return out

    engine = ScriptedEngine(tokenizer, [CALL, "3", "ok"])
    session, samples, _ = run(_conversation(tokenizer, engine, 3, edit=rebuild))
    assert session.prefix_breaks == 0 and len(samples) == 1


def test_edited_history_splits_into_samples(tokenizer):
    """Dropping the first exchange (a summarising agent) starts a new sample at that request."""
    def drop(messages, i):
        return messages[:2] + messages[4:] if i == 2 else messages

    engine = ScriptedEngine(tokenizer, [CALL, "3", "ok"])
    session, samples, _ = run(_conversation(tokenizer, engine, 3, edit=drop))
    assert session.prefix_breaks == 1 and len(samples) == 2
    first, second = samples
    assert [s.trajectory_id for s in samples] == ["t0-0", "t0-1"]
    assert first.num_turns == 2 and second.num_turns == 1
    # the new sample's prompt is the edited history rendered afresh; its reply is its own
    assert second.prompt_tokens == engine.calls[2][0]
    assert second.response_tokens == tokenizer.encode("ok", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert all(s.metadata["env_metrics"]["gateway_prefix_breaks"] == 1.0 for s in samples)
    for s in samples:
        s.validate()


def test_a_template_that_rewrites_earlier_turns_splits_and_is_counted(tokenizer):
    drifting = copy.deepcopy(tokenizer)
    drifting.chat_template = tokenizer.chat_template.replace("{{ message.content }}", "{{ message.content | upper }}")
    engine = ScriptedEngine(drifting, ["yes", "no"])
    session, samples, _ = run(_conversation(drifting, engine, 2))
    assert session.template_drift == 1 and session.prefix_breaks == 1 and len(samples) == 2


def test_budget_used_up_is_openai_context_length_error(tokenizer):
    engine = ScriptedEngine(tokenizer, ["word " * 30, "more"])
    with pytest.raises(openai.BadRequestError) as caught:
        run(_conversation(tokenizer, engine, 2, max_len=40))
    assert caught.value.code == "context_length_exceeded"


def test_max_tokens_and_stop_sequence(tokenizer):
    async def go():
        engine = ScriptedEngine(tokenizer, ["alpha beta END", "x"])
        gateway = await open_gateway()
        session = new_session(tokenizer, engine)
        base, key = gateway.open(session)
        async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as client:
            reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=7, stop=["END"])
        await gateway.aclose()
        return engine, reply, gateway.close(key)

    engine, reply, samples = run(go())
    assert engine.calls[0][1]["max_new_tokens"] == 7 and engine.calls[0][1]["stop"] == ["END"]
    ids = (tokenizer.encode("alpha beta END", add_special_tokens=False) + [tokenizer.eos_token_id])[:7]
    assert samples[0].response_tokens == ids  # recorded as sampled
    text = tokenizer.decode(ids)
    assert reply.choices[0].message.content == (text[:-3] if text.endswith("END") else text)
    assert reply.choices[0].finish_reason == ("length" if ids[-1] != tokenizer.eos_token_id else "stop")


def test_request_sampling_params_only_when_honored(tokenizer):
    async def go(honor):
        engine = ScriptedEngine(tokenizer, ["a"])
        gateway = await open_gateway()
        base, key = gateway.open(new_session(tokenizer, engine, honor_sampling=honor))
        async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as client:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 temperature=0.0, top_p=0.5)
        await gateway.aclose()
        return engine.calls[0][1]

    assert run(go(False))["temperature"] == 1.0  # the run's: the trainer's logprobs assume it
    params = run(go(True))
    assert params["temperature"] == 0.0 and params["top_p"] == 0.5


def test_disconnect_mid_generation_and_mid_stream_loses_nothing(tokenizer):
    async def go():
        engine = ScriptedEngine(tokenizer, ["first reply", "second"], delay_s=0.5)
        gateway = await open_gateway()
        session = new_session(tokenizer, engine)
        base, key = gateway.open(session)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with aiohttp.ClientSession() as http:
            with pytest.raises(asyncio.TimeoutError):  # gone before the engine answered
                async with http.post(f"{base}/chat/completions", json=body,
                                     timeout=aiohttp.ClientTimeout(total=0.1)) as resp:
                    await resp.read()
            await await_until(lambda: session.segments and session.segments[0].sample.num_turns == 1, timeout_s=30,
                              what="the first turn, generated after its client left, recorded")
            body["messages"] = body["messages"] + [{"role": "assistant", "content": "first reply"},
                                                   {"role": "user", "content": "again"}]
            async with http.post(f"{base}/chat/completions", json=body) as resp:  # gone after the first chunk
                await resp.content.readline()
                resp.close()
        await await_until(lambda: session.segments and session.segments[-1].sample.num_turns == 2, timeout_s=30,
                          what="the second turn, streamed to a client that left, recorded")
        await gateway.aclose()
        return session, gateway.close(key)

    session, samples = run(go())
    assert len(samples) == 1 and samples[0].num_turns == 2 and session.prefix_breaks == 0
    expected = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id]
                for t in ("first reply", "second")]
    trained = [t for t, m in zip(samples[0].response_tokens, samples[0].loss_mask) if m]
    assert trained == expected[0] + expected[1]


def test_a_request_in_flight_when_the_session_ends_records_nothing(tokenizer):
    async def go():
        engine = ScriptedEngine(tokenizer, ["late"], delay_s=0.3)
        gateway = await open_gateway()
        session = new_session(tokenizer, engine)
        base, key = gateway.open(session)
        async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as client:
            pending = asyncio.ensure_future(client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]))
            await await_until(lambda: engine.calls, timeout_s=30, what="the request reaching the engine")
            samples = gateway.close(key)
            with pytest.raises(openai.APIStatusError) as caught:
                await pending
        await gateway.aclose()
        return samples, caught.value

    samples, error = run(go())
    assert error.status_code == 410 and samples[0].response_tokens == []


@pytest.mark.parametrize("body, param, code", [
    ({"model": "m"}, "messages", "missing_required_parameter"),
    ({"model": "m", "messages": []}, "messages", "invalid_value"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_type"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "invalid_value"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id",
     "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model", "missing_required_parameter"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n", "unsupported_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature", "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop", "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools",
     "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice",
     "unsupported_value"),
])
def test_bad_requests_get_openai_errors(body, param, code):
    with pytest.raises(RequestError) as caught:
        parse_request(body)
    error = caught.value.body()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert error["message"]


def test_errors_over_http_have_openai_shape(tokenizer):
    async def go():
        gateway = await open_gateway()
        base, key = gateway.open(new_session(tokenizer, ScriptedEngine(tokenizer, [])))
        out = {}
        async with aiohttp.ClientSession() as http:
            for name, method, url, kw in [
                ("bad_json", "post", f"{base}/chat/completions", {"data": b"{nope"}),
                ("bad_field", "post", f"{base}/chat/completions", {"json": {"model": "m", "messages": [], "n": 1}}),
                ("unknown_key", "post", f"{gateway.url}/v1/chat/completions",
                 {"json": {}, "headers": {"Authorization": "Bearer nope"}}),
                ("no_route", "get", f"{base}/nothing", {}),
                ("by_api_key", "get", f"{gateway.url}/v1/models", {"headers": {"Authorization": f"Bearer {key}"}}),
            ]:
                async with getattr(http, method)(url, **kw) as resp:
                    out[name] = (resp.status, await resp.json())
        await gateway.aclose()
        return out

    out = run(go())
    assert out["bad_json"][0] == 400 and "not valid JSON" in out["bad_json"][1]["error"]["message"]
    assert out["bad_field"][0] == 400 and out["bad_field"][1]["error"]["param"] == "messages"
    assert out["unknown_key"][0] == 401 and out["unknown_key"][1]["error"]["code"] == "invalid_api_key"
    assert out["no_route"][0] == 404 and set(out["no_route"][1]["error"]) == {"message", "type", "param", "code"}
    assert out["by_api_key"][0] == 200 and out["by_api_key"][1]["data"][0]["object"] == "model"


def test_a_real_chat_template_continues_exactly(smollm2):
    """SmolLM2's tokenizer and ChatML template: the record's text is the template's rendering of
    the conversation (replies as sampled), and each request extends the last one's tokens."""
    from agentrl.models import load_tokenizer

    tok = load_tokenizer(smollm2)
    engine = ScriptedEngine(tok, [CALL, "It is 3.\n", "Done!"])
    session, samples, _ = run(_conversation(tok, engine, 3))
    assert session.prefix_breaks == 0 and len(samples) == 1
    sample = samples[0]
    for (prev, _, _), (cur, _, _) in zip(engine.calls, engine.calls[1:]):
        assert cur[:len(prev)] == prev
    rendered = tok.apply_chat_template(sample.messages[:-1], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert tok.decode(sample.tokens).startswith(rendered)  # what the model saw is the template's text
    assert tok.decode(sample.tokens).endswith("Done!" + tok.eos_token)


def test_an_engine_error_is_a_502_and_the_retry_continues_the_sample(tokenizer):
    from agentrl.errors import EngineError

    replies = iter([EngineError("engine died"), "fine"])

    def reply(input_ids):
        item = next(replies)
        if isinstance(item, Exception):
            raise item
        return item

    async def go():
        engine = ScriptedEngine(tokenizer, reply=reply)
        gateway = await open_gateway()
        session = new_session(tokenizer, engine)
        base, key = gateway.open(session)
        messages = [{"role": "user", "content": "hi"}]
        async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as client:
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(model="m", messages=messages)
            reply_ = await client.chat.completions.create(model="m", messages=messages)
        await gateway.aclose()
        return caught.value, reply_, session, gateway.close(key)

    error, reply_, session, samples = run(go())
    assert error.status_code == 502 and error.body["code"] == "engine_error"
    assert reply_.choices[0].message.content == "fine"
    assert session.prefix_breaks == 0 and len(samples) == 1 and samples[0].num_turns == 1


def test_replies_parsed_by_the_model_familys_parser():
    from agentrl.gateway.protocol import assistant_message

    def message(*args):
        return asyncio.run(assistant_message(*args))

    ok = message(f"Let me add. {CALL}", "hermes", TOOLS, "c")
    assert ok["content"] == "Let me add." and ok["tool_calls"] == [
        {"id": "c_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    bad = '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>'  # the model's broken JSON
    assert message(bad, "hermes", TOOLS, "c") == {"role": "assistant", "content": bad}
    assert message(CALL, "hermes", None, "c") == {"role": "assistant", "content": CALL}  # no tools offered
    xml = "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>"
    coder = message(xml, "qwen3_coder", TOOLS, "c")
    assert coder["content"] is None and json.loads(coder["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}


def test_a_registered_parser_past_its_bound_is_the_agents_fault_not_a_stalled_gateway(tokenizer):
    """A user-registered tool-call parser runs in a process of its own, off the event loop
    (aparse_tool_calls: tests/tools/test_parsers.py checks its bound and the loop): one that hangs
    on the model's text makes assistant_message raise its AgentFault; through the gateway the agent
    gets the reply as written (no tool calls) and the session records the fault (reward 0)."""
    import time

    from agentrl.errors import AgentFault
    from agentrl.gateway.protocol import assistant_message
    from agentrl.tools import parsers

    @parsers.register_parser("test_hangs_on_add", timeout=1.0)
    def hangs(text, tools):
        while "add" in text:
            time.sleep(0.05)
        return []

    try:
        with pytest.raises(AgentFault):
            asyncio.run(assistant_message(CALL, "test_hangs_on_add", TOOLS, "c"))
        engine = ScriptedEngine(tokenizer, [CALL])
        session, samples, replies = run(_conversation(tokenizer, engine, 1, tool_parser="test_hangs_on_add"))
        assert "tool_calls" not in replies[0] and "add" in replies[0]["content"]
        assert session.fault and "test_hangs_on_add" in session.fault and len(samples) == 1
    finally:
        parsers._PARSERS.pop("test_hangs_on_add", None)
        parsers._TIMEOUTS.pop("test_hangs_on_add", None)
