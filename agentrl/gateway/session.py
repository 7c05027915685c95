"""One agent session (one trajectory): its chat requests turned into exact token records.

The token rules:

* The first request's messages are rendered with the chat template and tokenized: the
  prompt of a `Sample`.
* Every reply appends the token ids the engine sampled, with their logprobs (loss mask 1).
  They are never re-tokenized: the reply's text is decoded from them.
* A later request that starts with the conversation so far (the messages sent before, then
  each reply as it was given, compared by role, text and tool calls: ids and extra fields a
  framework adds or drops do not count) continues the same Sample: only the messages after
  it are rendered, and the template's text for them is appended as context (loss mask 0),
  the way the agent loop does (Renderer.extension).
* The same request again, after one that got no reply (an engine error), is a retry: it
  continues the same Sample.
* A request that does not (the agent edited, dropped, summarised or branched the history, or
  changed its tools, or the template re-renders what the model saw differently) starts a new
  Sample from its own messages: the session ends as several Samples, one per unbroken prefix.
  `prefix_breaks` counts them, `template_drift` the breaks of the last kind.

A session's token budget (--rollout-max-response-len) is per Sample; a request past it is
answered with OpenAI's context_length_exceeded error and the session is marked truncated.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from agentrl.errors import AgentFault, TemplateDriftError
from agentrl.gateway.protocol import ChatRequest, RequestError, assistant_message, message_key, template_message
from agentrl.rollout.agent_loop import LoopSettings, Renderer, _version
from agentrl.rollout.client import GenerateClient
from agentrl.rollout.control import RolloutControl
from agentrl.types import Sample, TurnTiming


@dataclass
class Reply:
    message: dict  # the assistant message as OpenAI gives it
    finish_reason: str  # "stop" | "length" | "tool_calls"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Segment:
    """One unbroken prefix: a Sample and the conversation whose tokens it holds."""

    sample: Sample
    tools_key: str
    history: list[tuple] = field(default_factory=list)  # message_key of every message so far (what comes back)
    rendered: list[dict] = field(default_factory=list)  # the same messages as the template renders them
    seen: str = ""  # the text of sample.tokens


class SessionClosed(RequestError):
    def __init__(self, trajectory_id: str):
        super().__init__(f"session {trajectory_id} has ended (its agent finished, failed or ran out of time)",
                         code="session_closed", status=410)


class Session:
    """The requests of one trajectory, served one at a time (a second request waits for the first)."""

    def __init__(self, *, trajectory_id: str, group_id: int, env_name: str, task: dict, renderer: Renderer,
                 client: GenerateClient, settings: LoopSettings, tool_parser: str | None,
                 control: RolloutControl | None = None, honor_sampling: bool = False,
                 sampling_seed: int | None = None):
        self.trajectory_id, self.group_id, self.env_name, self.task = trajectory_id, group_id, env_name, task
        self.renderer, self.client, self.settings, self.control = renderer, client, settings, control
        self.tool_parser, self.honor_sampling = tool_parser, honor_sampling
        self.sampling_seed = sampling_seed  # the trajectory's: its tokens do not depend on the engine's batching
        self.segments: list[Segment] = []
        self.requests = 0
        self.prefix_breaks = 0
        self.template_drift = 0
        self.truncated = False  # a request found the token budget used up
        self.aborted = False  # the engine aborted a generation (a weight update, without partial rollout)
        self.fault: str | None = None  # what the model wrote made a bounded step fail: reward 0 (AgentFault)
        self.closed = False
        self.disconnects = 0  # streamed replies whose client went away before the end
        self._lock = asyncio.Lock()
        self._stops = set(settings.sampling_params.get("stop_token_ids") or []) | renderer.eos_ids

    # -- the samples ---------------------------------------------------------------------------
    def close(self) -> list[Sample]:
        """End the session: its Samples (one per unbroken prefix), with the session's counts. A
        request still in flight records nothing after this."""
        self.closed = True
        counts = {"gateway_requests": float(self.requests), "gateway_prefix_breaks": float(self.prefix_breaks),
                  "gateway_template_drift": float(self.template_drift)}
        samples = [s.sample for s in self.segments]
        for k, sample in enumerate(samples):
            if len(samples) > 1:
                sample.trajectory_id = f"{self.trajectory_id}-{k}"
                sample.metadata["segment"] = k
            sample.metadata["env_metrics"] = dict(counts)
            sample.validate()
        return samples

    def last_assistant_text(self) -> str | None:
        """The text of the last reply, for a grader when the agent returns nothing."""
        for segment in reversed(self.segments):
            for m in reversed(segment.sample.messages):
                if m["role"] == "assistant":
                    return m.get("content") or ""
        return None

    # -- one request ---------------------------------------------------------------------------
    async def complete(self, request: ChatRequest) -> Reply:
        async with self._lock:
            if self.closed:
                raise SessionClosed(self.trajectory_id)
            self.requests += 1
            if self.requests > self.settings.max_turns:
                self.truncated = True
                raise RequestError(f"session {self.trajectory_id}: the turn limit ({self.settings.max_turns} "
                                   "requests) is reached", code="max_turns_exceeded", param="messages")
            segment = self._segment_for(request)
            return await self._generate(segment, request)

    def _segment_for(self, request: ChatRequest) -> Segment:
        """The Segment this request continues, extended by its new messages; or a new one."""
        keys = [message_key(m) for m in request.messages]
        tools_key = json.dumps(request.tools, sort_keys=True)
        current = self.segments[-1] if self.segments else None
        if current is not None:
            n = len(current.history)
            if current.tools_key == tools_key and keys == current.history and keys[-1][0] != "assistant":
                return current  # the same request again: the last one got no reply (an engine error), a retry
            if current.tools_key == tools_key and len(keys) > n and keys[:n] == current.history:
                new = [template_message(m) for m in request.messages[n:]]
                sample = current.sample
                try:
                    extra, rendered = self.renderer.extension(sample, current.seen, current.rendered + new,
                                                              request.tools, sample.num_turns)
                except TemplateDriftError:
                    self.template_drift += 1
                else:
                    if sample.response_length + len(extra) >= self.settings.max_response_len:
                        self.truncated = True
                        raise RequestError(
                            f"session {self.trajectory_id}: the new messages ({len(extra)} tokens) do not fit the "
                            f"token budget ({self.settings.max_response_len - sample.response_length} left)",
                            code="context_length_exceeded", param="messages")
                    sample.append_observation(extra)
                    sample.messages += new
                    current.seen, current.rendered = rendered, current.rendered + new
                    current.history += keys[n:]
                    return current
            self.prefix_breaks += 1
        rendered = [template_message(m) for m in request.messages]
        seen, prompt_ids = self.renderer.prompt(rendered, request.tools)
        sample = Sample(prompt_tokens=prompt_ids, trajectory_id=self.trajectory_id, group_id=self.group_id,
                        env_name=self.env_name, messages=list(rendered),
                        metadata={"label": self.task.get("label"), **(self.task.get("metadata") or {}),
                                  "tools": request.tools})
        segment = Segment(sample=sample, tools_key=tools_key, history=keys, rendered=rendered, seen=seen)
        self.segments.append(segment)
        return segment

    def _sampling_params(self, request: ChatRequest, budget: int) -> dict:
        params = dict(self.settings.sampling_params)
        if self.sampling_seed is not None:
            params.setdefault("sampling_seed", self.sampling_seed)
        if self.honor_sampling:  # else the run's: the trainer's logprobs assume its temperature
            params.update({k: v for k, v in (("temperature", request.temperature), ("top_p", request.top_p))
                           if v is not None})
        if request.stop:
            params["stop"] = list(params.get("stop") or []) + request.stop
        params["max_new_tokens"] = min(budget, request.max_tokens or budget)
        return params

    async def _generate(self, segment: Segment, request: ChatRequest) -> Reply:
        sample = segment.sample
        budget = self.settings.max_response_len - sample.response_length
        if self.settings.max_tokens_per_turn:
            budget = min(budget, self.settings.max_tokens_per_turn)
        if self.settings.max_context_len is not None:  # --rollout-max-context-len: prompt + response
            budget = min(budget, self.settings.max_context_len - len(sample.tokens))
        if budget <= 0:
            self.truncated = True
            raise RequestError(f"session {self.trajectory_id}: the token budget "
                               f"({self.settings.max_response_len}) is used up", code="context_length_exceeded",
                               param="messages")
        params = self._sampling_params(request, budget)
        turn = sample.num_turns
        timing = TurnTiming()
        out: list[int] = []
        pieces = []  # (ids, logprobs, policy version) of each engine reply of this turn
        while True:
            if self.control is not None:
                await self.control.wait()  # closed while the weights change
            t0 = time.perf_counter()
            stages = sample.metadata.setdefault("stages", {})  # the requests' span (rollout tok/s: agentrl.batches)
            stages.setdefault("first_request_at", time.time())
            result = await self.client.generate(
                sample.tokens + out, {**params, "max_new_tokens": params["max_new_tokens"] - len(out)},
                session_id=self.trajectory_id, rid=f"{self.trajectory_id}-r{self.requests}-{len(out)}",
                lora_path=self.control.lora_adapter if self.control is not None else None)
            timing.generate_s += time.perf_counter() - t0
            stages["last_reply_at"] = time.time()
            out += result.output_ids
            pieces.append((result.output_ids, result.logprobs, _version(result.weight_version)))
            resumable = self.control is not None and self.control.partial_rollout \
                and len(out) < params["max_new_tokens"]
            if result.finish_reason == "abort" and resumable:
                continue  # a weight update interrupted it: go on under the new weights
            break
        if self.closed:  # the agent's time ran out while this was generating: its samples are taken
            raise SessionClosed(self.trajectory_id)
        if result.finish_reason == "abort":
            self.aborted = True
            raise RequestError(f"session {self.trajectory_id}: the engine aborted the generation",
                               code="generation_aborted", status=503, type="server_error")
        for ids, logprobs, version in pieces:
            sample.append_generated(ids, logprobs, version)
        sample.turn_timings.append(timing)
        sample.num_turns = turn + 1
        sample.metadata.setdefault("cached_tokens", []).append(result.cached_tokens)
        sample.metadata.setdefault("turn_prompt_tokens", []).append(result.prompt_tokens)
        segment.seen += self.renderer.decode(out)
        content_ids = out[:-1] if result.finish_reason == "stop" and out and out[-1] in self._stops else out
        raw = self.renderer.decode(content_ids)
        text = raw
        for stop in request.stop:  # OpenAI leaves the stop sequence out of the content
            if text.endswith(stop):
                text = text[:-len(stop)]
                break
        try:
            message = await assistant_message(text, self.tool_parser, request.tools,
                                              call_prefix=f"call_{self.trajectory_id}_{self.requests}")
        except AgentFault as exc:  # a registered parser past its bound on this text: the trajectory scores 0
            self.fault = self.fault or f"tool-call parser: {exc}"
            message = {"role": "assistant", "content": text}
        # the template renders the reply as sampled (tool-call markup included): the tokens the model saw
        segment.rendered.append({"role": "assistant", "content": raw})
        segment.history.append(message_key(message))
        sample.messages.append({**message, "content": raw})
        finish = "length" if result.finish_reason == "length" else "tool_calls" if message.get("tool_calls") else "stop"
        return Reply(message=message, finish_reason=finish, prompt_tokens=len(sample.tokens) - len(out),
                     completion_tokens=len(out))
