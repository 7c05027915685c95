"""Which tests are end to end (marked `e2e`; `pytest -m "not e2e"` is the fast lane)."""

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
