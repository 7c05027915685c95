"""Fuzz targets for issue 31 ("the policy is an adversary"): every built-in env, tool-call
parser and grader, the MCP client's argument path and the files tool server, fed random
and hostile strings.

Each `Target` has a hypothesis strategy and a `check(example)` that raises when a property
breaks. The property is always the same: whatever the model writes ends as a result (an
error observation, or the episode scored 0 with a reason), never as an exception, and
within a time bound. tests/fuzz/test_fuzz.py runs each target briefly with a fixed seed;
``bench/fuzz.py --minutes N`` runs them for longer and writes bench/results/fuzz.md.

The hostile strings (`hostile_text`) mix tag soup (``<tool_call>`` inside ``<tool_call>``,
unclosed tags, ``\\boxed{`` unbalanced), deep nesting (up to 200,000 brackets), integers past
Python's 4300-digit limit, lone surrogates (raw and as JSON escapes), NUL and control
characters, Unicode normalisation bombs (U+FDFA is 18 characters under NFKC), megabyte
runs, and the attack strings of the issue.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hypothesis import HealthCheck, example, given, settings, strategies as st

# ---- hostile strings ------------------------------------------------------------------------------
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', ":", ",", '"name": "echo"', '"arguments": ',
    '{"text": "hi"}', '"arguments": "{\\"text\\": 1}"', '"function": ', "\\ud800", "\\udfff", "\ud800", "\udfff",
    "\\boxed{", "\\boxed", "\\fbox{", "10^{10}!", "\\frac{1}{", "<search>", "</search>", "<answer>", "</answer>",
    "<think>", "```python\n", "```", "```py", "<function=", "<function=echo>", "<parameter=", "<parameter=text>",
    "</parameter>", "</function>", "\x00", "\x1b[2J", "\r", "\n", "\t", " ", "\u200b", "\u202e", "\ufdfa", "\u0130",
    "\ufeff", "\U0001F600", "1e999", "NaN", "-", "9" * 5000, "'", "(", ")", "\\", "$", "%", "&", "a", "the",
]


def _repeat(fragment: str, n: int) -> str:
    return fragment * max(1, n // max(1, len(fragment)))


def hostile_text(max_big: int = 1_000_000) -> st.SearchStrategy[str]:
    """Random and adversarial model output (see the module docstring)."""
    unicode_text = st.text(st.characters(exclude_categories=()), max_size=200)  # surrogates and controls included
    soup = st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)
    deep = st.tuples(st.sampled_from(["[", "{", "(", "{\"a\":", "\\boxed{", "<tool_call>", "<parameter=x>["]),
                     st.integers(1, 200_000)).map(lambda t: t[0] * t[1])
    big = st.tuples(st.sampled_from(FRAGMENTS), st.integers(1000, max_big)).map(lambda t: _repeat(t[0], t[1]))
    attacks = st.sampled_from(ATTACKS)
    part = st.one_of(unicode_text, soup, deep, big, attacks)
    return st.lists(part, min_size=1, max_size=4).map("".join)


DEEP_JSON = "[" * 100_000 + "]" * 100_000
ATTACKS = [
    f"<tool_call>{DEEP_JSON}</tool_call>",                                                  # RecursionError
    '<tool_call>{"name": "echo", "arguments": {"text": ' + "1" * 5000 + "}}</tool_call>",     # ValueError, digits
    '<tool_call>{"name": "echo", "arguments": {"text": "\\ud800"}}</tool_call>',             # lone surrogate escape
    '<tool_call>{"name": "echo", "arguments": {"text": ' + "[" * 500 + "]" * 500 + "}}</tool_call>",  # SDK depth
    "<tool_call>\n<function=echo>\n<parameter=xs>\n" + "[" * 100_000 + "\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=echo>\n<parameter=n>\n" + "9" * 5000 + "\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=f>\n<parameter=v>\n" + "[" * 100_000 + "\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>" + "<function=" * 100_000,                                                  # regex backtracking
    "<tool_call><function=echo>" + "<parameter=" * 100_000,
    "<search>" * 100_000,
    "```" + "\n" * 500_000,
    "\\boxed{10^{10}!}", "\\boxed{10^{10^{10}}}", "\\boxed{(10^{10})!!}", "\\boxed{" + "{" * 500_000 + "}" * 500_000 + "}",
    "\\boxed{" * 100_000,
    '<tool_call>{"name": "echo", "arguments": {"text": "x"}}</tool_call>' * 20_000,          # many calls, one turn
    "\ufdfa" * 100_000,                                                                     # NFKC bomb
    "<tool_call><tool_call>{\"name\": \"echo\"}</tool_call></tool_call>",
    "<answer>" + "a " * 300_000 + "</answer>",
]


# ---- the harness ----------------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    check: Callable[[Any], None]
    strategy: st.SearchStrategy = field(default_factory=hostile_text)
    suite_examples: int = 40  # the short run in the test suite
    examples: list = field(default_factory=lambda: list(ATTACKS))  # always run first (hypothesis @example)
    start: Callable[[], None] | None = None   # once, before the examples (servers, event loops)
    stop: Callable[[], None] | None = None


@contextmanager
def within(seconds: float, what: str):
    t0 = time.perf_counter()
    yield
    took = time.perf_counter() - t0
    assert took < seconds, f"{what} took {took:.1f} s (bound {seconds:g} s)"


class FuzzFailure(AssertionError):
    """A property broke: the target, what broke, and the (shrunk) example, cut to be readable."""


def summary(example: Any, limit: int = 300) -> str:
    text = repr(example)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters in all)"


def run_target(target: Target, *, max_examples: int, derandomize: bool = True, seed: int | None = None) -> None:
    """Run `target` for `max_examples` examples; FuzzFailure for the first (shrunk) failure."""
    failing: list[Any] = []

    @settings(max_examples=max_examples, derandomize=derandomize, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(target.strategy)
    def prop(example):
        try:
            target.check(example)
        except BaseException:
            failing[:] = [example]
            raise

    for known in target.examples:
        prop = example(known)(prop)
    if seed is not None and not derandomize:
        from hypothesis import seed as with_seed
        prop = with_seed(seed)(prop)
    if target.start:
        target.start()
    try:
        prop()
    except Exception as e:  # hypothesis' own report holds the whole example: megabytes
        cause = e
        while isinstance(cause, BaseExceptionGroup) and cause.exceptions:  # FlakyFailure: what failed first
            cause = cause.exceptions[0]
        what = str(cause).splitlines()[0][:500] if str(cause) else ""
        if cause is not e:
            what = f"{type(cause).__name__} ({type(e).__name__}: it did not fail again on replay): {what}"
        raise FuzzFailure(f"{target.name}: {type(e).__name__}: {what}\non example "
                          f"{summary(failing[0]) if failing else '?'}") from None
    finally:
        if target.stop:
            target.stop()


def encodable(text: str) -> None:
    """Text that reaches a tokenizer or a pipe must be valid UTF-8."""
    text.encode("utf-8")


class Loop:
    """One event loop for a target's examples (servers it starts live across them)."""

    def __init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self.loop = asyncio.new_event_loop()

    def stop(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def run(self, coro, timeout: float):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))


def check_step_result(result, what: str) -> None:
    obs, reward, terminated, truncated, info = result
    assert isinstance(info, dict), what
    score = reward.get("score", 0.0) if isinstance(reward, dict) else reward
    assert isinstance(score, (int, float)) and 0.0 <= float(score) <= 1.0, f"{what}: reward {reward!r}"
    if isinstance(obs, str):
        encodable(obs)
    else:
        for m in obs:
            encodable(str(m.get("content", "")))


# ---- parsers and the client's argument path ----------------------------------------------------------
def _check_parser(parser: str):
    def check(text: str) -> None:
        from agentrl.tools.client import wire_arguments
        from agentrl.tools.parsers import ToolCall, ToolCallError, parse_tool_calls

        schemas = {"echo": {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"},
                                                             "xs": {"type": "array"}}}}
        with within(5, f"{parser} on {len(text)} characters"):
            items = parse_tool_calls(text, parser, schemas)
        for item in items[:50]:
            assert isinstance(item, (ToolCall, ToolCallError)) and item.id
            if isinstance(item, ToolCall):
                assert isinstance(item.arguments, dict) and item.name.strip()
                encodable(item.name)
                args, problem = wire_arguments(item.arguments)
                if not problem:  # what the MCP SDK's writer does with it must not raise
                    _jsonrpc_line(item.name, args)
            else:
                encodable(item.error)
    return check


def _jsonrpc_line(name: str, args: dict) -> bytes:
    from mcp.types import JSONRPCRequest

    request = JSONRPCRequest(jsonrpc="2.0", id=1, method="tools/call", params={"name": name, "arguments": args})
    return (request.model_dump_json(by_alias=True, exclude_unset=True) + "\n").encode()


# ---- envs -------------------------------------------------------------------------------------------
def echo(text: str = "", n: int = 0) -> str:
    """Echo the text."""
    return text


def _tool_env_target() -> Target:
    """A ToolEnv with one function tool: parsing, argument checks, the calls, the observation."""
    from agentrl.tools.env import ToolEnv

    class EchoEnv(ToolEnv):
        function_tools = (echo,)
        max_turns = 4

    loop, env = Loop(), EchoEnv()

    def start():
        loop.start()
        loop.run(env.areset(options={"prompt": "hi"}), 60)

    def check(text):
        with within(10, f"ToolEnv.astep on {len(text)} characters"):
            result = loop.run(env.astep(text), 30)
        check_step_result(result, "ToolEnv")
        assert len(result[0]) <= env.max_tool_calls_per_turn + 1  # the rest are one message

    def stop():
        loop.run(env.aclose(), 30)
        loop.stop()

    return Target("tool-env (hermes, function tool)", check, start=start, stop=stop)


def _target_token() -> Target:
    from agentrl.envs.target_token import TargetTokenEnv

    env = TargetTokenEnv()

    def check(text):
        env.reset(seed=0)
        with within(5, "target-token step"):
            check_step_result(env.step(text), "target-token")

    return Target("env target-token", check)


def _math() -> Target:
    from agentrl.envs.math_env import MathEnv, last_boxed
    from agentrl.envs.math_env.grader import GRADE_TIMEOUT_S

    loop, env = Loop(), MathEnv()
    boxed = st.one_of(hostile_text(), hostile_text(2000).map(lambda t: f"so \\boxed{{{t[:400]}}}"))

    def check(text):
        with within(2, "last_boxed"):
            last_boxed(text)
        env.reset(options={"prompt": "x", "label": "12"})
        with within(GRADE_TIMEOUT_S + 10, "math astep"):
            check_step_result(loop.run(env.astep(text), GRADE_TIMEOUT_S + 30), "math")

    return Target("env math (astep, grading worker)", check, boxed, suite_examples=8, start=loop.start, stop=loop.stop)


def _math_python() -> Target:
    """math-python without its python tool (its parse and grade paths; the tool is adv-sandbox's)."""
    from agentrl.envs.math_python import MathPythonEnv

    loop, env = Loop(), MathPythonEnv(sandbox=None, builtin_tools=())

    def start():
        loop.start()

    def check(text):
        loop.run(env.areset(options={"prompt": "x", "label": "12"}), 60)
        with within(40, "math-python astep"):
            check_step_result(loop.run(env.astep(text), 60), "math-python")

    def stop():
        loop.run(env.aclose(), 30)
        loop.stop()

    return Target("env math-python (no tool server)", check, suite_examples=20, start=start, stop=stop,
                  examples=[a for a in ATTACKS if "boxed" not in a])  # env-math runs those


def _search_r1() -> Target:
    from agentrl.envs.search_r1 import SearchR1Env

    loop, env = Loop(), SearchR1Env()
    with_tags = st.one_of(hostile_text(), st.tuples(st.sampled_from(["search", "answer"]), hostile_text(20_000)).map(
        lambda t: f"<think>x</think><{t[0]}>{t[1]}</{t[0]}>"))

    async def episode(text):  # one task, as in the agent loop (the MCP client's scopes belong to it)
        await env.areset(options={"prompt": "Who?", "label": ["Ada"]})
        try:
            t0 = time.perf_counter()
            result = await env.astep(text)
            return result, time.perf_counter() - t0
        finally:
            await env.aclose()

    def check(text):
        result, took = loop.run(episode(text), 60)
        assert took < 10, f"search-r1 astep on {len(text)} characters took {took:.1f} s"
        check_step_result(result, "search-r1")

    return Target("env search-r1 (in-process BM25 search)", check, with_tags, suite_examples=30,
                  start=loop.start, stop=loop.stop)


def _code() -> Target:
    """The code env's final answer: the solution taken from the message (tools on the host,
    none written) and graded on the host (grader_sandbox=None: the fuzz's code is not hostile,
    and the sandboxes are adv-sandbox's)."""
    from agentrl.envs.code_env import CodeEnv
    from agentrl.envs.code_env.grader import hidden_tests

    loop, env = Loop(), CodeEnv(grader_sandbox=None, test_timeout=2, grade_timeout=10)
    workdir = tempfile.mkdtemp(prefix="agentrl-fuzz-code-")
    blocks = st.one_of(hostile_text(), hostile_text(5000).map(lambda t: f"done\n```python\n{t}\n```"),
                       st.sampled_from(["```python\ndef add(a, b):\n    return a + b\n```",
                                        "```python\nimport os\nos._exit(0)\n```",
                                        "```python\ndef add(a, b):\n    return [[[a]]] * 10**6\n```"]))

    class Tools:  # stands in for a started ToolSet: its host workdir, nothing else is used
        def __init__(self):
            self.workdir = workdir

        async def close(self):
            pass

    def check(text):
        env.hidden = hidden_tests(["assert add(1, 2) == 3", "assert add('a', 'b') == 'ab'"], {"entry_point": "add"})
        env.sandbox_instance, env.toolset = None, Tools()
        with within(env.grade_timeout + 15, "code final_answer"):
            result = loop.run(env.final_answer(text), env.grade_timeout + 30)
        check_step_result(result, "code")

    return Target("env code (final answer, host grading)", check, blocks, suite_examples=8, start=loop.start,
                  stop=loop.stop)


# ---- graders ----------------------------------------------------------------------------------------
# ---- the agent loop, fed tokens -------------------------------------------------------------------------
class _TokenEngine:
    """Answers /generate with the example's token ids for each turn, as SGLang would hand them
    out: cut after the first stop token (the tokenizer's eos or a stop_token_id), else at
    max_new_tokens; a reply that reaches neither ends at the eos (the engine would go on)."""

    def __init__(self, turns: list[list[int]], eos: int):
        self.turns, self.eos = [list(t) for t in turns], eos

    async def generate(self, input_ids, sampling_params, *, session_id=None, rid=None, lora_path=None,
                       image_data=None):
        from agentrl.rollout.client import GenerateResult

        ids = self.turns.pop(0) if self.turns else []
        stops = {self.eos, *sampling_params.get("stop_token_ids", [])}
        cut = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
        limit = sampling_params["max_new_tokens"]
        if cut is not None and cut <= limit:
            ids, finish = ids[:cut], "stop"
        elif len(ids) >= limit:
            ids, finish = ids[:limit], "length"
        else:
            ids, finish = ids + [self.eos], "stop"
        return GenerateResult(ids, [-1.0] * len(ids), finish, len(input_ids), 0, "0")


def _agent_loop_tokens() -> Target:
    """run_trajectory (rendering, stop tokens, the template's checks, a tool env, the VLM path's
    media tokens) fed token ids, not text: special tokens (the template's turn markers, eos, the
    vision placeholders), the ids of tool-call tags, and any id of the vocabulary. Whatever the
    ids, the trajectory ends COMPLETED or TRUNCATED with a reward in [0, 1] (a fault scored 0 with
    its reason), never FAILED (that would veto its group) and never an exception out of the loop."""
    import base64
    import io

    from PIL import Image

    from agentrl.models import build_tiny_model, build_tiny_vlm, load_tokenizer
    from agentrl.rollout.agent_loop import LoopSettings, Renderer, run_trajectory
    from agentrl.tools.env import ToolEnv
    from agentrl.types import SampleStatus
    from agentrl.vision import load_processor

    class EchoEnv(ToolEnv):
        function_tools = (echo,)
        max_turns = 4

    text_tok = load_tokenizer(build_tiny_model())
    folder = Path(tempfile.mkdtemp(prefix="agentrl-fuzz-vlm-"))
    vlm = build_tiny_vlm(folder / "vlm")
    processor = load_processor(vlm)
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, format="PNG")
    image = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    tasks = {"text": {"prompt": "Echo hi, then answer."},
             "vlm": {"prompt": [{"role": "user", "content": [{"type": "image", "image": image},
                                                             {"type": "text", "text": "Echo the colour."}]}]}}
    tokenizers = {"text": text_tok, "vlm": processor.tokenizer}
    loop = Loop()

    def ids_of(tok) -> st.SearchStrategy[int]:
        marked = sorted(set(tok.all_special_ids) | {i for text in ("<tool_call>", "</tool_call>", '{"name": "echo"',
                                                                   "<|im_start|>", "<|im_end|>", "assistant", "\n")
                                                    for i in tok.encode(text, add_special_tokens=False)})
        return st.one_of(st.sampled_from(marked), st.integers(0, len(tok) - 1))

    def turn_of(tok) -> st.SearchStrategy[list[int]]:
        """Random ids, or a well-formed echo call with random ids around it (so episodes go on)."""
        call = tok.encode('<tool_call>{"name": "echo", "arguments": {"text": "x"}}</tool_call>', add_special_tokens=False)
        noise = st.lists(ids_of(tok), max_size=40)
        return st.one_of(noise, st.tuples(noise, noise).map(lambda t: t[0][:8] + call + t[1]))

    strategy = st.sampled_from(["text", "vlm"]).flatmap(lambda kind: st.tuples(
        st.just(kind), st.lists(turn_of(tokenizers[kind]), min_size=1, max_size=5)))

    def check(example):
        kind, turns = example
        tok = tokenizers[kind]
        renderer = Renderer(tok, processor=processor if kind == "vlm" else None)  # one trajectory's
        settings = LoopSettings(max_response_len=400, max_turns=4, sampling_params={"temperature": 1.0})
        with within(20, f"run_trajectory ({kind}) on {sum(map(len, turns))} tokens"):
            sample = loop.run(run_trajectory(EchoEnv(), tasks[kind], renderer=renderer,
                                             client=_TokenEngine(turns, tok.eos_token_id), settings=settings,
                                             trajectory_id="fuzz", group_id=0, seed=0), 60)
        assert sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), \
            f"{sample.status}: {sample.metadata.get('error')}"
        score = sample.reward.get("score", 0.0) if isinstance(sample.reward, dict) else sample.reward
        assert 0.0 <= float(score) <= 1.0, sample.reward
        assert len(sample.loss_mask) == len(sample.response_tokens)

    return Target("agent loop fed token ids (text and VLM renderers, a tool env)", check, strategy,
                  suite_examples=60, examples=[("vlm", [[processor.image_token_id]]), ("text", [[]])],
                  start=loop.start, stop=lambda: (loop.stop(), shutil.rmtree(folder, ignore_errors=True)))


def _graders() -> Target:
    from agentrl.envs.code_env import code_blocks
    from agentrl.envs.math_env import last_boxed
    from agentrl.envs.search_r1 import exact_match, f1_score, normalize_answer, parse_action

    def check(text):
        with within(5, f"graders on {len(text)} characters"):
            parse_action(text)
            normalize_answer(text)
            exact_match(text, ["Ada", text[:100]])
            f1_score(text, ["Ada Lovelace", text[:100]])
            last_boxed(text)
            code_blocks(text)

    return Target("graders (search-r1 EM/F1, boxed, code blocks)", check, suite_examples=30)


SMALL_SOUP = st.lists(st.sampled_from(["<search>", "</search>", "<answer>", "</answer>", "```", "`", "python",
                                       "py", " ", "\n", "\u00a0", "x", "<", ">", "</"]), max_size=20).map("".join)


def _same_as_regexes() -> Target:
    """The linear scans find what the regexes they replaced found (on short strings)."""
    from agentrl.envs.code_env import CODE_BLOCK_RE, code_blocks
    from agentrl.envs.search_r1 import ACTION_RE, parse_action

    def check(text):
        m = ACTION_RE.search(text)
        assert parse_action(text) == ((m.group(1), m.group(2).strip()) if m else (None, ""))
        assert code_blocks(text) == CODE_BLOCK_RE.findall(text)

    return Target("linear scans == the regexes they replaced", check, SMALL_SOUP, suite_examples=300, examples=[])


# ---- the MCP client against a host server, and the files server -----------------------------------------
DEMO_SERVER = Path(__file__).resolve().parents[1] / "tools" / "demo_server.py"


def _mcp_host_server() -> Target:
    """A host-side --mcp-server (the demo echo server over stdio): the model's arguments (lone
    surrogate escapes, deep nesting, huge numbers) never close the connection."""
    from agentrl.tools.client import ToolSet
    from agentrl.tools.parsers import parse_tool_calls

    loop = Loop()
    tools = ToolSet([f"demo={sys.executable} {DEMO_SERVER}"], call_timeout=20)
    calls = st.one_of(hostile_text(200_000), hostile_text(200_000).map(
        lambda t: '<tool_call>{"name": "echo", "arguments": {"text": ' + json.dumps(t) + "}}</tool_call>"),
        st.sampled_from(ATTACKS[:5]))

    def start():
        loop.start()
        loop.run(tools.start(), 60)

    def check(text):
        with within(30, "a turn's calls to the host server"):
            results = loop.run(tools.call_many(parse_tool_calls(text, "hermes", tools.input_schemas)[:4]), 60)
        for r in results:
            encodable(r.message()["content"])
        conn = tools.connections["demo"]
        assert conn.restarts == 0, "the model's arguments broke the connection to the server"

    def stop():
        loop.run(tools.close(), 30)
        loop.stop()

    return Target("MCP client -> host stdio server (demo echo)", check, calls, suite_examples=12, start=start, stop=stop)


def _files_server() -> Target:
    """The files tool server in process (no sandbox): hostile paths and contents are refused or
    written inside its workdir, never raised, never outside."""
    from mcp import Client

    from agentrl.tools.files_server import build_server

    loop, root = Loop(), Path(tempfile.mkdtemp(prefix="agentrl-fuzz-files-"))
    workdir = root / "work"
    workdir.mkdir()
    state: dict[str, Any] = {}
    args = st.tuples(st.sampled_from(["read_file", "write_file", "list_files", "edit_file"]),
                     st.one_of(hostile_text(5000), st.sampled_from(["a.txt", "../x", "/etc/passwd", "\x00", "a/../../b",
                                                                   "\ud800.txt", "." * 300, "d/" * 200 + "f"])),
                     hostile_text(200_000))

    async def call(tool, call_args):  # a client per call, in one task (its anyio scopes belong to it)
        async with Client(state["server"]) as client:
            return await client.call_tool(tool, call_args)

    def start():
        loop.start()
        state["server"] = build_server(workdir=workdir)

    def check(example):
        from agentrl.tools.client import wire_arguments

        tool, path, text = example
        call_args = {"read_file": {"path": path}, "write_file": {"path": path, "content": text},
                     "list_files": {"path": path, "recursive": True},
                     "edit_file": {"path": path, "old_string": text[:50] or "x", "new_string": text}}[tool]
        call_args, problem = wire_arguments(call_args)
        assert not problem
        with within(20, f"files {tool}"):
            result = loop.run(call(tool, call_args), 30)
        for block in result.content:
            encodable(getattr(block, "text", ""))
        outside = [p for p in root.iterdir() if p.name != "work"]
        assert not outside, f"{tool}({path!r}) wrote outside the workdir: {outside}"

    return Target("tool server files (in process)", check, args, suite_examples=40, start=start, stop=loop.stop,
                  examples=[(t, a, a) for t in ("write_file", "edit_file") for a in ATTACKS[:3]])


def _python_bash_arguments() -> Target:
    """The python and bash tool servers (host processes, no sandbox), their argument handling only:
    the code is a harmless literal or no-op carrying the hostile text; timeouts are hostile too."""
    from agentrl.tools.client import ToolSet
    from agentrl.tools.spec import builtin_spec

    loop = Loop()
    tools = ToolSet([builtin_spec("python", "bash", max_timeout=10)], call_timeout=10)
    example = st.tuples(st.sampled_from(["python", "bash"]), hostile_text(100_000),
                        st.sampled_from([None, 0, -1, 1e308, float("nan"), float("inf"), 5, "3", [1]]))

    def start():
        loop.start()
        loop.run(tools.start(), 120)

    def check(ex):
        tool, text, timeout = ex
        code = f"len({text!r})" if tool == "python" else f": {shlex.quote(text)}"
        args = {"code" if tool == "python" else "command": code}
        if timeout is not None:
            args["timeout"] = timeout
        with within(40, f"{tool} call"):
            [r] = loop.run(tools.call_many([(tool, args)]), 60)
        encodable(r.message()["content"])

    def stop():
        loop.run(tools.close(), 30)
        loop.stop()

    return Target("tool servers python/bash on the host (arguments)", check, example, suite_examples=8,
                  start=start, stop=stop, examples=[("python", ATTACKS[2], "nan"), ("bash", "\x00\ud800", 1e308)])


FACTORIES: dict[str, Callable[[], Target]] = {
    "parser-hermes": lambda: Target("parser-hermes", _check_parser("hermes"), suite_examples=50),
    "parser-qwen3_coder": lambda: Target("parser-qwen3_coder", _check_parser("qwen3_coder"), suite_examples=80),
    "tool-env": _tool_env_target,
    "env-target-token": _target_token,
    "env-math": _math,
    "env-math-python": _math_python,
    "env-search-r1": _search_r1,
    "env-code": _code,
    "graders": _graders,
    "scans-vs-regexes": _same_as_regexes,
    "mcp-host-server": _mcp_host_server,
    "files-server": _files_server,
    "python-bash-arguments": _python_bash_arguments,
    "agent-loop-tokens": _agent_loop_tokens,
}


def target(name: str) -> Target:
    """The target `name` (a key of FACTORIES), built fresh: it holds its own env and loop."""
    t = FACTORIES[name]()
    t.name = name
    return t
