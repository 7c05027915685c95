"""slime's --sglang-config (docs/en/advanced/sglang-config.md in slime): a YAML of models, each
with server groups (regular, prefill, decode, placeholder; GPUs, GPUs per engine, SGLang
overrides). agentrl launches one group of engines serving the policy, so a one-model config maps
onto --rollout-num-gpus, --rollout-num-gpus-per-engine, --num-engines, --prefill-num-servers and
--sglang-* (the overrides its prefill and decode groups do not share: --prefill-sglang-args,
--decode-sglang-args, as slime's GLM-5.2 script gives them); what does not map is an error naming
the YAML key."""

import pytest

from agentrl.config import parse_config
from agentrl.errors import ConfigError


def config(tmp_path, text: str) -> str:
    path = tmp_path / "sglang.yaml"
    path.write_text(text)
    return str(path)


def test_one_model_of_regular_groups_is_the_engine_group(tmp_path):
    # slime's "basic" example: 8 GPUs, 2 per engine (from --rollout-num-gpus-per-engine): 4 engines
    path = config(tmp_path, "sglang:\n  - name: default\n    server_groups:\n      - worker_type: regular\n"
                            "        num_gpus: 8\n")
    model = tmp_path / "m"
    model.mkdir()
    cfg, ns = parse_config(["--sglang-config", path, "--rollout-num-gpus-per-engine", "2", "--hf-checkpoint", str(model)])
    r = cfg.rollout
    assert (r.rollout_engine, r.rollout_num_gpus, r.rollout_num_gpus_per_engine, r.num_engines, r.prefill_num_servers) \
        == ("sglang", 8, 2, 4, None)
    assert cfg.sglang_args == {} and "config" not in cfg.sglang_args
    assert [n for n in ns.slime_notices if n.startswith("--sglang-config")] == [
        f"--sglang-config {path}: read as --rollout-num-gpus 8 --rollout-num-gpus-per-engine 2 --num-engines 4"]
    # the policy's own path named in the YAML is the same model
    same = config(tmp_path, f"sglang:\n  - name: actor\n    model_path: {model}\n    update_weights: true\n"
                            "    server_groups: [{worker_type: regular, num_gpus: 2}]\n")
    assert parse_config(["--sglang-config", same, "--hf-checkpoint", str(model)])[0].rollout.num_engines == 2


def test_prefill_decode_groups_placeholders_and_overrides(tmp_path):
    path = config(tmp_path, """
sglang:
  - name: actor
    num_gpus_per_engine: 2
    engine_groups:
      - worker_type: decode
        num_gpus: 4
        overrides: {mem_fraction_static: 0.7, enable_dp_attention: true, cuda_graph_bs: [1, 2, 4], enable_memory_saver: false}
      - worker_type: prefill
        num_gpus: 2
        overrides: {mem_fraction_static: 0.7, enable_dp_attention: true, cuda_graph_bs: [1, 2, 4], enable_memory_saver: false}
      - worker_type: placeholder
        num_gpus: 2
        overrides: {anything: 1}
""")
    cfg, _ = parse_config(["--sglang-config", path, "--rollout-num-gpus", "8", "--sglang-mem-fraction-static", "0.5",
                           "--sglang-enable-memory-saver", "--sglang-context-length", "4096"])
    r = cfg.rollout
    # 3 engines of 2 GPUs, the prefill one first (agentrl's order); the placeholder's 2 GPUs stay unused
    assert (r.rollout_num_gpus, r.rollout_num_gpus_per_engine, r.num_engines, r.prefill_num_servers) == (8, 2, 3, 1)
    # the overrides win over the command line's --sglang-*, a false switch removes it, the rest stays
    assert cfg.sglang_args == {"mem-fraction-static": "0.7", "enable-dp-attention": None, "cuda-graph-bs": "1 2 4",
                               "context-length": "4096"}


# slime's GLM-5.2 script's groups (scripts/run-glm5.2-744B-A40B.sh), on 1 GPU per engine
PD_YAML = """
sglang:
  - name: actor
    server_groups:
      - worker_type: prefill
        num_gpus: 1
        overrides: {dp_size: 1, enable_dp_attention: true, load_balance_method: follow_bootstrap_room,
                    chunked_prefill_size: 131072, max_running_requests: 512, deepep_mode: auto}
      - worker_type: decode
        num_gpus: 2
        overrides: {dp_size: 1, enable_dp_attention: true, load_balance_method: round_robin,
                    max_running_requests: 768, cuda_graph_max_bs: 12, deepep_mode: low_latency,
                    disable_overlap_schedule: true, enable_memory_saver: false}
"""


def test_prefill_and_decode_groups_keep_their_own_overrides(tmp_path):
    """What both worker types share is --sglang-*; the rest is the type's own (--prefill-sglang-args,
    --decode-sglang-args), over the command line's as slime applies a group's overrides: a key one
    type leaves unset keeps the command line's value there, a false one drops it there."""
    path = config(tmp_path, PD_YAML)
    cfg, ns = parse_config(["--sglang-config", path, "--sglang-max-running-requests", "256",
                            "--sglang-chunked-prefill-size", "4096", "--sglang-enable-memory-saver",
                            "--decode-sglang-args", '{"page-size": 64, "cuda-graph-max-bs": 8}'])
    r = cfg.rollout
    assert (r.rollout_num_gpus, r.num_engines, r.prefill_num_servers, r.engine_model_name) == (3, 3, 1, "actor")
    assert cfg.sglang_args == {"max-running-requests": "256", "chunked-prefill-size": "4096",
                               "enable-memory-saver": None, "dp-size": "1", "enable-dp-attention": None}
    assert r.prefill_sglang_args == {"load-balance-method": "follow_bootstrap_room", "chunked-prefill-size": "131072",
                                     "max-running-requests": "512", "deepep-mode": "auto"}
    assert r.decode_sglang_args == {"page-size": 64, "cuda-graph-max-bs": "12",  # the YAML's over the flag's
                                    "load-balance-method": "round_robin", "max-running-requests": "768",
                                    "deepep-mode": "low_latency", "disable-overlap-schedule": None,
                                    "enable-memory-saver": False}
    notice = next(n for n in ns.slime_notices if n.startswith("--sglang-config"))
    assert "--prefill-num-servers 1 --prefill-sglang-args '{\"load-balance-method\": \"follow_bootstrap_room\"" in notice
    assert notice.endswith("--sglang-dp-size 1 --sglang-enable-dp-attention")
    from agentrl.engines.sglang import merged_args

    # what each type's engines get (agentrl.engines.group: merged, then checked against SGLang's parser)
    assert merged_args(cfg.sglang_args, r.decode_sglang_args)["chunked-prefill-size"] == "4096"
    assert "enable-memory-saver" not in merged_args(cfg.sglang_args, r.decode_sglang_args)
    assert merged_args(cfg.sglang_args, r.prefill_sglang_args)["enable-memory-saver"] is None
    # without --sglang-config: the name slime's hooks know when no config names one
    assert parse_config(["--num-rollout", "1"])[0].rollout.engine_model_name == "default"


def test_worker_type_arguments_need_prefill_and_decode_engines():
    with pytest.raises(ConfigError, match=r"^--prefill-sglang-args: the prefill engines' own SGLang arguments need "
                                          r"--prefill-num-servers"):
        parse_config(["--rollout-engine", "sglang", "--prefill-sglang-args", '{"chunked-prefill-size": 8192}'])
    with pytest.raises(ConfigError, match=r"^--decode-sglang-args: .* need --prefill-num-servers"):
        parse_config(["--rollout-engine", "sglang", "--decode-sglang-args", '{"cuda-graph-max-bs": 8}'])


@pytest.mark.parametrize("yaml, argv, message", [
    ("sglang:\n  - {name: actor, server_groups: [{worker_type: regular, num_gpus: 4}]}\n"
     "  - {name: ref, model_path: /r, update_weights: false, server_groups: [{worker_type: regular, num_gpus: 4}]}\n",
     [], r"sglang has 2 models \(actor, ref\): agentrl's engines serve one model, the policy"),
    ("sglang:\n  - {name: r, model_path: /other, server_groups: [{worker_type: regular, num_gpus: 4}]}\n",
     ["--hf-checkpoint", "/policy"], r"sglang\[0\]\.model_path /other: not the policy's checkpoint \(/policy\)"),
    ("sglang:\n  - {name: r, server_groups: [{worker_type: regular, num_gpus: 4, overrides: {model_path: /o}}]}\n",
     ["--hf-checkpoint", "/policy"], r"sglang\[0\]\.server_groups\[0\]\.overrides\.model_path /o: not the policy's"),
    ("sglang:\n  - {name: r, update_weights: false, server_groups: [{worker_type: regular, num_gpus: 4}]}\n",
     [], r"sglang\[0\]\.update_weights false: the engines would keep their start weights"),
    ("sglang:\n  - {name: r, server_groups: [{worker_type: prefill, num_gpus: 2, num_gpus_per_engine: 2}, "
     "{worker_type: decode, num_gpus: 4, num_gpus_per_engine: 4}]}\n",
     [], r"sglang\[0\]\.server_groups\[1\]\.num_gpus_per_engine 4 differs from server_groups\[0\]'s 2"),
    ("sglang:\n  - {name: r, server_groups: [{worker_type: prefill, num_gpus: 2}, {worker_type: decode, num_gpus: 2, "
     "overrides: {cuda_graph_max_bs: 12}}, {worker_type: decode, num_gpus: 2}]}\n",
     [], r"sglang\[0\]\.server_groups\[\*\]\.overrides\.cuda_graph_max_bs differs between the decode groups "
         r"\(server_groups\[1\] 12, server_groups\[2\] \(unset\)\): agentrl starts the engines of one worker type"),
    ("sglang:\n  - {name: r, server_groups: [{worker_type: regular, num_gpus: 2, overrides: {chunked_prefill_size: 8192}}, "
     "{worker_type: regular, num_gpus: 2}]}\n",
     [], r"overrides\.chunked_prefill_size differs between the regular groups \(server_groups\[0\] 8192, "
         r"server_groups\[1\] \(unset\)\)"),
    ("sglang:\n  - {name: r, server_groups: [{worker_type: regular, num_gpus: 2}, {worker_type: decode, num_gpus: 2}]}\n",
     [], r"sglang\[0\]\.server_groups: worker types decode, regular: either regular groups or prefill with decode"),
    ("sglang:\n  - {name: r, server_groups: [{worker_type: prefill, num_gpus: 2}]}\n",
     [], r"worker types prefill: either regular groups or prefill with decode"),
    ("sglang:\n  - {name: r, server_groups: [{worker_type: regular, num_gpus: 4}]}\n",
     ["--rollout-num-gpus", "8"], r"its server groups have 4 GPUs, --rollout-num-gpus is 8"),
    ("sglang:\n  - {name: r, server_groups: [{worker_type: regular, num_gpus: 4}]}\n",
     ["--prefill-num-servers", "1"], r"not with --prefill-num-servers"),
    ("sglang:\n  - {name: r, server_groups: [{worker_type: regular, num_gpus: 4, tp: 2}]}\n",
     [], r"sglang\[0\]\.server_groups\[0\]\.tp: not a server-group key"),
    ("sglang:\n  - {name: r, server_groups: [{worker_type: regular, num_gpus: 3, num_gpus_per_engine: 2}]}\n",
     [], r"server_groups\[0\]: num_gpus 3 is not a multiple of num_gpus_per_engine 2"),
    ("sglang:\n  - {name: r, server_groups: [{worker_type: worker, num_gpus: 2}]}\n",
     [], r"server_groups\[0\]\.worker_type worker: expected one of regular, prefill, decode, placeholder"),
    ("sglang:\n  - {name: r, server_groups: [{worker_type: regular, num_gpus: 4, overrides: {tp_size: 4}}]}\n",
     [], r"server_groups\[0\]\.overrides\.tp_size: agentrl sets SGLang's --tp-size itself \(use num_gpus_per_engine\)"),
    ("sglang:\n  - {name: r, server_groups: [{worker_type: prefill, num_gpus: 1, overrides: {disaggregation_mode: x}}]}\n",
     [], r"overrides\.disaggregation_mode: agentrl sets SGLang's --disaggregation-mode itself \(use worker_type\)"),
    ("engines: []\n", [], r"no models under sglang"),
])
def test_what_agentrls_engines_cannot_take_names_its_key(tmp_path, yaml, argv, message):
    path = config(tmp_path, yaml)
    with pytest.raises(ConfigError, match=f"^--sglang-config {path}: .*{message}"):
        parse_config(["--sglang-config", path, *argv])


def test_a_missing_file_or_value_is_named():
    with pytest.raises(ConfigError, match="^--sglang-config /no/such.yaml: no such file"):
        parse_config(["--sglang-config", "/no/such.yaml"])
    with pytest.raises(ConfigError, match="^--sglang-config: needs a YAML file"):
        parse_config(["--sglang-config"])
