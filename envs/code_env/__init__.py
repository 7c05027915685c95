"""code: a sandboxed code agent graded by hidden tests in a fresh sandbox.

A task is a problem statement plus hidden tests. Per trajectory the agent gets a sandbox
(agentrl.sandboxes, backend "auto": docker when an engine answers, else bubblewrap) with
the `python`, `bash` and `files` MCP tools running inside it; it works over several turns
(hermes tool calls) and writes its solution to ``solution.py``; a reply without a tool call
ends the episode, and so does the turn limit or the token budget (the file written so far is
graded all the same: ``grade_truncated``). The grader then copies the solution file(s) -- only those -- into a NEW
sandbox the agent never touched (from the run's pool when ``sandbox`` is a SandboxPool), where
a process holding only the solution answers calls; the hidden tests run on the host against
those answers (envs/code_env/grader.py says how); reward = share of tests passed, or 1/0 with
``all_or_nothing=True``. What the agent's own actions break (a solution file that is a FIFO,
its sandbox's exec server killed) scores 0 with ``info["agent_fault"]``, never a failed group.

Tasks. By default a seeded generator (envs/code_env/generator.py) supplies them: 39 families of
small problems (string, list, dict, arithmetic, parsing, simple algorithms) with varied
parameters, hidden tests and a reference solution each, split by statement into "train" and
"test" (``--env-kwargs '{"split": "test"}'``; no statement is in both). The 20 hand-written
tasks of data/tasks.jsonl: ``{"tasks": "builtin"}``. Or a task file (JSONL), MBPP- or
HumanEval-shaped: ``text`` or ``prompt`` (the statement),
``test_list`` or ``test`` (the hidden tests), ``entry_point``, optional ``test_setup_code``
/ ``test_imports``. A test is Python the judge runs on the host (``assert f(2) == 4``, or a
HumanEval ``check(candidate)``); the solution's functions in it must take and return plain
values (numbers, strings, bytes, lists, tuples, sets, dicts, Fractions, Decimals). Use one with ``--env-kwargs '{"tasks": "mbpp.jsonl"}'`` (keeps every
field), or ``--prompt-data mbpp.jsonl --input-key text --label-key test_list``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

from agentrl.envs.code_env.generator import SPLITS, generate
from agentrl.envs.code_env.grader import GradeResult, HiddenTests, grade, hidden_tests
from agentrl.data import shuffled_epochs
from agentrl.errors import AgentFault
from agentrl.registry import register_env
from agentrl.tools.env import ToolEnv
from agentrl.tools.parsers import valid_unicode

DATA_DIR = Path(__file__).with_name("data")
DEFAULT_TASKS = DATA_DIR / "tasks.jsonl"

SYSTEM_PROMPT = (
    "You are a careful Python programmer working in a sandbox. Tools: `python` (a persistent interpreter), "
    "`bash` (shell commands in the working directory), and `read_file` / `write_file` / `edit_file` / "
    "`list_files`. Write your solution to the file {solution_file} in the working directory, test it with the "
    "tools, and when you are done reply with a short final message without any tool call. Your file is then "
    "graded by hidden tests in a fresh environment."
)
CODE_BLOCK_RE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)  # what code_blocks finds
_BACKTICKS, _SPACES = re.compile("`+"), re.compile(r"\s*")
MAX_SOLUTION_BYTES = 1 << 20
# Reads one solution file for the host, as the agent's uid, without ever blocking: a FIFO, a
# device or a directory is "not a regular file" (exit 3), a missing file exit 2.
READ_SOLUTION = f"""
import os, stat, sys
try:
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK)
except FileNotFoundError:
    sys.exit(2)
if not stat.S_ISREG(os.fstat(fd).st_mode):
    sys.exit(3)
data = b""
while len(data) <= {MAX_SOLUTION_BYTES}:
    chunk = os.read(fd, 1 << 16)
    if not chunk:
        break
    data += chunk
sys.stdout.buffer.write(data)
"""


def code_blocks(text: str) -> list[str]:
    """The contents of the ```python blocks of `text`: ``CODE_BLOCK_RE.findall(text)``, in
    linear time (the regex backtracks over ``\\s*\\n`` at every unclosed fence: 20,000
    newlines after one fence took 2.5 s, a megabyte hours)."""
    blocks, pos = [], 0
    while (fence := text.find("```", pos)) >= 0:
        ticks_end = _BACKTICKS.match(text, fence).end()
        if ticks_end > fence + 3:  # a run of backticks: only its last three can open a block
            fence = ticks_end - 3
        content = -1
        for lang in ("python", "py", ""):  # the regex's alternatives, in its order
            if text.startswith(lang, fence + 3):
                start = fence + 3 + len(lang)
                end = _SPACES.match(text, start).end()  # one greedy run, no backtracking
                newline = text.rfind("\n", start, end)  # \s* gives back up to its last newline
                if newline >= 0:
                    content = newline + 1
                    break
        if content < 0:
            pos = fence + 1
            continue
        close = text.find("```", content)
        if close < 0:  # no closing fence after this one: none after any later fence either
            return blocks
        blocks.append(text[content:close])
        pos = close + 3
    return blocks


def normalize_task(row: dict[str, Any]) -> dict[str, Any]:
    """An MBPP/HumanEval-shaped row -> an agentrl task {prompt, label, metadata}."""
    statement = row.get("text") or row.get("prompt") or row.get("question")
    if not statement:
        raise ValueError(f"code task {row.get('task_id', '?')}: no statement (text / prompt)")
    tests = row.get("test_list") or row.get("tests") or row.get("test")
    if not tests:
        raise ValueError(f"code task {row.get('task_id', '?')}: no tests (test_list / test)")
    meta = {k: row[k] for k in ("task_id", "entry_point", "test_setup_code", "test_imports") if row.get(k)}
    if "entry_point" not in meta and isinstance(row.get("prompt"), str):
        from agentrl.envs.code_env.grader import entry_point_from_prompt

        entry = entry_point_from_prompt(row["prompt"])
        if entry:
            meta["entry_point"] = entry
    hidden_tests(tests, meta, statement)  # fail early on a task the grader could not run
    return {"prompt": statement, "label": tests, "metadata": meta}


def read_tasks(path: str | Path) -> list[dict[str, Any]]:
    if not Path(path).is_file():
        raise ValueError(f"code: task file {str(path)!r} not found (tasks: a JSONL path, or 'builtin')")
    tasks = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(normalize_task(json.loads(line)))
            except (ValueError, KeyError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


@register_env("code")
class CodeEnv(ToolEnv):
    """Sandboxed code agent: python/bash/files tools in a sandbox; hidden tests run in a fresh sandbox.

    kwargs: ``tasks`` (JSONL of MBPP/HumanEval-shaped tasks, or "builtin": the 20 hand-written ones;
    default None: the task generator), ``split`` ("train" | "test": the generator's split),
    ``families`` (the generator's families to draw from; default all),
    ``sandbox`` ("auto" | "docker" | "local" | a SandboxPool; where the agent works), ``grader_sandbox``
    (where the solution runs for grading: a backend name or a pool; default "same": the pool, or
    a new sandbox of the same backend; None: a host process, trusted code only), ``all_or_nothing`` (False:
    reward = share of tests passed), ``solution_files`` (["solution.py"]: what is copied to the
    grader; the first is the module the tests load), ``answer_in_message`` (True: with no
    solution file, the last ```python block of the final message is graded), ``show_example``
    (True: show the first test as an example), ``max_turns`` (8), ``test_timeout`` (s per call of
    the solution), ``grade_timeout`` (s for the whole grading of one solution), ``grade_truncated``
    (True: an episode the turn limit or the token budget cut off is graded on the file it wrote,
    as SWE-style envs grade the repository; False: it scores 0)."""

    description = "Sandboxed code agent (python/bash/files tools); hidden tests run in a fresh sandbox."
    builtin_tools = ("python", "bash", "files")
    sandbox = "auto"
    sandbox_limits = {"memory_mb": 1024, "cpus": 1.0}
    max_turns = 8
    tool_timeout = 60.0
    max_tool_output = 4000
    default_config = {"rollout_max_response_len": 2048, "rollout_max_tokens_per_turn": 512}

    def __init__(self, tasks: str | None = None, sandbox: str = "auto", grader_sandbox: str | None = "same",
                 all_or_nothing: bool = False, solution_files: list[str] | tuple[str, ...] = ("solution.py",),
                 answer_in_message: bool = True, show_example: bool = True, max_turns: int | None = None,
                 test_timeout: float = 10, grade_timeout: float = 60, system_prompt: str | None = None,
                 split: str = "train", families: list[str] | None = None, grade_truncated: bool = True,
                 **tool_env_kwargs):
        super().__init__(system_prompt=system_prompt, **tool_env_kwargs)
        self.sandbox = sandbox
        self.grader_sandbox = sandbox if grader_sandbox == "same" else grader_sandbox
        self.all_or_nothing = all_or_nothing
        self.solution_files = [str(f) for f in solution_files]
        for f in self.solution_files:
            if f.startswith("/") or ".." in Path(f).parts or not f.endswith(".py"):
                raise ValueError(f"code: solution file {f!r} must be a relative .py path inside the workdir")
        self.answer_in_message = answer_in_message
        self.show_example = show_example
        if max_turns is not None:
            self.max_turns = int(max_turns)
        self.test_timeout = float(test_timeout)
        self.grade_timeout = float(grade_timeout)
        self.grade_truncated = bool(grade_truncated)
        if split not in SPLITS:
            raise ValueError(f"code: split must be one of {SPLITS}, got {split!r}")
        # reset() without a task draws one from them
        self.dataset_kwargs = {"tasks": tasks, "split": split, "families": families}
        if system_prompt is None:
            self.system_prompt = SYSTEM_PROMPT.format(solution_file=self.solution_files[0])
        self.hidden: HiddenTests | None = None  # not `spec`: gymnasium's env.spec is the EnvSpec
        self.tool_calls = 0

    @classmethod
    def dataset(cls, seed: int = 0, tasks: str | None = None, split: str = "train",
                families: list[str] | None = None, **_) -> Iterator[dict]:
        if tasks:  # a file is one set: no split of its own
            return shuffled_epochs(read_tasks(DEFAULT_TASKS if tasks == "builtin" else tasks), seed)
        return generate(seed=seed, split=split, families=families)

    # -- episode ---------------------------------------------------------------------------------
    async def setup(self, task):
        self.hidden = hidden_tests(task.get("label"), task.get("metadata"), task.get("prompt"))
        self.tool_calls = 0

    def initial_messages(self, task):
        prompt = task.get("prompt", "")
        if isinstance(prompt, str):
            parts = [prompt.strip()]
            entry = self.hidden.entry_point if self.hidden else None
            if entry:
                parts.append(f"Define `{entry}` in {self.solution_files[0]}.")
            tests = self.hidden.tests if self.hidden else []
            if self.show_example and tests and not tests[0].startswith("check("):
                parts.append(f"For example, this must hold:\n```python\n{tests[0]}\n```")
            task = {**task, "prompt": "\n\n".join(parts)}
        return super().initial_messages(task)

    async def astep(self, action):
        obs, reward, terminated, truncated, info = await super().astep(action)
        self.tool_calls += info.get("tool_calls", 0)
        return obs, reward, terminated, truncated, info

    async def atruncated(self, reason: str) -> float | None:
        """A limit cut the episode off: the solution file written so far is graded all the same
        (0 without one); a final message's code block is not (there was no final message)."""
        if not self.grade_truncated:
            return None
        _, reward, _, _, _ = await self.final_answer("")
        return reward

    async def collect_solution(self, action: str) -> tuple[dict[str, str], str, list[str]]:
        """The solution files from the agent's sandbox ({path: text}), where they came from, and
        why files were not taken (missing, not a regular file, too large)."""
        files: dict[str, str] = {}
        skipped: list[str] = []
        for path in self.solution_files:
            data, why = await self.read_solution_file(path)
            if data is None:
                skipped.append(f"{path}: {why}")
            else:
                files[path] = data.decode("utf-8", errors="replace")
        if self.solution_files[0] in files:
            return files, "file", skipped
        if self.answer_in_message:
            blocks = code_blocks(str(action))
            if blocks:  # (a lone surrogate cannot be written to a file: U+FFFD)
                return {**files, self.solution_files[0]: valid_unicode(blocks[-1])}, "message", skipped
        return {}, "none", skipped

    async def read_solution_file(self, path: str) -> tuple[bytes | None, str]:
        """(contents, "") or (None, why not). Read in the agent's sandbox by a short-lived process
        with a timeout, so nothing the agent made there (a FIFO, a device) can block the host. If
        the agent broke its sandbox's exec server, that is its fault (AgentFault), not a failure."""
        from agentrl.sandboxes import SandboxError

        sb = self.sandbox_instance
        if sb is None:  # tools on the host
            return await asyncio.to_thread(_read_host_file, Path(self.workdir or "."), path)
        tainted_before = sb.tainted
        try:
            r = await sb.exec(["python3", "-I", "-c", READ_SOLUTION, path], timeout=10,
                              output_limit=MAX_SOLUTION_BYTES + 1)
        except SandboxError as e:
            if sb.tainted:  # the sandbox lives, its server was killed (by the agent's processes)
                raise AgentFault(f"reading {path}: the agent broke its sandbox's exec server ({e})") from None
            raise
        if sb.tainted != tainted_before:
            raise AgentFault(f"reading {path}: the agent broke its sandbox's exec server ({sb.tainted})")
        if r.exit_code == 0 and not r.truncated and len(r.stdout_bytes) <= MAX_SOLUTION_BYTES:
            return r.stdout_bytes, ""
        why = {2: "missing", 3: "not a regular file"}.get(r.exit_code, "")
        if not why:
            why = "timed out" if r.timed_out else ("larger than 1 MiB" if r.exit_code == 0 else
                                                  f"unreadable (exit {r.exit_code}: {r.stderr[-200:].strip()})")
        return None, why

    async def final_answer(self, action):
        files, source, skipped = await self.collect_solution(str(action))
        info: dict[str, Any] = {"tool_calls": self.tool_calls, "solution_from": source}
        if skipped:
            info["solution_files_skipped"] = skipped
        # the tools are done: their sandbox goes back (a pool's slot is free for the grader)
        await self.close_tools()
        if not files:
            info["error"] = f"no {self.solution_files[0]} written and no ```python block in the final message"
            return [], 0.0, True, False, info
        target = self.grader_sandbox
        if target is not None and not isinstance(target, str) and not (hasattr(target, "get")
                                                                        and hasattr(target, "release")):
            target = target.backend  # a Sandbox given in is the agent's: grade in a new one of its kind
        result: GradeResult = await grade(files, self.hidden, main=self.solution_files[0], sandbox=target,
                                          test_timeout=self.test_timeout, total_timeout=self.grade_timeout)
        info.update(passed=result.passed, total=result.total,
                    test_errors=[d.get("error") for d in result.details if not d.get("passed")][:5])
        if result.error:
            info["error"] = result.error
        reward = float(result.passed == result.total) if self.all_or_nothing else result.fraction
        return [], reward, True, False, info


def _read_host_file(workdir: Path, path: str) -> tuple[bytes | None, str]:
    """READ_SOLUTION for tools running on the host (trusted setups)."""
    import stat

    try:
        fd = os.open(workdir / path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, f"unreadable ({e})"
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "not a regular file"
        data = f.read(MAX_SOLUTION_BYTES + 1)
    return (data, "") if len(data) <= MAX_SOLUTION_BYTES else (None, "larger than 1 MiB")
