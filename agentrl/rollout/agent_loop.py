"""One trajectory: env <-> engine, turn by turn, token-in / token-out.

The policy's tokens are appended exactly as sampled (loss mask 1, logprobs kept). The env's
messages are rendered by the chat template and only the new suffix is tokenized (loss
mask 0): earlier tokens are never re-tokenized. Each time, the template's rendering of
the whole conversation must extend the text the model saw; if it rewrote earlier turns
(for example by dropping past <think> blocks), TemplateDriftError names the turn and the
first differing tokens. A template that cannot reproduce the model's latest reply (it trims a
trailing space) ends that trajectory as the agent's fault, unless it does so in many turns
(Renderer.rewrote_reply).

An observation message flagged ``"continuation": True`` does not open a chat turn: its text
is appended to the assistant's own continuation (Search-R1's form), and the assistant's next
reply goes on in that same turn. With ``--no-apply-chat-template`` every observation is
appended this way (there are no turns). Before such text is appended, the stop token that
ended the model's turn is taken back (never trained on), so the text reads on from the
model's words, as Search-R1's decode with skip_special_tokens does.
"""

from __future__ import annotations

import hashlib
import json
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.env import SAFETY_MAX_TURNS, Action, Env, as_messages
from agentrl.errors import AgentFault, EngineError, TemplateDriftError
from agentrl.tools.parsers import valid_unicode
from agentrl.rollout.client import GenerateClient
from agentrl.rollout.control import RolloutControl
from agentrl.types import Sample, SampleStatus, TurnTiming


# Why a trajectory ended truncated: Sample.metadata["truncation"], counted per reason in the metrics.
TRUNCATED_MAX_TURNS = "max_turns"  # the env's (or --max-turns') turn limit
TRUNCATED_RESPONSE_LEN = "max_response_len"  # the policy's tokens used up --rollout-max-response-len
TRUNCATED_NO_ROOM = "no room for another turn"  # the env's next message would fill the rest of the budget
TRUNCATED_BY_ENV = "env"  # the env's step returned truncated=True
TRUNCATED_SAFETY = "safety_max_turns"  # an env without max_turns never terminated: SAFETY_MAX_TURNS cut it
TRUNCATED_CONTEXT_LEN = "max_context_len"  # prompt + response reached --rollout-max-context-len
TRUNCATION_REASONS = (TRUNCATED_MAX_TURNS, TRUNCATED_RESPONSE_LEN, TRUNCATED_NO_ROOM, TRUNCATED_BY_ENV,
                      TRUNCATED_SAFETY, TRUNCATED_CONTEXT_LEN)


@dataclass(frozen=True)
class LoopSettings:
    max_response_len: int  # token budget for all turns together (policy + env tokens)
    max_turns: int | None  # None: until the env terminates, up to SAFETY_MAX_TURNS
    sampling_params: dict  # SGLang sampling params: temperature, top_p, top_k, stop_token_ids, ...
    apply_chat_template: bool = True
    max_tokens_per_turn: int | None = None  # None: a turn may use the whole remaining budget
    max_context_len: int | None = None  # cap on prompt + response tokens (slime's --rollout-max-context-len)
    skip_special_tokens: bool = False  # the env reads each turn's text without special tokens (slime's)


PROMPT_CACHE_SIZE = 256
SUFFIX_CACHE_SIZE, SUFFIX_CACHE_MAX_CHARS = 1024, 2048  # encodings of short texts between turns (Renderer._encode_suffix)
REPLY_DRIFTS_LOUD = 16  # replies rewritten by the template before a quarter of the turns is the template's fault
PIECE_CACHE_SIZE = 1 << 20  # token id -> its text (Renderer.token_texts): more than any vocabulary

try:  # what tokenizer.apply_chat_template renders with (transformers >= 4.43)
    from transformers.utils.chat_template_utils import render_jinja_template as _render_jinja_template
except ImportError:
    _render_jinja_template = None
try:  # the compiled templates it keeps (a private name: without it, every rendering goes through it)
    from transformers.utils.chat_template_utils import _compile_jinja_template
except ImportError:
    _compile_jinja_template = None

# Messages with only these keys, all plain str, render_jinja_template passes to the template
# unchanged (its copying to plain types and aliasing of reasoning fields change nothing), so
# the agent loop renders them with the compiled template directly (that copying took a fifth
# of the rendering time).
_PLAIN_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_call_id"})


def _fast_sandbox_template(compiled, source: str):
    """`compiled` (the template `source` of transformers' sandboxed environment) recompiled in a copy of
    that environment whose attribute lookup skips the sandbox's checks where their answer is
    known: a key of a plain dict (`message.role`: no dict attribute of that name, so the
    sandbox would look the key up too) and a public attribute of a loop (`loop.first`: the
    sandbox allows every name without a leading underscore on it). Everything else, and every
    other environment, goes through the sandbox as before: the same text, the same refusals.
    The sandbox's checks were more than half of a rendering's time. None: not such an environment."""
    try:
        from jinja2.runtime import LoopContext
        from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment
    except ImportError:
        return None
    base = type(compiled.environment)
    if base not in (SandboxedEnvironment, ImmutableSandboxedEnvironment) or compiled.environment.is_async:
        return None
    dict_attrs = frozenset(dir(dict))

    class _Fast(base):
        def getattr(self, obj, attribute):
            kind = type(obj)
            if kind is dict and attribute not in dict_attrs:
                try:
                    return obj[attribute]
                except KeyError:
                    return self.undefined(obj=obj, name=attribute)
            if kind is LoopContext and attribute[:1] != "_":
                try:
                    return getattr(obj, attribute)
                except AttributeError:
                    pass
            return super().getattr(obj, attribute)

    environment = compiled.environment.overlay()  # the same filters, globals, extensions and options
    environment.__class__ = _Fast
    template = environment.from_string(source)
    # its globals as one plain dict (a ChainMap of the template's and the environment's, fixed
    # once transformers compiled the template): every rendering copies them into its context
    template.globals = dict(template.globals)
    return template


_FAST_TEMPLATES: dict[str, Any] = {}  # template text -> compiled (Renderer._compiled), shared like transformers' own


def _plain_messages(turns: list[dict]) -> bool:
    for m in turns:  # plain loops: this runs over the whole conversation every turn
        if type(m) is not dict or not m.keys() <= _PLAIN_MESSAGE_KEYS:
            return False
        for value in m.values():
            if type(value) is not str:
                return False
    return True


def _is_plain_json(value) -> bool:
    """Only dicts with str keys, lists, str, int, float, bool and None (what the template may see as is)."""
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) is dict:
        return all(type(k) is str and _is_plain_json(v) for k, v in value.items())
    return type(value) is list and all(_is_plain_json(v) for v in value)


def _own_backend(tokenizer):
    """A private copy of a fast tokenizer's Rust tokenizer: encode/decode without transformers'
    per-call wrapping (the same ids and text: tests/test_agent_loop.py checks), and never under
    truncation or padding that other users of the shared tokenizer set on its backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return None
    from tokenizers import Tokenizer

    own = Tokenizer.from_str(backend.to_str())
    own.no_truncation()
    own.no_padding()
    return own


class Renderer:
    """Renders a conversation to text, with the chat template or by plain concatenation."""

    def __init__(self, tokenizer, apply_chat_template: bool = True, template_kwargs: dict | None = None,
                 processor=None):
        self.tokenizer = tokenizer
        # a vision-language model's HF processor (--multimodal-keys): the prompt's ids are its, each image's
        # placeholder expanded to the image's tokens; vision_ids: the tokens that mark media (vision.py)
        self.processor = processor
        self.vision_ids: set[int] = set()
        if processor is not None:
            from agentrl.vision import vision_token_ids

            self.vision_ids = vision_token_ids(processor)
        self.apply_chat_template = apply_chat_template
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise TemplateDriftError("--apply-chat-template is set but the tokenizer has no chat template")
        self._backend = _own_backend(tokenizer)
        self._extra = dict(template_kwargs or {})  # --apply-chat-template-kwargs: the template's own variables
        self._template_kwargs = {**tokenizer.special_tokens_map, **self._extra} if apply_chat_template else {}
        self._direct = _compile_jinja_template is not None and _is_plain_json(self._template_kwargs)
        self._prompts: dict[str, tuple[str, list[int]]] = {}  # a group's members share their first rendering
        self._suffixes: dict[str, tuple[int, ...]] = {}  # text between turns -> its tokens (_encode_suffix)
        self._pieces: dict[int, str] = {}  # token id -> its text alone (token_texts)
        self.extensions = self.reply_drifts = 0  # re-renderings between turns; those that rewrote the reply
        # where SGLang stops: the tokenizer's eos and the model folder's (Gemma ends a turn at <end_of_turn>)
        self.eos_ids = {getattr(tokenizer, "eos_token_id", None)} | _model_eos_ids(tokenizer)
        self.eos_ids.discard(None)
        self._turn_end: str | None = None  # the template's text right after a reply (ends_turn)

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> tuple[str, list[int]]:
        """The rendering of the episode's first messages and its tokens. Remembered for a while:
        the n members of a group (and a prompt seen again) render the same messages."""
        try:
            key = json.dumps([messages, tools])
        except (TypeError, ValueError):  # not plain JSON: render it every time
            key = None
        if key is not None and key in self._prompts:
            text, ids = self._prompts[key]
            return text, list(ids)
        text = self.render(messages, tools)
        images = self.images(messages)
        ids = self._processor_ids(text, images) if images else self.encode(text)
        if key is not None:
            if len(self._prompts) >= PROMPT_CACHE_SIZE:
                self._prompts.pop(next(iter(self._prompts)))  # the oldest
            self._prompts[key] = (text, list(ids))
        return text, ids

    def images(self, messages: list[dict]) -> list[str]:
        """The messages' images (data URLs), for a vision-language model; [] for a text one."""
        if self.processor is None:
            return []
        from agentrl.vision import message_images

        return message_images(messages)

    def _processor_ids(self, text: str, images: list[str]) -> list[int]:
        """The prompt's ids as the model's processor makes them: each image placeholder of `text`
        expanded to that image's tokens (slime's processor(text=prompt, images=...))."""
        from agentrl.vision import open_data_url

        out = self.processor(text=[text], images=[open_data_url(u) for u in images], add_special_tokens=False,
                             return_tensors="pt")
        return out["input_ids"][0].tolist()

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        if not self.apply_chat_template:
            return "".join(str(m["content"]) for m in messages)
        turns, open_turn = [], False  # open_turn: the last assistant turn is being continued
        for i, m in enumerate(messages):
            if m.get("continuation") or (open_turn and m.get("role") == "assistant"):
                if not turns or turns[-1].get("role") != "assistant":
                    raise ValueError(f"message {i} ({m.get('role')}): a continuation must follow the assistant's "
                                     "reply; it appends to it")
                turns[-1] = {**turns[-1], "content": str(turns[-1]["content"]) + str(m["content"])}
                open_turn = True
            else:
                turns.append(m)
                open_turn = False
        if open_turn:  # the generation prompt, then the assistant's text so far: the model goes on from there
            return self._apply_template(turns[:-1], tools or None) + turns[-1]["content"]
        return self._apply_template(turns, tools or None)

    def _apply_template(self, turns: list[dict], tools: list[dict] | None) -> str:
        """tokenizer.apply_chat_template(turns, tools=tools, tokenize=False, add_generation_prompt=True),
        without its per-call set-up when the messages are plain dicts (the agent loop's): the
        same template, the same renderer, the same variables."""
        if self._direct and _render_jinja_template is not None and _plain_messages(turns) \
                and (tools is None or _is_plain_json(tools)):  # plain dicts of str: no None, the one check
            return self._compiled(self.tokenizer.get_chat_template(None, tools)).render(
                messages=turns, tools=tools, documents=None, add_generation_prompt=True, **self._template_kwargs)
        if _render_jinja_template is None or not all(type(m) is dict and None not in m.values() for m in turns):
            return self.tokenizer.apply_chat_template(turns, tools=tools, tokenize=False, add_generation_prompt=True,
                                                      **self._extra)
        template = self.tokenizer.get_chat_template(None, tools)
        rendered, _ = _render_jinja_template(conversations=[turns], tools=tools, chat_template=template,
                                             add_generation_prompt=True, **self._template_kwargs)
        return rendered[0]

    @staticmethod
    def _compiled(template: str):
        """The compiled template, with the sandbox's fast lookups where they apply (_fast_sandbox_template)."""
        compiled = _FAST_TEMPLATES.get(template)
        if compiled is None:
            compiled = _compile_jinja_template(template)
            compiled = _fast_sandbox_template(compiled, template) or compiled
            if len(_FAST_TEMPLATES) >= 16:
                _FAST_TEMPLATES.pop(next(iter(_FAST_TEMPLATES)), None)  # the oldest
            _FAST_TEMPLATES[template] = compiled
        return compiled

    def ends_turn(self, token: int) -> bool:
        """Whether the template closes an assistant reply with `token`'s text (<|im_end|> in ChatML),
        so that rendering the reply without it gives the token back. A stop token it does not put
        there (an eos read wrong, <|endoftext|> in a ChatML model, a --rollout-stop-token-ids
        token) stays in the reply's message, so the next rendering still extends what the model
        saw; the env reads the reply without it either way. Without a chat template: True."""
        if not self.apply_chat_template:
            return True
        if self._turn_end is None:
            sentinel = "\x00reply\x00"
            try:
                rendered = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": sentinel}], None)
                self._turn_end = rendered[rendered.index(sentinel) + len(sentinel):]
            except Exception:  # a template that refuses the probe: the tokenizer's eos ends a turn
                self._turn_end = self.decode([self.tokenizer.eos_token_id]) if self.tokenizer.eos_token_id is not None else ""
        text = self.token_texts([token])[0]
        return bool(text) and self._turn_end.startswith(text)

    def rewrote_reply(self, messages: list[dict], tools: list[dict] | None, before: str, reply: str,
                      drift: TemplateDriftError) -> bool:
        """Whether a drift (`drift`, raised by `extension`) lies in the model's latest reply: the
        rendering keeps everything before it (`before`) but not the reply's text (`reply`), as a
        template that trims the content does when the model ends on a space. That is what the
        model wrote, not how the run is set up: the trajectory ends as the agent's fault. A
        rewritten history, or a stop token the template does not render at the end of the turn,
        stays a TemplateDriftError; so do replies rewritten in a quarter of the turns (at least
        REPLY_DRIFTS_LOUD of them): the template, not the model, is then the cause."""
        rendered = self.render(messages, tools)
        if not rendered.startswith(before) or rendered.startswith(before + reply):
            return False
        self.reply_drifts += 1
        if self.reply_drifts >= REPLY_DRIFTS_LOUD and 4 * self.reply_drifts >= self.extensions:
            raise TemplateDriftError(f"the chat template rewrote the model's reply in {self.reply_drifts} of "
                                     f"{self.extensions} turns; the latest: {drift}") from drift
        return True

    def continues(self, observation: list[dict]) -> bool:
        """Whether `observation` is appended to the assistant's turn rather than opening a new one."""
        return not self.apply_chat_template or bool(observation and observation[0].get("continuation"))

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, tokens: list[int], skip_special_tokens: bool = False) -> str:
        if self._backend is not None:
            return self._backend.decode(tokens, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def token_texts(self, tokens) -> tuple[str, ...]:
        """decode([t]) of each token t (Action.token_texts), from a table of the tokens met before:
        target-token's step read 1,024 of them through 1,024 decode calls (~0.7 ms, holding the
        GIL, so the event loop waited behind it). Only with the private backend, whose decoding
        no one else can change. Entries are only ever added (a sync env's step may run this in a
        worker thread while the event loop runs it too)."""
        if self._backend is None:
            return tuple(self.decode([t]) for t in tokens)
        pieces = self._pieces
        missing = list(set(tokens).difference(pieces))
        if missing:
            decoded = dict(zip(missing, self._backend.decode_batch([[t] for t in missing], skip_special_tokens=False)))
            if len(pieces) + len(decoded) > PIECE_CACHE_SIZE:  # a full table (no vocabulary is that large)
                return tuple(pieces[t] if t in pieces else decoded[t] for t in tokens)
            pieces.update(decoded)
        return tuple(map(pieces.__getitem__, tokens))

    def extension(self, sample: Sample, seen: str, messages: list[dict], tools: list[dict] | None,
                  turn: int) -> tuple[list[int], str]:
        """Tokens that extend `sample` (whose text is `seen`) to the rendering of `messages`,
        and that rendering; TemplateDriftError if the rendering does not extend `seen`."""
        self.extensions += 1
        new = self.suffix(sample, seen, messages, tools, turn)
        return self._encode_suffix(new), seen + new

    def _encode_suffix(self, text: str) -> list[int]:
        """encode(text), remembered for short texts: the template's text between turns (end of
        turn, the env's message, the generation prompt) recurs across trajectories. Only with
        the private backend, whose encoding no one else can change."""
        if self._backend is None or len(text) > SUFFIX_CACHE_MAX_CHARS:
            return self.encode(text)
        ids = self._suffixes.get(text)
        if ids is None:
            ids = tuple(self.encode(text))
            if len(self._suffixes) >= SUFFIX_CACHE_SIZE:
                self._suffixes.pop(next(iter(self._suffixes)))  # the oldest
            self._suffixes[text] = ids
        return list(ids)

    def suffix(self, sample: Sample, seen: str, messages: list[dict], tools: list[dict] | None, turn: int) -> str:
        """The text the rendering of `messages` adds after `seen` (the text of `sample`'s tokens);
        TemplateDriftError if the rendering does not extend `seen`."""
        rendered = self.render(messages, tools)
        if not rendered.startswith(seen):
            ours, theirs = sample.tokens, self.encode(rendered)
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise TemplateDriftError(
                f"turn {turn}: the chat template re-rendered earlier tokens differently from what the model saw; "
                f"first difference at token {at}: model saw {ours[at:at + 8]} ({self.decode(ours[at:at + 8])!r}), "
                f"template now gives {theirs[at:at + 8]} ({self.decode(theirs[at:at + 8])!r}). "
                "Use a chat template that only appends (e.g. keep past reasoning), or --no-apply-chat-template."
            )
        return rendered[len(seen):]


def _model_eos_ids(tokenizer) -> set[int]:
    """The eos ids of the model folder the tokenizer came from (generation_config.json, config.json):
    SGLang stops at them as well as at the tokenizer's."""
    ids: set[int] = set()
    folder = getattr(tokenizer, "name_or_path", None)
    if not folder or not Path(folder).is_dir():
        return ids
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((Path(folder) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        ids |= {v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)}
    return ids


def trajectory_sampling_seed(seed: int, trajectory_id: str) -> int:
    """The engine's `sampling_seed` for one trajectory: its tokens then depend on the run's seed
    and which trajectory it is, not on what else the engine batched with it (the embedded engine
    always; SGLang under --sglang-enable-deterministic-inference)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{trajectory_id}".encode()).digest()[:4], "little")


async def run_trajectory(env: Env, task: dict[str, Any], *, renderer: Renderer, client: GenerateClient,
                         settings: LoopSettings, trajectory_id: str, group_id: int, seed: int,
                         env_name: str = "", control: RolloutControl | None = None) -> Sample:
    """Play one episode. Never raises for env or engine failures: the Sample says FAILED."""
    sample = Sample(prompt_tokens=[], trajectory_id=trajectory_id, group_id=group_id, env_name=env_name,
                    metadata={"label": task.get("label"), **(task.get("metadata") or {})})
    messages: list[dict] = []
    total_reward = 0.0
    reward_parts: dict[str, float] | None = None
    # where this trajectory's time went, stage by stage (rollout_stage_metrics sums them per batch)
    stages = sample.metadata.setdefault("stages", {})
    clock = time.perf_counter
    try:
        t0 = clock()
        obs, info = await env.areset(seed=seed, options=task or None)  # {}: a seed-only task
        stages["reset_s"] = clock() - t0
        messages = list(as_messages(obs))  # its own list: the task's prompt is shared by the group (and reused)
        tools = info.get("tools")
        t0 = clock()
        seen, sample.prompt_tokens = renderer.prompt(messages, tools)  # the text of every token so far
        sample.images = renderer.images(messages)
        stages["prompt_s"] = clock() - t0
        stops = set(settings.sampling_params.get("stop_token_ids") or []) | renderer.eos_ids
        sampling_seed = trajectory_sampling_seed(seed, trajectory_id)
        turn_limit = settings.max_turns or SAFETY_MAX_TURNS
        # the response budget: prompt + response within the context cap, when that is the tighter one
        max_len, length_reason = settings.max_response_len, TRUNCATED_RESPONSE_LEN
        if settings.max_context_len is not None and settings.max_context_len - len(sample.prompt_tokens) < max_len:
            max_len, length_reason = max(0, settings.max_context_len - len(sample.prompt_tokens)), TRUNCATED_CONTEXT_LEN
        limit_reason = TRUNCATED_MAX_TURNS if settings.max_turns else TRUNCATED_SAFETY
        status, truncation = SampleStatus.TRUNCATED, limit_reason  # why, if it ends truncated
        for turn in range(turn_limit):
            budget = max_len - sample.response_length
            if budget <= 0:
                truncation = length_reason
                break
            if settings.max_tokens_per_turn:
                budget = min(budget, settings.max_tokens_per_turn)
            timing = TurnTiming()
            sample.turn_timings.append(timing)
            sample.num_turns = turn + 1
            out: list[int] = []  # this turn's tokens, across resumed generations
            before = seen
            while True:
                if control is not None:
                    t0 = clock()
                    await control.wait()  # closed while the weights change
                    _add(stages, "gate_wait_s", clock() - t0)
                t0 = clock()
                stages.setdefault("first_request_at", time.time())
                media = {"image_data": sample.images} if sample.images else {}
                result = await client.generate(sample.tokens, {"sampling_seed": sampling_seed,
                                                               **settings.sampling_params,
                                                               "max_new_tokens": budget - len(out)},
                                               session_id=trajectory_id, rid=f"{trajectory_id}-t{turn}-{len(out)}",
                                               lora_path=control.lora_adapter if control is not None else None,
                                               **media)
                if media and result.prompt_tokens != len(sample.tokens):
                    raise EngineError(f"the engine read {result.prompt_tokens} prompt tokens where {len(sample.tokens)} "
                                      "were sent with the images: it expanded their placeholders otherwise than the "
                                      "model's processor (its image size limits differ?); the trajectory's tokens would "
                                      "not be the ones the engine saw")
                timing.generate_s += clock() - t0
                stages["last_reply_at"] = time.time()
                _add(stages, "generate_s", clock() - t0)
                _add(stages, "requests", 1)
                t0 = clock()
                sample.append_generated(result.output_ids, result.logprobs, _version(result.weight_version))
                if getattr(result, "routed_experts", None) is not None:  # R3: the latest covers every token
                    sample.routed_experts = result.routed_experts
                out += result.output_ids
                # the turn's tokens decoded whole: a character whose bytes a resume split in two
                # decodes right only with both halves
                seen = before + renderer.decode(out)
                sample.metadata.setdefault("cached_tokens", []).append(result.cached_tokens)
                sample.metadata.setdefault("turn_prompt_tokens", []).append(result.prompt_tokens)
                _add(stages, "decode_s", clock() - t0)
                resumable = control is not None and control.partial_rollout and len(out) < budget
                if result.finish_reason == "abort" and resumable:
                    sample.metadata["resumed"] = sample.metadata.get("resumed", 0) + 1
                    continue  # a weight update interrupted it: go on under the new weights
                break
            if result.finish_reason == "abort":
                status = SampleStatus.ABORTED
                break
            if written := renderer.vision_ids.intersection(out):  # a placeholder with no image behind it
                total_reward, reward_parts, status = 0.0, None, SampleStatus.COMPLETED
                sample.metadata["agent_fault"] = (f"the model wrote media placeholder tokens {sorted(written)}, which "
                                                  "no request may hold without their image")
                break
            t0 = clock()
            content_ids = out[:-1] if result.finish_reason == "stop" and out and out[-1] in stops else out
            # the whole turn is `seen` past `before` (decoded just above): not decoded twice
            text = seen[len(before):] if content_ids is out else renderer.decode(content_ids)
            skip = settings.skip_special_tokens  # the env's text only: the template must extend what the model saw
            action = Action.build(renderer.decode(content_ids, skip_special_tokens=True) if skip else text,
                                  content_ids, renderer.decode, renderer.token_texts)
            _add(stages, "decode_s", clock() - t0)
            stopped = out[len(content_ids):]  # the stop token that ended the turn, if any
            # the reply as the template must render it: with the stop token unless the template ends turns with it
            reply = {"role": "assistant", "content": text if not stopped or renderer.ends_turn(stopped[-1])
                     else seen[len(before):]}
            messages.append(reply)

            t0 = time.perf_counter()
            try:
                obs, reward, terminated, truncated, info = await env.astep(action)
            except AgentFault as exc:  # any env: what the agent's output broke ends it scored 0, not FAILED
                obs, reward, terminated, truncated, info = [], 0.0, True, False, {"agent_fault": f"{type(exc).__name__}: {exc}"}
            timing.env_s = time.perf_counter() - t0
            _add(stages, "env_s", timing.env_s)
            if isinstance(info, dict) and isinstance(info.get("metrics"), dict):
                # the env's own per-episode counts (searches, answered, ...): metrics env/NAME_mean
                counts = sample.metadata.setdefault("env_metrics", {})
                for name, value in info["metrics"].items():
                    counts[name] = counts.get(name, 0.0) + float(value)
            if isinstance(info, dict) and info.get("agent_fault"):  # the agent broke its own episode: scored, not FAILED
                sample.metadata["agent_fault"] = info["agent_fault"]
            total_reward, reward_parts = _added(reward, total_reward, reward_parts)
            if terminated:
                status = SampleStatus.COMPLETED
                break
            if truncated or sample.response_length >= max_len or turn + 1 == turn_limit:
                truncation = (TRUNCATED_BY_ENV if truncated else length_reason
                              if sample.response_length >= max_len else limit_reason)
                break
            obs = [_valid_message(m) for m in as_messages(obs)]
            if renderer.images(obs):
                raise ValueError(f"turn {turn + 1}: the env's observation holds images; agentrl carries the prompt's "
                                 "images only (a later image would need its own processor expansion)")
            messages += obs
            # tool results shown to the model (metrics: tool_calls_mean)
            sample.metadata["tool_calls"] = sample.metadata.get("tool_calls", 0) + sum(m.get("role") == "tool" for m in obs)
            if stopped and renderer.continues(obs):  # the env's text reads on from the model's words
                stop_text = renderer.decode(stopped)
                if not seen.endswith(stop_text):
                    raise TemplateDriftError(f"turn {turn}: the text does not end with the stop token {stop_text!r}")
                sample.retract_generated(len(stopped))
                seen = seen[:len(seen) - len(stop_text)]
                reply["content"] = text
            t0 = clock()
            try:
                extra, rendered = renderer.extension(sample, seen, messages, tools, turn + 1)
            except TemplateDriftError as exc:
                if not renderer.rewrote_reply(messages, tools, before, reply["content"], exc):
                    raise
                # the template cannot reproduce what the model wrote: the model's doing, scored 0
                total_reward, reward_parts, status = 0.0, None, SampleStatus.COMPLETED
                sample.metadata["agent_fault"] = f"TemplateDriftError: {exc}"
                break
            _add(stages, "render_s", clock() - t0)  # the chat template and the new suffix's tokens
            if sample.response_length + len(extra) >= max_len:
                truncation = TRUNCATED_NO_ROOM  # the env's message fills the response budget
                break
            sample.append_observation(extra)
            seen = rendered
        if status == SampleStatus.TRUNCATED and truncation != TRUNCATED_BY_ENV and hasattr(env, "atruncated"):
            t0 = clock()
            try:  # what the work of a cut-off episode is worth (the code env grades the file written)
                late = await env.atruncated(truncation)
            except AgentFault as exc:
                late, sample.metadata["agent_fault"] = 0.0, f"{type(exc).__name__}: {exc}"
            if late is not None:
                before = total_reward
                total_reward, reward_parts = _added(late, total_reward, reward_parts)
                sample.metadata["truncated_reward"] = total_reward - before
            _add(stages, "env_s", clock() - t0)  # the env's work, as a final answer's grading in its step
        sample.status = status
        if status == SampleStatus.TRUNCATED:
            sample.metadata["truncation"] = truncation
        sample.reward = {**reward_parts, "score": total_reward} if reward_parts else total_reward
    except TemplateDriftError:
        raise  # a configuration bug, not a per-trajectory accident: stop the run loudly
    except Exception as exc:  # infrastructure or env failure: masked, counted, run goes on
        sample.status = SampleStatus.FAILED
        sample.reward = 0.0
        sample.metadata["error"] = f"{type(exc).__name__}: {exc}"
        sample.metadata["traceback"] = traceback.format_exc()
    finally:
        t0 = clock()
        try:
            await env.aclose()
        except Exception as exc:
            sample.metadata["close_error"] = repr(exc)
        stages["close_s"] = clock() - t0
    sample.messages = messages
    if sample.prompt_tokens:
        sample.validate()
    return sample


def _added(reward, total: float, parts: dict | None) -> tuple[float, dict | None]:
    """The episode's reward so far and its parts after one more reward (a number, or a dict
    whose "score" counts and whose other keys are the latest parts)."""
    if isinstance(reward, dict):
        return total + float(reward.get("score", 0.0)), {k: float(v) for k, v in reward.items()}
    return total + float(reward), parts


def _add(stages: dict, key: str, value: float) -> None:
    stages[key] = stages.get(key, 0) + value


def _valid_message(message: dict) -> dict:
    """An env message whose text echoes the model's escapes (a tool result with ``\\ud800`` decoded)
    may hold lone surrogates, which the tokenizer refuses (TypeError): they become U+FFFD."""
    content = message.get("content")
    if isinstance(content, str) and valid_unicode(content) is not content:
        return {**message, "content": valid_unicode(content)}
    return message


def _version(weight_version: str) -> int:
    try:
        return int(weight_version)
    except ValueError:
        return 0
