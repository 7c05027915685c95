"""slime's rule-based rewards (`--rm-type`, slime/rollout/rm_hub at 624b824), with slime's
meaning, written for agentrl: one function per type, `(response, label, metadata) -> reward`.

    deepscaler  1/0: the \\boxed{} answer after the reasoning (text after </think> or ###Response;
                neither: 0) equals the label (normalised text, else math_verify's equivalence)
    dapo        {"score": 1.0 | -1.0, "acc": bool, "pred": str}: the last "Answer: X" of the
                response's last 300 characters, normalised, equals the integer label
    math        1/0: the response's last \\boxed{} answer equals the label (boxed or plain)
    f1          token F1 of the response against the label (SQuAD normalisation; yes/no/noanswer
                must match exactly)
    gpqa        1.0/0.0: the chosen option letter is the correct one (metadata choices,
                correct_letter, or the label as letter, index or option text)
    ifbench     1.0/0.0: every instruction of the row followed, by allenai/IFBench's own checks
                (its `evaluation_lib` must be importable: nothing is fetched at run time)
    remote_rm   POST {prompt, response, label} to --rm-url; its JSON answer is the reward
    random      0 or 1 at random (for tests)
    llm-judge   an LLM judge's score of the final answer in [0, 1] (agentrl.judge: --judge-url, or a
                judge engine group of its own with --judge-load; --judge-rubric); also llm_judge
    boxed_X     X applied to the last \\boxed{} content of the response

`async_rm(args, sample)` is what `--rm-type` installs as the reward function (slime's
async_rm): the row's metadata `rm_type` wins over `--rm-type`. It takes agentrl's Sample or
slime's, and agentrl's Config or slime's flat args.
"""

from __future__ import annotations

import importlib
import random
import re
import string
from collections import Counter
from typing import Any, Callable

from agentrl.errors import ConfigError
from agentrl.envs.math_env.grader import last_boxed, verify_answer

__all__ = ["RM_TYPES", "async_rm", "check_rm_type", "deepscaler", "dapo", "math", "f1", "gpqa", "ifbench"]


# -- math answers -------------------------------------------------------------------------------
_UNITS = ("degrees", "units", "inches", "meters", "cm", "km", "feet", "minutes", "hours", "dollars", "cents",
          "points", "ways", "integers", "digits", "students", "mph", "pounds", "square")


def normalize_math(text: str) -> str:
    """A final answer as plain comparable text: after the last '=', without $, \\text{}, \\boxed{},
    \\left/\\right, spaces, units and thousands separators."""
    text = str(text).split("=")[-1]
    for wrapper in ("\\boxed", "\\text", "\\textbf", "\\mathrm", "\\mbox"):
        text = re.sub(re.escape(wrapper) + r"\{([^{}]*)\}", r"\1", text)
    text = text.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    text = text.replace("$", "").replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace("%", "")
    text = text.replace("dfrac", "frac").replace("tfrac", "frac")
    for unit in _UNITS:
        text = re.sub(rf"\s*{unit}\b", "", text)
    text = re.sub(r"\s+", "", text).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    if re.fullmatch(r"-?\d+\.0+", text):
        text = text.split(".")[0]
    return text


def same_answer(answer: str | None, label) -> bool:
    """Normalised text equality, else math_verify's mathematical equivalence."""
    if answer is None:
        return False
    label = str(label)
    if "\\boxed" in label:
        label = last_boxed(label) or ""
    if not label.strip():
        return False
    return normalize_math(answer) == normalize_math(label) or verify_answer(answer, label)


def deepscaler(response: str, label, metadata: dict | None = None) -> int:
    for marker in ("</think>", "###Response"):
        if marker in response:
            solution = response.split(marker)[-1] if marker == "</think>" else response.split(marker)[1]
            break
    else:
        return 0  # no reasoning/answer split: slime scores 0
    if label is None or str(label) == "":
        return 0
    return int(same_answer(last_boxed(solution), label))


def math(response: str, label, metadata: dict | None = None) -> int:
    if label is None or str(label) == "":
        return 0
    return int(same_answer(last_boxed(response), label))


def dapo(response: str, label, metadata: dict | None = None) -> dict:
    tail = response[-300:]  # DAPO's answers are short; the tail holds the last "Answer:" line
    found = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", tail)
    pred = normalize_math(found[-1]) if found else "[INVALID]"
    gold = normalize_math(label)
    try:
        gold = str(int(float(gold)))  # DAPO's labels are integers
    except ValueError:
        pass
    correct = pred == gold
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# -- text answers -------------------------------------------------------------------------------
def _squad_normalize(text: str) -> str:
    text = "".join(ch for ch in str(text).lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def f1(response: str, label, metadata: dict | None = None) -> float:
    if response is None:
        return 0.0
    pred, gold = _squad_normalize(response), _squad_normalize(label)
    if (pred in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer")) and pred != gold:
        return 0.0
    common = sum((Counter(pred.split()) & Counter(gold.split())).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred.split()), common / len(gold.split())
    return 2 * precision * recall / (precision + recall)


def _plain(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", str(text).lower()).strip()


def _chosen_letter(response: str, letters: list[str]) -> str | None:
    """The option the response picks: "answer is X" and similar, else its last standalone valid capital."""
    for pattern in (r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])\b", r"\b([A-Z])\s*is\s*(?:the\s*)?correct",
                    r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])\b"):
        match = re.search(pattern, response, flags=re.IGNORECASE)
        if match and match.group(1).upper() in letters:
            return match.group(1).upper()
    for letter in reversed(re.findall(r"\b([A-Z])\b", response)):
        if letter in letters:
            return letter
    return None


def gpqa(response: str, label, metadata: dict | None = None) -> float:
    if response is None:
        return 0.0
    metadata = metadata or {}
    response = response.rsplit("</think>", 1)[-1]
    choices = metadata.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else list(choices or [])
    letters = [str(x).upper() for x in metadata.get("valid_letters") or []] or \
        list(string.ascii_uppercase[:len(choices) or 10])
    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label_text = label.strip() if isinstance(label, str) else None
    if correct is None and label_text and len(label_text) == 1 and label_text.upper() in letters:
        correct = label_text.upper()
    elif correct is None and isinstance(label, (int, float)) and 0 <= int(label) < len(letters):
        correct = letters[int(label)]
    if correct is None and label_text:
        correct = next((letters[i] for i, c in enumerate(choices) if _plain(c) == _plain(label_text)), None)
    chosen = _chosen_letter(response, letters)
    if chosen and correct:
        return 1.0 if chosen == correct else 0.0
    targets = [label_text] if label_text else []
    if correct and correct in letters and letters.index(correct) < len(choices):
        targets.append(str(choices[letters.index(correct)]))
    targets += [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)]
    said = _plain(response)
    return 1.0 if any(_plain(t) and _plain(t) in said for t in targets) else 0.0


def _ifbench_lib():
    try:
        return importlib.import_module("evaluation_lib")
    except ImportError:
        raise ConfigError("--rm-type ifbench: allenai/IFBench's evaluation_lib is not importable; clone "
                          "https://github.com/allenai/IFBench and put it on PYTHONPATH (agentrl fetches nothing "
                          "at run time)") from None


def ifbench(response: str, label, metadata: dict | None = None) -> float:
    metadata = metadata or {}
    ids = [str(i) for i in metadata.get("instruction_id_list") or []]
    if response is None or not ids:
        return 0.0
    raw = metadata.get("kwargs")
    kwargs = [dict(k) if isinstance(k, dict) else {} for k in raw] if isinstance(raw, list) else \
        [dict(raw) if isinstance(raw, dict) else {} for _ in ids]
    kwargs = (kwargs + [dict(kwargs[-1] if kwargs else {}) for _ in ids])[:len(ids)]
    kwargs = [{k: v for k, v in entry.items() if v is not None} for entry in kwargs]
    lib = _ifbench_lib()
    prompt = str(metadata.get("prompt_text") or "")
    example = lib.InputExample(key=int(metadata.get("record_id") or 0), instruction_id_list=ids, prompt=prompt,
                               kwargs=kwargs)
    out = lib.test_instruction_following_strict(example, {prompt: str(response)})
    return 1.0 if out.follow_all_instructions else 0.0


def random_reward(response: str, label, metadata: dict | None = None) -> int:
    return random.randint(0, 1)


RM_TYPES: dict[str, Callable[[str, Any, dict | None], Any]] = {
    "deepscaler": deepscaler, "dapo": dapo, "math": math, "f1": f1, "gpqa": gpqa, "ifbench": ifbench,
    "random": random_reward,
}


LLM_JUDGE_TYPES = ("llm-judge", "llm_judge")  # agentrl.judge, not slime's (slime has no judge rm type)


def check_rm_type(rm_type: str, *, rm_url: str | None = None, judge: str | None = None) -> None:
    """At start (and in --dry-run): a known type, and what it needs is there (`judge`: the
    --judge-url or --judge-load that llm-judge asks)."""
    if rm_type.strip() in LLM_JUDGE_TYPES:
        if not judge:
            raise ConfigError(f"--rm-type {rm_type.strip()} needs the judge: --judge-url URL (an OpenAI-compatible "
                              "endpoint) or --judge-load PATH (a judge engine group of its own)")
        return
    base = rm_type.strip().removeprefix("boxed_")
    if base == "remote_rm":
        if not rm_url:
            raise ConfigError("--rm-type remote_rm needs --rm-url URL")
        return
    if base not in RM_TYPES:
        raise ConfigError(f"--rm-type {rm_type}: unknown; choose from "
                          f"{', '.join([*RM_TYPES, 'remote_rm', LLM_JUDGE_TYPES[0]])} (each but {LLM_JUDGE_TYPES[0]} "
                          "may be prefixed boxed_)")
    if base == "ifbench":
        _ifbench_lib()


def _setting(args, name: str):
    """A setting from slime's flat args or agentrl's Config (under its section)."""
    if name in getattr(args, "__dict__", {}):
        return getattr(args, name)
    for section in ("algo", "run", "data"):
        part = getattr(args, section, None)
        if part is not None and name in type(part).model_fields:
            return getattr(part, name)
    return getattr(args, name, None)


async def remote_rm(args, sample, *, timeout_s: float = 120.0, attempts: int = 10):
    """POST {prompt, response, label} to --rm-url, retried with back-off `attempts` tries at most
    (no answer or a 5xx; a 4xx is the request's fault and is not sent again)."""
    from agentrl.http import RetryPolicy, json_session, post_json

    payload = {"prompt": getattr(sample, "prompt", None) or _prompt_text(sample), "response": sample.response,
               "label": sample.label}
    retry = RetryPolicy(attempts=attempts, backoff_s=1.0, max_backoff_s=30.0)
    async with json_session(timeout_s=timeout_s) as session:
        body, _ = await post_json(session, _setting(args, "rm_url"), payload, retry=retry, expect_json=True)
    return body


def _prompt_text(sample) -> str:
    """agentrl's Sample keeps the prompt as messages: its text for a remote reward model."""
    return "".join(str(m.get("content", "")) for m in getattr(sample, "messages", []) if m.get("role") != "assistant")


async def async_rm(args, sample):
    """slime's async_rm: the row's metadata rm_type, else --rm-type."""
    metadata = sample.metadata if isinstance(getattr(sample, "metadata", None), dict) else {}
    rm_type = str(metadata.get("rm_type") or _setting(args, "rm_type") or "").strip()
    if not rm_type:
        raise ConfigError("no reward: neither --rm-type nor the row's metadata rm_type is set")
    if rm_type in LLM_JUDGE_TYPES:  # the judge reads the whole sample (question and final answer)
        from agentrl.judge import llm_judge

        return await llm_judge(args, sample)
    response = sample.response
    if rm_type.startswith("boxed_"):
        response, rm_type = last_boxed(response) or "", rm_type[len("boxed_"):]
    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    if rm_type not in RM_TYPES:
        raise ConfigError(f"rm_type {rm_type!r}: unknown; choose from {', '.join([*RM_TYPES, 'remote_rm'])}")
    return RM_TYPES[rm_type](response, sample.label, metadata)
