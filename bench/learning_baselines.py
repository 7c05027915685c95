"""The floor under every learning curve (bench/results/learning.md): the held-out reward of a
constant and of a random answer, per env, on the held-out sets the GPU scenarios evaluate
(tests/gpu/test_learning_gpu.py), graded by each env's own grader. CPU only.

    python bench/learning_baselines.py [--n-code 100] [--out bench/results/learning_baselines.json]

- math (and math-python: the same problems): constant = \\boxed{the most common answer of 5,000
  training problems}; random = \\boxed{a training problem's answer, drawn at random};
- search-r1: constant = the most common gold answer of the train split; random = a train
  question's gold answer, drawn at random (exact match);
- code: constant = ``def ENTRY(*args, **kwargs): return None``; random = the reference solution
  of a random training task, renamed to the task's entry point (reward: share of hidden tests
  passed, as the env grades; "pass" = all of them).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections import Counter
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    var = sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)
    return m, (var / len(xs)) ** 0.5


def math_baselines(n: int, rng: random.Random) -> dict:
    from agentrl.envs.math_env import generate
    from agentrl.envs.math_env.grader import grade

    train = list(generate(seed=0, n=5000))
    seen = {t["prompt"] for t in generate(seed=0, n=50_000)}
    heldout = [t for t in generate(seed=1, n=4 * n) if t["prompt"] not in seen][:n]  # as heldout_math(n)
    labels = [t["label"] for t in train]
    common = Counter(labels).most_common(1)[0][0]
    return {"heldout": len(heldout), "constant_answer": common,
            "constant": [grade(f"\\boxed{{{common}}}", t["label"])[0] for t in heldout],
            "random": [grade(f"\\boxed{{{rng.choice(labels)}}}", t["label"])[0] for t in heldout]}


def search_r1_baselines(rng: random.Random) -> dict:
    from agentrl.envs.search_r1 import DATA_DIR, exact_match, read_questions

    train, test = read_questions(DATA_DIR / "train.jsonl"), read_questions(DATA_DIR / "test.jsonl")
    answers = [t["label"][0] for t in train]
    common = Counter(answers).most_common(1)[0][0]
    return {"heldout": len(test), "constant_answer": common,
            "constant": [exact_match(common, t["label"]) for t in test],
            "random": [exact_match(rng.choice(answers), t["label"]) for t in test]}


def code_baselines(n: int, rng: random.Random) -> dict:
    from agentrl.envs.code_env.generator import generate_tasks
    from agentrl.envs.code_env.grader import grade_on_host, hidden_tests

    heldout = list(generate_tasks(seed=1, split="test", n=n))  # as heldout_code(n)
    train = list(generate_tasks(seed=0, split="train", n=500))
    out: dict = {"heldout": len(heldout), "constant": [], "random": [], "constant_pass": [], "random_pass": []}
    for task in heldout:
        spec = hidden_tests(list(task.tests), {"entry_point": task.entry_point}, task.text)
        other = rng.choice([t for t in train if t.family != task.family])
        for kind, source in (("constant", f"def {task.entry_point}(*args, **kwargs):\n    return None\n"),
                             ("random", re.sub(rf"\bdef {other.entry_point}\(", f"def {task.entry_point}(",
                                               other.solution))):
            result = grade_on_host({"solution.py": source}, spec, test_timeout=5, total_timeout=20)
            out[kind].append(result.fraction)
            out[f"{kind}_pass"].append(float(result.passed == result.total))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-math", type=int, default=200)
    parser.add_argument("--n-code", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "learning_baselines.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    report = {}
    for env, fn in (("math", lambda: math_baselines(args.n_math, rng)), ("search-r1", lambda: search_r1_baselines(rng)),
                    ("code", lambda: code_baselines(args.n_code, rng))):
        t0 = time.time()
        raw = fn()
        row = {k: v for k, v in raw.items() if not isinstance(v, list)}
        for k, v in raw.items():
            if isinstance(v, list):
                row[k], row[f"{k}_se"] = mean_se(v)
        row["seconds"] = round(time.time() - t0, 1)
        report[env] = row
        print(env, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
