"""Expert demonstrations of the built-in envs, for `agentrl sft`.

    agentrl demos --env search-r1 --n 64 --out demos.jsonl [--seed 0] [--env-kwargs JSON]

A scripted policy plays each env through the env's own API (``areset`` / ``astep``), using
the env's tools the way a good agent would, and the env grades it:

- ``target-token``: repeats the named word;
- ``math``: works the word problem step by step (each built-in problem kind is parsed back
  into its numbers) and puts the result in \\boxed{};
- ``math-python``: writes the same computation as Python, runs it with the `python` tool,
  and boxes the value the tool printed;
- ``search-r1``: <search>es the question, then follows the passages (the entity named next
  to the question's subject) until the gold answer is in what it retrieved, then <answer>s;
  a question whose answer is never retrieved within the env's turns is skipped;
- ``code``: writes the task's reference solution (the generator's, or the task file's
  ``canonical_solution`` / MBPP ``code``) to solution.py with `write_file`, runs the example
  test with `python`, and finishes with a short message.

Only episodes the env scored 1.0 are written; each row is a conversation as `agentrl sft`
reads it: ``{"messages": [...], "tools": [...], "env", "task", "reward"}`` (messages exactly
as the agent loop would have them: the env's observations and the policy's turns).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

from agentrl.errors import ConfigError

# -- math: each built-in problem kind (envs/math_env/problems.py) parsed back into its numbers -----
_N = r"(\d+)"
MATH_KINDS: dict[str, tuple[str, Callable[..., tuple[list[str], str]]]] = {
    "shopping": (rf"buys {_N} .* at {_N} dollars each and pays with {_N} dollars",
                 lambda n, p, paid: ([f"cost = {n} * {p}", f"change = {paid} - cost"], "change")),
    "groups": (rf"has {_N} \w+ with {_N} .* gives away {_N}",
               lambda k, per, g: ([f"total = {k} * {per}", f"left = total - {g}"], "left")),
    "sharing": (rf"shares {_N} .* among {_N} friends and keeps the {_N} left over",
                lambda t, f, left: ([f"shared = {t} - {left}", f"each = shared // {f}"], "each")),
    "speed": (rf"at {_N} kilometers per hour for {_N} hours, then walks {_N} kilometers",
              lambda s, h, e: ([f"driven = {s} * {h}", f"total = driven + {e}"], "total")),
    "ages": (rf"is {_N} years old\. \w+ is {_N} years older .* in {_N} years",
             lambda a, d, y: ([f"older_now = {a} + {d}", f"later = older_now + {y}"], "later")),
    "rectangle": (rf"rectangle {_N} meters long and {_N} meters wide\. {_N} square flower beds, each {_N} meters",
                  lambda w, h, c, s: ([f"garden = {w} * {h}", f"beds = {c} * {s} * {s}", "lawn = garden - beds"],
                                      "lawn")),
    "savings": (rf"has {_N} dollars saved and adds {_N} dollars every week for {_N} weeks, then spends {_N}",
                lambda st, w, n, sp: ([f"saved = {st} + {w} * {n}", f"now = saved - {sp}"], "now")),
    "percent": (rf"has {_N} .* sells {_N}% of them",
                lambda t, p: ([f"sold = {t} * {p} // 100", f"left = {t} - sold"], "left")),
}


def math_steps(task: dict) -> tuple[list[str], str] | None:
    """(assignments, result variable) of a built-in math problem, or None for another kind."""
    kind = (task.get("metadata") or {}).get("kind")
    if kind not in MATH_KINDS:
        return None
    pattern, solve = MATH_KINDS[kind]
    m = re.search(pattern, str(task["prompt"]))
    return solve(*m.groups()) if m else None


def _run_steps(steps: list[str]) -> dict[str, int]:
    scope: dict[str, int] = {}
    for line in steps:  # "name = integer arithmetic"; the numbers came out of the prompt's regex
        name, expr = line.split(" = ", 1)
        scope[name] = eval(expr, {"__builtins__": {}}, dict(scope))
    return scope


def _tool_call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# -- the scripted policies: (task, last observation messages, turn) -> the next assistant turn -----
def policy_target_token(task, obs, turn, ctx):
    word = str(task["label"])
    return " ".join([word] * 16)


def policy_math(task, obs, turn, ctx):
    steps, result = ctx["steps"]
    scope = _run_steps(steps)
    lines = [f"{line} = {scope[line.split(' = ')[0]]}" for line in steps]
    return "Step by step:\n" + "\n".join(lines) + f"\nThe answer is \\boxed{{{scope[result]}}}."


def policy_math_python(task, obs, turn, ctx):
    steps, result = ctx["steps"]
    if turn == 0:
        return "I will compute it with Python.\n" + _tool_call("python", code="\n".join(steps + [result]))
    value = str(obs[-1]["content"]).strip() if obs else ""
    return f"The computation gives {value}, so the answer is \\boxed{{{value}}}."


def policy_search_r1(task, obs, turn, ctx):
    from agentrl.envs.search_r1 import gold_answers, normalize_answer

    seen = ctx.setdefault("seen", "")
    if obs and turn > 0:
        seen = ctx["seen"] = seen + "".join("\n" + re.sub(r"</?information>", "\n", str(m.get("content", "")))
                                            for m in obs)
    golds = gold_answers(task["label"])
    found = [g for g in golds if normalize_answer(g) and f" {normalize_answer(g)} " in f" {normalize_answer(seen)} "]
    if found:
        return f"<think>The passages say the answer is {found[0]}.</think>\n<answer> {found[0]} </answer>"
    if turn == 0:
        question = str(task["prompt"]).strip()
        return f"<think>I do not know this; I will search for it.</think>\n<search> {question} </search>"
    nxt = _next_query(str(task["prompt"]), seen, ctx.setdefault("queried", []))
    if nxt is None:
        return None  # nothing left to follow: no demonstration of this question
    ctx["queried"].append(nxt)
    return f"<think>The answer depends on {nxt}; I will search for it.</think>\n<search> {nxt} </search>"


def _next_query(question: str, seen: str, queried: list[str]) -> str | None:
    """The bridge entity of a two-hop question: a capitalised name in the retrieved passages
    that a passage about the question's subject mentions and that was not searched yet."""
    subject_words = set(re.findall(r"[A-Z][a-z]+", question))
    for passage in re.findall(r"Doc \d+\(Title: [^)]*\) ([^\n]*)", seen) or seen.split("\n"):
        if not subject_words & set(re.findall(r"[A-Z][a-z]+", passage)):
            continue
        for name in re.findall(r"[A-Z][a-z]+(?: [A-Z][a-z]+)*", passage):
            if name not in queried and not set(name.split()) <= subject_words and name not in ("The", "It"):
                return name
    return None


def policy_code(task, obs, turn, ctx):
    entry = (task.get("metadata") or {}).get("entry_point")
    if turn == 0:
        return "I will write the solution to solution.py.\n" + _tool_call(
            "write_file", path="solution.py", content=ctx["solution"])
    if turn == 1:
        example = task["label"][0] if isinstance(task["label"], list) else ""
        check = f"from solution import *\n{example}\nprint('example ok')"
        return "Now I check it on the example.\n" + _tool_call("python", code=check)
    return f"Done: solution.py defines `{entry}` and passes the example."


POLICIES = {"target-token": policy_target_token, "math": policy_math, "math-python": policy_math_python,
            "search-r1": policy_search_r1, "code": policy_code}


def _code_solutions(env) -> dict[str, str]:
    """task_id -> reference solution of the code env's task file: ``canonical_solution`` (a whole
    module; HumanEval's is the body under its ``prompt``) or MBPP's ``code``. Generated tasks
    need none: their reference comes from the generator (`code_reference`)."""
    from agentrl.envs.code_env import DEFAULT_TASKS

    path = env.dataset_kwargs.get("tasks")
    if not path:
        return {}
    rows = [json.loads(line) for line in Path(DEFAULT_TASKS if path == "builtin" else path).read_text().splitlines()
            if line.strip()]
    out = {}
    for r in rows:
        if r.get("task_id") is None:
            continue
        if r.get("canonical_solution") and "def check(" in str(r.get("test", "")):  # HumanEval
            out[str(r["task_id"])] = str(r.get("prompt", "")) + r["canonical_solution"]
        elif r.get("canonical_solution") or r.get("code"):
            out[str(r["task_id"])] = r.get("canonical_solution") or r["code"]
    return out


def code_reference(task: dict, file_solutions: dict[str, str]) -> str | None:
    """The reference solution of a code task: the generator's for a generated one, else the task file's."""
    from agentrl.envs.code_env.generator import task_from_id

    task_id = (task.get("metadata") or {}).get("task_id")
    generated = task_from_id(task_id) if task_id is not None else None
    if generated is not None:
        return generated.solution
    return file_solutions.get(str(task_id))


# -- playing ---------------------------------------------------------------------------------------
async def play(env, task: dict, policy, ctx: dict) -> dict | None:
    """One episode of `policy` in `env`; the conversation row if the env scored it 1.0, else None."""
    from agentrl.env import SAFETY_MAX_TURNS, as_messages

    try:
        obs, info = await env.areset(seed=0, options=task)
        messages = list(as_messages(obs))
        tools = info.get("tools")
        reward, done, step_info = 0.0, False, {}
        for turn in range(env.max_turns or SAFETY_MAX_TURNS):
            action = policy(task, obs if isinstance(obs, list) else as_messages(obs), turn, ctx)
            if action is None:
                return None
            messages.append({"role": "assistant", "content": action})
            obs, r, terminated, truncated, step_info = await env.astep(action)
            reward += r
            if obs:
                messages += as_messages(obs)
            if terminated or truncated:
                done = True
                break
    finally:
        await env.aclose()
    if not done or reward < 1.0 or messages[-1]["role"] != "assistant":
        return None
    row = {"messages": messages, "env": ctx["env"], "task": task.get("metadata") or {}, "reward": reward}
    if tools:
        row["tools"] = tools
    return row


EPISODE_TRIES = 3  # an episode that raised (a sandbox or tool server that did not start) is played again


class DemosError(RuntimeError):
    """Too many episodes raised: the env's machinery (sandboxes, tool servers) is failing, not one task."""


def make_demos(env_name: str, n: int, *, seed: int = 0, env_kwargs: dict | None = None, concurrency: int = 4,
               max_tries: int | None = None, out: Path | None = None) -> tuple[list[dict], list[dict]]:
    """Up to `n` demonstrations of `env_name` (rows as `agentrl sft` reads them), and the tasks
    whose episode the env did not score 1.0 (or the policy could not finish). With `out`, each row is
    appended to that file as it is made, so a run that stops keeps what it did.

    An episode that raises (under load a tool server can miss its start timeout) is played again, up to
    EPISODE_TRIES times, then left out; more than max(3, n // 20) such episodes end the run with
    DemosError, the rows made so far kept."""
    import agentrl
    from agentrl.registry import get_spec

    if env_name not in POLICIES:
        raise ConfigError(f"agentrl demos: no scripted policy for env {env_name!r}; built-in envs: "
                          f"{', '.join(POLICIES)}")
    env_cls = get_spec(env_name).load()
    kwargs = dict(env_kwargs or {})
    probe = agentrl.make(env_name, **kwargs)
    rows_iter = probe.dataset(seed=seed, **{**kwargs, **probe.dataset_kwargs})
    if rows_iter is None:
        raise ConfigError(f"agentrl demos: env {env_name!r} ({env_cls.__name__}) has no built-in dataset")
    solutions = _code_solutions(probe) if env_name == "code" else {}
    max_tries = max_tries or 4 * n
    tasks = []
    for task in rows_iter:
        if len(tasks) >= max_tries:
            break
        ctx: dict[str, Any] = {"env": env_name}
        if env_name in ("math", "math-python"):
            ctx["steps"] = math_steps(task)
            if ctx["steps"] is None:
                continue
        if env_name == "code":
            ctx["solution"] = code_reference(task, solutions)
            if ctx["solution"] is None:
                continue
        tasks.append((task, ctx))
        if solutions and len(tasks) >= len(solutions) and len(tasks) >= n:  # a task file: each task is in
            break

    max_errors = max(3, n // 20)

    async def run_all(sink):
        sem = asyncio.Semaphore(concurrency)
        rows: list[dict] = []
        failed: list[dict] = []
        errors: list[str] = []
        t0, every = time.monotonic(), max(1, n // 10)

        async def episode(task, ctx):
            for attempt in range(1, EPISODE_TRIES + 1):
                if len(errors) > max_errors:  # the run is stopping: no new tries
                    return None
                try:
                    return await play(agentrl.make(env_name, **kwargs), task, POLICIES[env_name], ctx)
                except Exception as exc:  # the env's machinery; a policy or grading miss returns None
                    why = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"{env_name}: an episode raised (try {attempt} of {EPISODE_TRIES}): {why}", file=sys.stderr,
                          flush=True)
            errors.append(why)
            if len(errors) > max_errors:
                raise DemosError(f"agentrl demos --env {env_name}: {len(errors)} episodes raised {EPISODE_TRIES} times "
                                 f"each (more than {max_errors}); the last: {why}")
            return None

        async def one(task, ctx):
            async with sem:
                if len(rows) >= n or len(errors) > max_errors:
                    return
                row = await episode(task, ctx)
                if row is None:
                    failed.append(task)
                    return
                if len(rows) >= n:  # others finished first
                    return
                rows.append(row)
                if sink is not None:
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                if len(rows) % every == 0:  # long runs show progress (stderr: --out is the data)
                    print(f"{env_name}: {len(rows)}/{n} demonstrations, {len(failed)} not scored 1.0, "
                          f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

        jobs = [asyncio.ensure_future(one(t, c)) for t, c in tasks]
        try:
            await asyncio.gather(*jobs)
        finally:
            for job in jobs:  # DemosError: the episodes still in flight close their envs
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
        return rows, failed

    if out is None:
        return asyncio.run(run_all(None))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as sink:
        return asyncio.run(run_all(sink))


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="agentrl demos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", required=True, choices=sorted(POLICIES))
    parser.add_argument("--n", type=int, default=64, help="demonstrations to write (default 64)")
    parser.add_argument("--out", required=True, help="JSONL file to write (what `agentrl sft --prompt-data` reads)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the env's task stream")
    parser.add_argument("--env-kwargs", default="{}", help="JSON kwargs of the env, e.g. '{\"sandbox\": \"local\"}'")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    try:
        env_kwargs = json.loads(args.env_kwargs)
    except ValueError as exc:
        raise ConfigError(f"--env-kwargs: not JSON: {exc}") from None
    if not isinstance(env_kwargs, dict):
        raise ConfigError(f"--env-kwargs: expected a JSON object, got {args.env_kwargs!r}")
    if args.n < 1:
        raise ConfigError(f"--n must be at least 1, got {args.n}")
    out = Path(args.out)
    try:
        rows, failed = make_demos(args.env, args.n, seed=args.seed, env_kwargs=env_kwargs,
                                  concurrency=args.concurrency, out=out)
    except DemosError as exc:
        kept = sum(1 for _ in out.open()) if out.exists() else 0
        print(f"{exc}\n{args.env}: the {kept} demonstrations made before it are in {out}", file=sys.stderr)
        return 1
    print(f"{args.env}: {len(rows)} demonstrations (reward 1.0) -> {out}; {len(failed)} episodes not scored 1.0 "
          f"(left out){': ' if failed else ''}{', '.join(str(t.get('prompt'))[-60:] for t in failed[:3])}",
          file=sys.stderr)
    if len(rows) < args.n:
        print(f"{args.env}: fewer than --n {args.n}: the env's task set or the scripted policy ran out",
              file=sys.stderr)
    return 0 if rows else 1
