"""Grading of final math answers with math_verify: the last ``\\boxed{...}`` of the response
is parsed and compared with the gold answer (numbers, fractions, LaTeX expressions).

math_verify guards parsing with ``signal.alarm`` timeouts, which only work in the main
thread; elsewhere (a sync env's step runs in a worker thread) it runs without them, so the
answer is capped in length instead.
"""

from __future__ import annotations

import threading

MAX_ANSWER_CHARS = 400


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


def verify_answer(answer: str | None, gold) -> bool:
    """True when `answer` (the boxed content) equals `gold` mathematically, per math_verify."""
    if answer is None or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return False
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = parse(_gold_text(gold), parsing_timeout=timeout)
        pred_parsed = parse("\\boxed{" + answer + "}", parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # a parse/verify failure or timeout is a wrong answer, not a crash
        return False


def grade(response: str, gold, *, require_boxed: bool = True) -> tuple[float, dict]:
    """(reward, info) for a full response: 1.0 when its last \\boxed{} answer matches `gold`."""
    answer = last_boxed(response)
    if answer is None and not require_boxed:
        answer = response.strip().splitlines()[-1] if response.strip() else None
    correct = verify_answer(answer, gold)
    info = {"answer": answer, "correct": correct}
    if answer is None:
        info["error"] = "no \\boxed{} answer"
    return (1.0 if correct else 0.0), info
