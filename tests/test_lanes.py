"""The lanes stay declared: a test module that runs agentrl end to end (the CLI, `main(["train",
...])`, engines, Ray, a browser; directly or through a tests/ helper) declares `pytest.mark.e2e`.
A test that starts several Megatron ranks (run_ranks) is `slow` or `e2e`: never in the fast lane.
This reads the modules' text only: it names a module that forgot the mark, it never marks one."""

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
E2E_SIGNS = re.compile(r'agentrl_cli\(|main\(\["(train|sft|eval)"|start_engines\(|launch_embedded_engine\(|'
                       r'ray\.init\(|importorskip\("ray"\)|chromium')


def helper_functions_that_run_agentrl() -> set[str]:
    """Functions of the tests' helper modules whose body shows an end-to-end sign."""
    names = set()
    for path in [*TESTS.glob("*helpers*.py"), *TESTS.glob("*/*helpers*.py")]:
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and E2E_SIGNS.search(ast.get_source_segment(source, node) or ""):
                names.add(node.name)
    return names - {"agentrl_cli"}


def test_every_end_to_end_module_declares_its_lane():
    helpers = helper_functions_that_run_agentrl()
    calls = re.compile(r"\b(" + "|".join(map(re.escape, sorted(helpers))) + r")\(") if helpers else None
    undeclared = []
    for path in sorted(TESTS.rglob("test_*.py")):
        relative = path.relative_to(TESTS).as_posix()
        if relative.startswith("gpu/") or path == Path(__file__).resolve():
            continue
        source = path.read_text()
        runs_agentrl = E2E_SIGNS.search(source) or (calls is not None and calls.search(source))
        if runs_agentrl and "pytest.mark.e2e" not in source:
            undeclared.append(relative)
    assert not undeclared, (f"these modules run agentrl end to end but declare no lane: {undeclared}; mark them "
                            "(pytestmark = pytest.mark.e2e, or @pytest.mark.e2e on those tests)")


def test_every_test_that_starts_megatron_ranks_is_out_of_the_fast_lane():
    unmarked = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path == Path(__file__).resolve():
            continue
        source = path.read_text()
        tree = ast.parse(source)
        module_marked = any(isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
                            and re.search(r"mark\.(slow|e2e)", ast.get_source_segment(source, node) or "")
                            for node in tree.body)
        for node in tree.body:
            if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")):
                continue
            marks = " ".join(ast.get_source_segment(source, d) or "" for d in node.decorator_list)
            if "run_ranks(" in (ast.get_source_segment(source, node) or "") and not (
                    module_marked or re.search(r"mark\.(slow|e2e)", marks)):
                unmarked.append(f"{path.relative_to(TESTS).as_posix()}::{node.name}")
    assert not unmarked, f"these start Megatron ranks but are in the fast lane: {unmarked}; mark them @pytest.mark.slow"
