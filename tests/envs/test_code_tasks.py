"""The code env's task supply: the generator's families (each reference passes its hidden tests
through the env's grader, each family's typical wrong solution fails them), its disjoint
train/test splits, and external task files of the MBPP and HumanEval shapes."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from agentrl.envs.code_env import CodeEnv, DATA_DIR, normalize_task, read_tasks
from agentrl.envs.code_env.generator import CATEGORY, FAMILIES, build, generate_tasks, split_of, task_from_id
from agentrl.envs.code_env.grader import grade_on_host, hidden_tests

MBPP_SAMPLE = DATA_DIR / "mbpp_sample.jsonl"
HUMANEVAL_SAMPLE = DATA_DIR / "humaneval_sample.jsonl"


def grade(task: dict, solution: str):
    """`solution` graded by the env's grader (host process: trusted reference code) on `task`'s hidden tests."""
    spec = hidden_tests(task["label"], task["metadata"], task["prompt"])
    return grade_on_host({"solution.py": solution}, spec)


def test_families_cover_the_categories():
    assert set(CATEGORY.values()) == {"string", "list", "dict", "arithmetic", "parsing", "algorithms"}
    assert len(FAMILIES) >= 30
    assert min(Counter(CATEGORY.values()).values()) >= 4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_passes_and_wrong_fails_through_the_grader(family):
    task = build(family, 7)
    env_task = normalize_task(task.row())  # the task file's shape, read as the env reads it
    assert env_task["metadata"]["entry_point"] == task.entry_point
    ok = grade(env_task, task.solution)
    assert ok.passed == ok.total >= 5, (task.task_id, ok)
    wrong = grade(env_task, task.wrong)
    assert wrong.passed < wrong.total, (task.task_id, task.wrong, wrong)


def test_instances_vary_and_are_reproducible():
    for family in FAMILIES:
        tasks = [build(family, i) for i in range(40)]  # build() itself refuses tests the wrong solution passes
        assert len({t.text for t in tasks}) >= 2, family  # the parameters change the statement
        assert all(f"`{t.entry_point}(" in t.text and len(t.tests) >= 5 for t in tasks)
        assert task_from_id(tasks[3].task_id) == tasks[3] == build(family, 3)
    assert task_from_id("agentrl-code-3") is None and task_from_id("gen/no_such_family/1") is None


def test_splits_share_no_instance():
    test = list(generate_tasks(seed=1, split="test", n=300))
    train = list(itertools.islice(generate_tasks(seed=0, split="train"), 3000))
    test_texts = {t.text for t in test}
    assert len(test_texts) == 300  # distinct
    assert not test_texts & {t.text for t in train}
    assert {split_of(t.text) for t in test} == {"test"} and {t.split for t in train} == {"train"}
    assert {t.family for t in test} == set(FAMILIES)  # every family is held out too (other parameters)
    assert len({t.text for t in train}) > 1000
    # seeded: the same stream again, another seed another order
    assert [t.task_id for t in generate_tasks(seed=1, split="test", n=20)] == [t.task_id for t in test[:20]]
    assert [t.task_id for t in generate_tasks(seed=2, split="test", n=20)] != [t.task_id for t in test[:20]]


def test_a_family_subset_that_runs_out_says_so():
    with pytest.raises(ValueError, match="only .* distinct test tasks"):
        list(generate_tasks(split="test", n=50, families=["matrix"]))  # 7 statements in all
    with pytest.raises(ValueError, match="unknown family 'nope'"):
        CodeEnv.dataset(families=["nope"])  # at the call (a run's start), not at its first task
    with pytest.raises(ValueError, match="split"):
        generate_tasks(split="validation")


def test_env_dataset_is_the_generator_by_split():
    train = list(itertools.islice(CodeEnv.dataset(seed=0), 50))
    test = list(itertools.islice(CodeEnv.dataset(seed=0, split="test"), 50))
    assert all(t["metadata"]["task_id"].startswith("gen/") for t in train + test)
    assert {split_of(t["prompt"]) for t in train} == {"train"} and {split_of(t["prompt"]) for t in test} == {"test"}
    assert all(normalize_task({"text": t["prompt"], "test_list": t["label"], **t["metadata"]}) for t in test)
    only = list(itertools.islice(CodeEnv.dataset(seed=0, families=["caesar", "rotate"]), 20))
    assert {t["metadata"]["family"] for t in only} == {"caesar", "rotate"}
    assert len(list(itertools.islice(CodeEnv.dataset(tasks="builtin"), 20))) == 20
    env = CodeEnv(sandbox="local", split="test")
    assert env.dataset_kwargs["split"] == "test"
    with pytest.raises(ValueError, match="split"):
        CodeEnv(sandbox="local", split="dev")
    with pytest.raises(ValueError, match="not found"):
        next(CodeEnv.dataset(tasks="/nonexistent/tasks.jsonl"))


def test_make_tasks_writes_a_split(tmp_path):
    from agentrl.envs.code_env.make_tasks import main

    out = tmp_path / "heldout.jsonl"
    assert main(["--split", "test", "--n", "12", "--seed", "1", "--out", str(out)]) == 0
    tasks = read_tasks(out)  # MBPP-shaped, as an external file is read
    assert len(tasks) == 12 and all(split_of(t["prompt"]) == "test" for t in tasks)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert grade(tasks[0], rows[0]["canonical_solution"]).fraction == 1.0
    assert main(["--split", "test", "--n", "3", "--out", str(out), "--env-rows"]) == 0
    assert set(json.loads(out.read_text().splitlines()[0])) == {"prompt", "label", "metadata"}


# -- external data sets of the usual shapes (samples written for these tests, not downloaded) --------
def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_mbpp_shaped_file():
    rows, tasks = _rows(MBPP_SAMPLE), read_tasks(MBPP_SAMPLE)
    assert len(tasks) == len(rows) == 3 and all({"text", "code", "test_list"} <= set(r) for r in rows)
    for row, task in zip(rows, tasks):
        assert grade(task, row["code"]).fraction == 1.0, row["task_id"]
        name = row["code"].split("def ", 1)[1].split("(", 1)[0]
        assert grade(task, f"def {name}(*args):\n    return None\n").fraction < 1.0
    streamed = list(itertools.islice(CodeEnv.dataset(seed=0, tasks=str(MBPP_SAMPLE)), 3))
    assert sorted(t["metadata"]["task_id"] for t in streamed) == [1, 2, 3]


def test_humaneval_shaped_file():
    rows, tasks = _rows(HUMANEVAL_SAMPLE), read_tasks(HUMANEVAL_SAMPLE)
    assert len(tasks) == 3 and all({"prompt", "entry_point", "test", "canonical_solution"} <= set(r) for r in rows)
    for row, task in zip(rows, tasks):
        assert task["label"] == row["test"] and task["metadata"]["entry_point"] == row["entry_point"]
        assert grade(task, row["prompt"] + row["canonical_solution"]).fraction == 1.0, row["task_id"]
        assert grade(task, row["prompt"] + "    return []\n").fraction == 0.0, row["task_id"]


def test_expert_reference_for_every_source():
    """`agentrl demos --env code` finds the reference of a generated task, of a task file's
    canonical_solution (HumanEval: under its prompt) and of MBPP's code."""
    from agentrl.demos import _code_solutions, code_reference

    gen = next(generate_tasks(seed=4))
    assert code_reference(gen.env_task(), {}) == gen.solution
    for path in (MBPP_SAMPLE, HUMANEVAL_SAMPLE, "builtin"):
        env = CodeEnv(sandbox="local", tasks=str(path))
        solutions = _code_solutions(env)
        for task in read_tasks(DATA_DIR / "tasks.jsonl" if path == "builtin" else path):
            ref = code_reference(task, solutions)
            assert ref is not None and grade(task, ref).fraction == 1.0, (path, task["metadata"])


@pytest.mark.slow
def test_agentrl_demos_env_code(tmp_path, capsys):
    """`agentrl demos --env code`: the expert's episodes on the train split, each graded 1.0 by the
    env (tools and grading on the host: only the expert's own reference code runs)."""
    from agentrl.cli import main

    out = tmp_path / "demos.jsonl"
    assert main(["demos", "--env", "code", "--n", "2", "--out", str(out), "--env-kwargs", '{"sandbox": null}']) == 0
    assert "code: 2 demonstrations (reward 1.0)" in capsys.readouterr().err
    rows = _rows(out)
    assert len(rows) == 2 and all(r["reward"] == 1.0 and r["task"]["task_id"].startswith("gen/") for r in rows)
    assert all(split_of(r["messages"][1]["content"].split("\n\n")[0]) == "train" for r in rows)
    for r in rows:
        calls = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert '"write_file"' in calls[0] and '"python"' in calls[1] and "<tool_call>" not in calls[-1]
        assert [m["content"] for m in r["messages"] if m["role"] == "tool"][-1].strip() == "example ok"


@pytest.mark.parametrize("path", [MBPP_SAMPLE, HUMANEVAL_SAMPLE], ids=["mbpp", "humaneval"])
def test_demos_from_a_task_file(path):
    from agentrl.demos import make_demos

    rows, failed = make_demos("code", 3, env_kwargs={"sandbox": None, "tasks": str(path)})
    assert failed == [] and sorted(str(r["task"]["task_id"]) for r in rows) == sorted(str(r["task_id"]) for r in _rows(path))


def _digest(tasks) -> str:
    h = hashlib.sha256()
    for task in tasks:
        h.update(json.dumps(task.row(), sort_keys=True).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("seed, split, n, expected", [
    (0, "train", 120, "e1af6e22c94dbc16"), (0, "test", 60, "be338769bbcea882"),
    (1, "train", 120, "308e7c3914967c6e"), (1, "test", 60, "1cf0008891055d4b")])
def test_generated_splits_are_pinned(seed, split, n, expected):
    """A seed's tasks (statements, solutions, tests) stay byte-identical across refactors of the
    generator: a changed digest means a run's data changed, which must be a decision, not a side effect."""
    assert _digest(generate_tasks(seed, split, n)) == expected


def test_every_familys_instances_are_pinned():
    assert _digest(build(f, i) for f in sorted(FAMILIES) for i in range(8)) == "d16e6fe98dfddc71"
