"""slime's --sglang-config (docs/en/advanced/sglang-config.md in slime): a YAML of models, each
with server groups (regular, prefill, decode, placeholder; GPUs, GPUs per engine, SGLang
overrides). agentrl launches one group of engines serving the policy, so a one-model config maps
onto --rollout-num-gpus, --rollout-num-gpus-per-engine, --num-engines, --prefill-num-servers and
--sglang-*; what does not map is an error naming the YAML key (slime's GLM-5.2 script: its
prefill and decode groups take different SGLang arguments)."""

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
    ("sglang:\n  - {name: r, server_groups: [{worker_type: prefill, num_gpus: 2, overrides: {chunked_prefill_size: 8192}}, "
     "{worker_type: decode, num_gpus: 2}]}\n",
     [], r"sglang\[0\]\.server_groups\[\*\]\.overrides\.chunked_prefill_size differs between groups "
         r"\(server_groups\[0\] 8192, server_groups\[1\] \(unset\)\)"),
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
