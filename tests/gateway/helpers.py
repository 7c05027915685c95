"""Shared pieces of the gateway tests: a scripted engine and a session opener."""

from __future__ import annotations

import asyncio

from agentrl.gateway import Gateway, Session
from agentrl.rollout.agent_loop import LoopSettings, Renderer
from agentrl.rollout.client import GenerateResult


class ScriptedEngine:
    """A GenerateClient that answers each /generate with the next scripted text (then EOS), as
    token ids with logprobs, recording what it was sent. `reply(input_ids)` may compute the text."""

    def __init__(self, tokenizer, replies=(), reply=None, delay_s: float = 0.0):
        self.tok, self.replies, self.reply, self.delay_s = tokenizer, list(replies), reply, delay_s
        self.calls: list[tuple[list[int], dict, str | None]] = []

    async def generate(self, input_ids, sampling_params, *, session_id=None, rid=None, lora_path=None):
        self.calls.append((list(input_ids), dict(sampling_params), session_id))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        text = self.reply(input_ids) if self.reply else self.replies.pop(0)
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        ids = ids[: sampling_params["max_new_tokens"]]
        finish = "stop" if ids[-1] == self.tok.eos_token_id else "length"
        return GenerateResult(ids, [-0.25 - 0.001 * i for i in range(len(ids))], finish, len(input_ids), 0, "0")


def settings(max_len: int = 512, max_turns: int = 16, **params) -> LoopSettings:
    return LoopSettings(max_response_len=max_len, max_turns=max_turns,
                        sampling_params={"temperature": 1.0, "top_p": 1.0, **params})


def new_session(tokenizer, engine, *, trajectory_id: str = "t0", max_len: int = 512, max_turns: int = 16,
                tool_parser: str | None = "hermes", **kw) -> Session:
    return Session(trajectory_id=trajectory_id, group_id=0, env_name="test", task={"label": "x"},
                   renderer=Renderer(tokenizer, True), client=engine, settings=settings(max_len, max_turns),
                   tool_parser=tool_parser, **kw)


async def open_gateway(**kw) -> Gateway:
    return await Gateway(**kw).start()
