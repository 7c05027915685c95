"""Grading of final math answers with math_verify: the last ``\\boxed{...}`` of the response
is parsed and compared with the gold answer (numbers, fractions, LaTeX expressions).

The model's answer is hostile input: math_verify hands it to sympy, which can compute for
minutes (``\\boxed{10^{10}!}``) in C code no signal interrupts. So parsing and comparing run
in a grading worker process (agentrl.grading) with a wall-clock bound, `GRADE_TIMEOUT_S`, from
any thread; `agrade` waits for it without blocking the event loop. An answer that runs past
the bound scores 0 with ``info["error"]`` saying so. Answers longer than `MAX_ANSWER_CHARS`
score 0 without being parsed.
"""

from __future__ import annotations

import threading

from agentrl.grading import GradingTimeout, grading_pool

MAX_ANSWER_CHARS = 400
PARSE_TIMEOUT_S = 5   # math_verify's own (signal) limit per parse / verify, in the worker's main thread
GRADE_TIMEOUT_S = 20  # the whole comparison, worker process killed past it
_VERIFY = "agentrl.envs.math_env.grader:verify_in_process"


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in `text`, braces balanced; None if absent."""
    best = None
    for command in ("\\boxed", "\\fbox"):
        start = text.rfind(command)
        if start >= 0 and (best is None or start > best[0]):
            best = (start, command)
    if best is None:
        return None
    i = best[0] + len(best[1])
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth, j = 0, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
        j += 1
    return None  # unbalanced: the answer was cut off


def _gold_text(gold) -> str:
    if isinstance(gold, (list, tuple)):
        gold = gold[0] if gold else ""
    if isinstance(gold, dict):
        gold = gold.get("answer", gold.get("target", ""))
    gold = str(gold).strip()
    if "\\boxed" in gold:
        return gold
    return gold if gold.startswith("$") else f"${gold}$"


def verify_in_process(answer: str | None, gold) -> bool:
    """math_verify's verdict, computed here (a grading worker calls this; its main thread makes
    math_verify's own timeouts work). Callers use `verify_answer`, which bounds it."""
    if answer is None or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return False
    from math_verify import parse, verify

    timeout = PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = parse(_gold_text(gold), parsing_timeout=timeout)
        pred_parsed = parse("\\boxed{" + answer + "}", parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # a parse/verify failure or timeout is a wrong answer, not a crash
        return False


def _worth_verifying(answer: str | None) -> bool:
    return answer is not None and bool(answer.strip()) and len(answer) <= MAX_ANSWER_CHARS


def verify_answer(answer: str | None, gold, *, timeout: float = GRADE_TIMEOUT_S) -> bool:
    """True when `answer` (the boxed content) equals `gold` mathematically, per math_verify, in a
    grading worker: GradingTimeout when it runs past `timeout` seconds (the answer's fault)."""
    if not _worth_verifying(answer):
        return False
    return bool(grading_pool().call(_VERIFY, answer, _plain(gold), timeout=timeout))


def _plain(gold):
    """The gold answer as JSON for the worker (a label may be any type: its text, as _gold_text reads it)."""
    return gold if isinstance(gold, (str, int, float, list, dict)) or gold is None else str(gold)


def _answer(response: str, require_boxed: bool) -> str | None:
    answer = last_boxed(response)
    if answer is None and not require_boxed:
        answer = response.strip().splitlines()[-1] if response.strip() else None
    return answer


def _result(answer: str | None, correct: bool | None, why: str = "") -> tuple[float, dict]:
    info = {"answer": answer, "correct": bool(correct)}
    if answer is None:
        info["error"] = "no \\boxed{} answer"
    elif why:
        info["error"] = why
    return (1.0 if correct else 0.0), info


def grade(response: str, gold, *, require_boxed: bool = True, timeout: float = GRADE_TIMEOUT_S) -> tuple[float, dict]:
    """(reward, info) for a full response: 1.0 when its last \\boxed{} answer matches `gold`.
    Bounded by `timeout` seconds from any thread; past it the reward is 0 and info says why."""
    answer = _answer(str(response), require_boxed)
    try:
        return _result(answer, verify_answer(answer, gold, timeout=timeout))
    except GradingTimeout as e:
        return _result(answer, False, str(e))


async def agrade(response: str, gold, *, require_boxed: bool = True,
                 timeout: float = GRADE_TIMEOUT_S) -> tuple[float, dict]:
    """`grade` for the event loop: the worker is waited for in a thread, the loop goes on."""
    answer = _answer(str(response), require_boxed)
    if not _worth_verifying(answer):
        return _result(answer, False)
    try:
        correct = await grading_pool().acall(_VERIFY, answer, _plain(gold), timeout=timeout)
    except GradingTimeout as e:
        return _result(answer, False, str(e))
    return _result(answer, correct)
