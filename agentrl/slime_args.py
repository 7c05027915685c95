"""slime's launch-script flags: what `agentrl train` does with the ones that are not agentrl
config fields, so a slime script's arguments (its `train.py` / `train_async.py` line, with
`scripts/models/*.sh` sourced) run unchanged.

Each such flag is, in this order of preference:
- mapped onto an agentrl field (`--rollout-seed` -> `--seed`, `--update-weight-buffer-size`
  bytes -> `--weight-sync-bucket-mb`);
- a model-shape flag (`--num-layers`, `--rotary-base`, `--swiglu`, ...): agentrl builds the
  Megatron model from the HF `config.json`, so each is checked against it (equal is fine,
  different is an error naming both values) and then dropped;
- passed to Megatron (trainers/megatron/flags.py) or SGLang (`--sglang-*`), list values too;
- accepted with a one-line notice where it has no effect here (NO_EFFECT says why);
- refused with the reason (REFUSED: slime hooks agentrl cannot run, and features it does not have:
  MTP training);
- or, for slime's YAML files (--custom-config-path, --eval-config, --sglang-config), read as slime
  reads them, onto agentrl's settings, a key that does not map being an error naming it.

A slime run is recognised by its model-shape flags or `--ref-load` (every slime script has
both): it then selects what slime runs, under any explicit flag: the Megatron trainer,
SGLang engines, bf16 (fp16 with `--fp16`), and the `slime` env (the prompt as given, one
response, scored by `--rm-type` / `--custom-rm-path`, agentrl/rm_hub). Why this and not a
separate drop-in entry point: one command, one parser, one `--help`, and a slime script's
flags mix freely with agentrl's; a second entry would be a second parser to keep in step.
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from agentrl.errors import ConfigError

SLIME_ENV, SLIME_ENV_MODULE = "slime", "agentrl.rm_hub.env"
RM_HUB_REWARD = "agentrl.rm_hub.async_rm"  # what --rm-type scores with (a row's metadata rm_type wins)


def _rope_theta(hf: dict):
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return hf.get("rope_theta", params.get("rope_theta") if isinstance(params, dict) else None)


def _head_dim(hf: dict):
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def _experts(hf: dict):
    return hf.get("num_experts") or hf.get("n_routed_experts") or hf.get("num_local_experts")


def _mtp_layers(hf: dict):
    """The checkpoint's multi-token-prediction layers (MiMo, DeepSeek-V3, GLM-4.5+: num_nextn_predict_layers;
    Qwen3-Next / 3.5: mtp_num_hidden_layers); KeyError where it has none."""
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if hf.get(key):
            return hf[key]
    raise KeyError("num_nextn_predict_layers")


# Megatron model flag -> its value in the HF config.json (a key, or a function of the config)
SHAPE_VALUES: dict[str, Callable[[dict], Any]] = {
    "num_layers": lambda hf: hf["num_hidden_layers"],
    "hidden_size": lambda hf: hf["hidden_size"],
    "ffn_hidden_size": lambda hf: hf["intermediate_size"],
    "num_attention_heads": lambda hf: hf["num_attention_heads"],
    "num_query_groups": lambda hf: hf.get("num_key_value_heads", hf["num_attention_heads"]),
    "kv_channels": _head_dim,
    "norm_epsilon": lambda hf: hf["rms_norm_eps"],
    "rotary_base": _rope_theta,
    "vocab_size": lambda hf: hf["vocab_size"],
    "rotary_percent": lambda hf: hf.get("partial_rotary_factor", 1.0),
    "num_experts": _experts,
    "moe_ffn_hidden_size": lambda hf: hf["moe_intermediate_size"],
    "moe_router_topk": lambda hf: hf["num_experts_per_tok"],
    "max_position_embeddings": lambda hf: hf["max_position_embeddings"],
    "mtp_num_layers": _mtp_layers,  # checked, and passed to the Megatron trainer (MiMo: it builds them; finish)
    "q_lora_rank": lambda hf: hf["q_lora_rank"],
    "kv_lora_rank": lambda hf: hf["kv_lora_rank"],
    "qk_head_dim": lambda hf: hf["qk_nope_head_dim"],
    "qk_pos_emb_head_dim": lambda hf: hf["qk_rope_head_dim"],
    "v_head_dim": lambda hf: hf["v_head_dim"],
    "normalization": lambda hf: "RMSNorm" if "rms_norm_eps" in hf else "LayerNorm",
    "position_embedding_type": lambda hf: "rope" if _rope_theta(hf) is not None else "learned_absolute",
}
# Megatron model switches (bare flags) -> whether the HF config says the same
SHAPE_SWITCHES: dict[str, Callable[[dict], bool]] = {
    "swiglu": lambda hf: hf.get("hidden_act") in ("silu", "swish"),
    "untie_embeddings_and_output_weights": lambda hf: not hf.get("tie_word_embeddings", False),
    "group_query_attention": lambda hf: hf.get("num_key_value_heads", hf["num_attention_heads"])
    < hf["num_attention_heads"],
    "use_rotary_position_embeddings": lambda hf: _rope_theta(hf) is not None,
    "disable_bias_linear": lambda hf: not hf.get("mlp_bias", False),
    "add_qkv_bias": lambda hf: hf.get("model_type") in ("qwen2", "mimo") or bool(hf.get("attention_bias")),
    "qk_layernorm": lambda hf: str(hf.get("model_type", "")).startswith("qwen3"),
}
# structure flags of families whose layout agentrl reads from config.json alone
SHAPE_FROM_CONFIG = {"apply_layernorm_1p", "use_gated_attention", "mscale", "mscale_all_dim", "rotary_scaling_factor",
                     "use_rope_scaling", "spec", "no_position_embedding", "post_self_attn_layernorm",
                     "post_mlp_layernorm", "multi_latent_attention", "seq_length"}

MTP_NOT_BUILT = ("the torch trainer builds no multi-token-prediction layers; untrained, they keep the checkpoint's "
                 "weights, which an SGLang speculative draft (--sglang-speculative-algorithm EAGLE) reads from the "
                 "checkpoint itself")
MTP_FAMILIES = ("mimo",)  # model types whose MTP layers the Megatron trainer maps (trainers/megatron/mtp.py)
# accepted, with the reason it changes nothing here
NO_EFFECT: dict[str, str] = {
    "use_tensorboard": "tensorboard/ is always written in the run folder",
    "save_debug_rollout_data": "every sample is always saved under <output_dir>/trajectories/",
    "log_probs_chunk_size": "the log-prob kernels chunk the vocabulary themselves",
    "disable_compute_advantages_and_returns": "SFT (--loss-type sft_loss) computes no advantages",
    "disable_wandb_random_suffix": "the wandb run is named after the run folder",
    "no_offload_train": "--colocate decides offloading (--colocate-offload)",
    "no_offload_rollout": "--colocate decides offloading (--colocate-offload)",
    "data_pad_size_multiplier": "packed micro-batches are padded as tensor/sequence parallelism needs, by the trainer",
    "enable_experimental": "GLM-5's model file sets it; no model family of agentrl's Megatron trainer uses it",
    "model_name": "the HF <-> Megatron weight mapping is picked by config.json's model_type",
    "loss_mask_type": "masks come from the agent loop (policy tokens 1, the rest 0), never re-derived from text",
    "use_dynamic_batch_size": "",  # checked in finish(): it needs --max-tokens-per-gpu, which agentrl packs by
    "allgather_cp": "context parallelism is megatron-core's (--context-parallel-size); slime's all-gather "
                    "variant computes the same attention another way",
}
# slime options agentrl refuses, each with why
REFUSED: dict[str, str] = {
    "custom_loss_function_path": "agentrl's losses are its algorithms (--advantage-estimator, --loss-type); "
                                 "a custom loss would have to run inside the trainer actor's Megatron step",
    "custom_advantage_function_path": "advantages come from --advantage-estimator (agentrl/algorithms.py)",
    "buffer_filter_path": "agentrl keeps no sample buffer between iterations (--over-sampling-batch-size "
                          "and --dynamic-sampling-filter-path select the groups)",
    "rollout_sample_filter_path": "use --dynamic-sampling-filter-path (whole groups, as agentrl trains them)",
    "rollout_all_samples_process_path": "the run folder's trajectories/ holds every sample of every iteration",
    "eval_function_path": "evaluation runs the rollout path on --eval-prompt-data (agentrl/evaluation.py)",
    "data_source_path": "prompts come from --prompt-data or the env's dataset (agentrl/data.py)",
    "rollout_sample_hook_path": "a --custom-generate-function-path can change the sample before it is scored",
    "rollout_data_postprocess_path": "loss masks come from the agent loop (policy tokens 1, the rest 0) and "
                                     "reach the trainer as recorded",
    "custom_convert_samples_to_train_data_path": "samples become the trainer's packed batches in the trainer "
                                                 "(token ids, loss masks and rewards of each Sample)",
    "custom_pg_loss_reducer_function_path": "the policy loss is a token sum over the global batch divided by its "
                                            "trained-token count (agentrl/algorithms.py, --loss-type)",
    "custom_rollout_log_function_path": "rollout metrics are agentrl's own (metrics.jsonl, tensorboard, wandb); "
                                        "every trajectory is saved under the run folder's trajectories/",
    "custom_eval_rollout_log_function_path": "evaluation metrics are agentrl's own (eval/<name>/...); every "
                                             "trajectory is saved under the run folder's trajectories/",
    "custom_megatron_init_path": "agentrl's Megatron trainer initialises Megatron itself "
                                 "(trainers/megatron/trainer.py) and has no hook points with slime's signatures",
    "custom_megatron_before_log_prob_hook_path": "agentrl's Megatron trainer has no hook points with slime's "
                                                 "signatures (trainers/megatron/trainer.py)",
    "custom_megatron_before_train_step_hook_path": "agentrl's Megatron trainer has no hook points with slime's "
                                                   "signatures (trainers/megatron/trainer.py)",
    "custom_model_provider_path": "the Megatron model is built from the HF config.json (trainers/megatron/model.py)",
    "custom_update_weight_post_write_path": "--weight-sync-mode disk writes to a local or POSIX path and needs no "
                                            "post-write step",
    "megatron_config_path": "one Megatron trainer config: give Megatron flags on the command line",
    # slime's own --sglang-* flags (not SGLang server arguments, which --sglang-* passes through)
    "sglang_router_ip": "slime registers the engines it launches with that running router; agentrl launches its own "
                        "router, or attaches to running engines (or a router in front of them) with "
                        "--rollout-engine-urls URL",
    "sglang_router_port": "slime registers the engines it launches with that running router; agentrl launches its own "
                          "router, or attaches to running engines (or a router in front of them) with "
                          "--rollout-engine-urls URL",
}
# slime flag -> agentrl flag (same meaning, another name)
RENAMED = {"rollout_seed": "--seed", "sglang_router_request_timeout_secs": "--request-timeout-s",
           # disk and delta weight sync (--update-weight-mode, --update-weight-transport: translate())
           "update_weight_disk_dir": "--weight-sync-dir",
           "update_weight_local_checkpoint_dir": "--weight-sync-local-dir",
           "update_weight_delta_encoding": "--weight-delta-encoding",
           "update_weight_delta_checksum": "--weight-delta-checksum"}


@dataclass
class SlimeFlags:
    """What translate() took out of argv: checked or applied once the config is resolved."""

    shape: dict[str, Any] = field(default_factory=dict)  # Megatron model flag -> value (True for a switch)
    megatron: dict[str, Any] = field(default_factory=dict)  # typed Megatron values (moe_layer_freq lists)
    notices: list[str] = field(default_factory=list)
    environ: dict[str, str] = field(default_factory=dict)  # wandb's key, team, host: set before the run
    lr_warmup_fraction: float | None = None
    ref_ckpt_step: int | None = None  # --ref-ckpt-step: the iteration of --ref-load's Megatron checkpoint
    dynamic_batch_size: bool = False
    present: bool = False  # a slime run: model-shape flags or --ref-load
    custom_config: dict[str, Any] = field(default_factory=dict)  # --custom-config-path's config-field keys
    server_concurrency: int | None = None  # --sglang-server-concurrency: requests in flight per engine
    sglang_config: str | None = None  # --sglang-config's YAML: read in warmup() (apply_sglang_config)
    update_weight_mode: str | None = None  # --update-weight-mode and --update-weight-transport: together one
    update_weight_transport: str | None = None  # --weight-sync-mode, set once both are read

    def note(self, flag: str, why: str) -> None:
        self.notices.append(f"{flag}: accepted, no effect here: {why}")


def _values(argv: list[str], i: int) -> tuple[list[str], int]:
    """The words after argv[i] up to the next --flag, and the index after them."""
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return argv[i + 1:j], j


def _number(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{flag}: expected a number, got {text!r}") from None


def _layer_freq(text: str) -> int | list[int]:
    """Megatron's --moe-layer-freq: an int (every Nth layer) or a list of 0/1 per layer, written
    as a list or as Megatron evaluates it, list arithmetic such as `[0]*3+[1]*89` (slime's GLM and
    MiniMax model files)."""
    try:
        value = _list_expr(ast.parse(text.strip().strip("'\""), mode="eval").body)
    except (ValueError, SyntaxError):
        raise ConfigError(f"--moe-layer-freq: expected an int or a list such as [1,1,0] or [0]*3+[1]*89, "
                          f"got {text!r}") from None
    if isinstance(value, int) or (isinstance(value, list) and all(isinstance(v, int) for v in value)):
        return value
    raise ConfigError(f"--moe-layer-freq: expected an int or a list of ints, got {text!r}")


def _list_expr(node):
    """An int, a list literal, or + and * over them (nothing else is evaluated)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_list_expr(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expr(node.left), _list_expr(node.right)
        if isinstance(node.op, ast.Add) and type(left) is type(right):
            return left + right
        if isinstance(node.op, ast.Mult) and {type(left), type(right)} == {list, int}:
            if len(left if isinstance(left, list) else right) * (right if isinstance(right, int) else left) > 100_000:
                raise ValueError("more layers than any model has")
            return left * right
    raise ValueError(ast.dump(node))


def _read_yaml(flag: str, path: str):
    """A slime YAML file's content (None when empty); a missing file or bad YAML is an error naming `flag`."""
    import yaml

    if not Path(path).is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{flag} {path}: malformed YAML: {exc}") from None


def read_custom_config(path: str) -> dict[str, Any]:
    """--custom-config-path's YAML: a mapping of slime argument names to values."""
    where = f"--custom-config-path {path}"
    data = _read_yaml("--custom-config-path", path) or {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigError(f"{where}: the top level must map argument names to values")
    return {k.replace("-", "_"): v for k, v in data.items()}


# --eval-config's per-set keys agentrl honours per set, and those it takes only when every set agrees
EVAL_SET_KEYS = ("name", "path", "rm_type", "n_samples_per_eval_prompt", "input_key", "label_key", "metadata_key")
EVAL_SHARED_KEYS = {"temperature": "eval_temperature", "max_response_len": "eval_max_response_len",
                    "top_p": "eval_top_p", "top_k": "eval_top_k"}


def read_eval_config(path: str) -> list[dict[str, Any]]:
    """--eval-config's YAML as slime reads it (an `eval` mapping, or the root): each dataset's keys
    over `defaults`'s. A key agentrl cannot honour per set is an error naming it."""
    where = f"--eval-config {path}"
    data = _read_yaml("--eval-config", path)
    section = data.get("eval", data) if isinstance(data, dict) else None
    datasets = section.get("datasets") if isinstance(section, dict) else None
    if isinstance(datasets, dict):  # slime's ensure_dataset_list: a single dataset mapping
        datasets = [datasets]
    if not datasets or not isinstance(datasets, list) or not all(isinstance(d, dict) for d in datasets):
        raise ConfigError(f"{where}: no datasets under eval.datasets (a list of {{name, path, ...}})")
    defaults = section.get("defaults") or {}
    sets = [{**defaults, **d} for d in datasets]
    for i, d in enumerate(sets):
        if not d.get("name") or not d.get("path"):
            raise ConfigError(f"{where}: dataset {i} needs a name and a path")
        unknown = sorted(set(d) - set(EVAL_SET_KEYS) - set(EVAL_SHARED_KEYS))
        if unknown:
            raise ConfigError(f"{where}: dataset {d['name']!r}: {', '.join(unknown)} not supported per eval set (agentrl "
                              f"takes {', '.join(EVAL_SET_KEYS + tuple(EVAL_SHARED_KEYS))})")
    for key in EVAL_SHARED_KEYS:
        values = {repr(d[key]) for d in sets if key in d}
        if len(values) > 1 or (values and len(values) == 1 and any(key not in d for d in sets)):
            raise ConfigError(f"{where}: {key} differs between datasets ({', '.join(sorted(values))}, or unset); "
                              f"agentrl evaluates every set with one --{EVAL_SHARED_KEYS[key].replace('_', '-')}: "
                              "give it in defaults")
    return sets


# --sglang-config's YAML (slime's docs/en/advanced/sglang-config.md): its keys per model and per server group
SGLANG_MODEL_KEYS = ("name", "model_path", "update_weights", "num_gpus_per_engine", "server_groups", "engine_groups")
SGLANG_GROUP_KEYS = ("worker_type", "num_gpus", "num_gpus_per_engine", "overrides")
WORKER_TYPES = ("regular", "prefill", "decode", "placeholder")
YAML_OWNED = {"tp-size": "(use num_gpus_per_engine)", "tensor-parallel-size": "(use num_gpus_per_engine)",
              "tp": "(use num_gpus_per_engine)", "disaggregation-mode": "(use worker_type)"}


def read_sglang_config(path: str) -> list[dict[str, Any]]:
    """--sglang-config's YAML: a top-level `sglang` list of models, each a mapping."""
    where = f"--sglang-config {path}"
    data = _read_yaml("--sglang-config", path)
    models = data.get("sglang") if isinstance(data, dict) else None
    if not models or not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise ConfigError(f"{where}: no models under sglang (a list of {{name, server_groups: [...]}})")
    return models


def _server_groups(at: str, groups: list[dict], default_gpe: int):
    """--sglang-config's server groups, each checked: (their GPUs, placeholders included; engines
    per worker type; each engine group's GPUs per engine and SGLang overrides by group index;
    the model paths they name, with their YAML keys)."""
    from agentrl.engines.sglang import OWNED, arg_value

    total, kinds, gpes, overrides, paths, types = 0, {}, {}, {}, [], {}
    for i, g in enumerate(groups):
        here = f"{at}.server_groups[{i}]"
        for key in g:
            if key not in SGLANG_GROUP_KEYS:
                raise ConfigError(f"{here}.{key}: not a server-group key (slime takes {', '.join(SGLANG_GROUP_KEYS)})")
        kind, gpus, gpe = g.get("worker_type"), g.get("num_gpus"), g.get("num_gpus_per_engine", default_gpe)
        if kind not in WORKER_TYPES:
            raise ConfigError(f"{here}.worker_type {kind}: expected one of {', '.join(WORKER_TYPES)}")
        for key, value in (("num_gpus", gpus), ("num_gpus_per_engine", gpe)):
            if type(value) is not int or value < 1:
                raise ConfigError(f"{here}.{key} {value}: expected a positive integer")
        total += gpus
        if kind == "placeholder":  # GPUs reserved, no engine: overrides apply to nothing
            continue
        if gpus % gpe:
            raise ConfigError(f"{here}: num_gpus {gpus} is not a multiple of num_gpus_per_engine {gpe}")
        if not isinstance(g.get("overrides") or {}, dict):
            raise ConfigError(f"{here}.overrides: expected a mapping of SGLang server arguments")
        extra = dict(g.get("overrides") or {})
        paths.append((f"{here}.overrides.model_path", extra.pop("model_path", None)))
        for key in extra:
            dashed = key.replace("_", "-")
            if dashed in OWNED:
                raise ConfigError(f"{here}.overrides.{key}: agentrl sets SGLang's --{dashed} itself "
                                  f"{YAML_OWNED.get(dashed, OWNED[dashed])}")
        gpes[i], overrides[i] = gpe, {k.replace("_", "-"): arg_value(v) for k, v in extra.items()}
        kinds[kind], types[i] = kinds.get(kind, 0) + gpus // gpe, kind
    return total, kinds, gpes, overrides, paths, types


def _split_overrides(at: str, overrides: dict[int, dict], types: dict[int, str]):
    """The groups' overrides -> (those every engine takes; the prefill engines' own; the decode
    engines' own). Groups of one worker type must agree (agentrl starts that type's engines
    alike); a key prefill and decode groups give differently (or one of them only) is that type's."""
    by_type: dict[str, dict] = {}
    for kind in dict.fromkeys(types.values()):
        groups = [i for i in overrides if types[i] == kind]
        for key in sorted(set().union(*(overrides[i] for i in groups))):
            values = {i: overrides[i].get(key, "(unset)") for i in groups}
            if len(set(map(repr, values.values()))) > 1:
                shown = ", ".join(f"server_groups[{i}] {v if v is not None else 'true'}" for i, v in values.items())
                raise ConfigError(f"{at}.server_groups[*].overrides.{key.replace('-', '_')} differs between the "
                                  f"{kind} groups ({shown}): agentrl starts the engines of one worker type with the "
                                  "same SGLang arguments; give one value to all")
        by_type[kind] = overrides[groups[0]]
    if set(by_type) != {"prefill", "decode"}:
        return next(iter(by_type.values())), {}, {}
    p, d = by_type["prefill"], by_type["decode"]
    shared = {k: v for k, v in p.items() if k in d and repr(d[k]) == repr(v)}
    return shared, {k: v for k, v in p.items() if k not in shared}, {k: v for k, v in d.items() if k not in shared}


def apply_sglang_config(path: str, layers: dict, notices: list[str]) -> None:
    """slime's --sglang-config, onto agentrl's one engine group (layers edited in place): one
    model, the policy, its server groups -> --rollout-num-gpus (their sum, placeholders included,
    as slime checks it), --rollout-num-gpus-per-engine, --num-engines, --prefill-num-servers (the
    prefill groups' engines), the groups' `overrides` -> --sglang-* (over the command line's, as in
    slime; those the prefill and decode groups do not share -> --prefill-sglang-args /
    --decode-sglang-args), and the model's name -> --engine-model-name (slime's
    args.sglang_model_routers key). What agentrl's engines cannot take is an error naming the YAML
    key: a second model, a frozen one (update_weights: false, another model_path), groups of
    different GPUs per engine, or overrides that differ between groups of one worker type."""
    where = f"--sglang-config {path}"
    models = read_sglang_config(path)
    if len(models) > 1:
        names = ", ".join(str(m.get("name")) for m in models)
        raise ConfigError(f"{where}: sglang has {len(models)} models ({names}): agentrl's engines serve one model, the "
                          "policy (a KL reference is --ref-load, a judge --judge-load, a teacher --opd-teacher-load, "
                          "each served as agentrl runs it)")
    m, at = models[0], f"{where}: sglang[0]"
    for key in m:
        if key not in SGLANG_MODEL_KEYS:
            raise ConfigError(f"{at}.{key}: not a key of slime's sglang-config (it takes {', '.join(SGLANG_MODEL_KEYS)})")
    if not m.get("name"):
        raise ConfigError(f"{at}.name: required (slime's model name)")
    rollout = layers.setdefault("rollout", {})
    for other, why in (("prefill_num_servers", "set the prefill engines with server_groups' worker_type prefill"),
                       ("rollout_engine_urls", "engines given by URL are not launched from a config")):
        if rollout.get(other):
            raise ConfigError(f"{where}: not with --{other.replace('_', '-')} (slime refuses both together too): {why}")
    if rollout.get("rollout_engine", "sglang") != "sglang":
        raise ConfigError(f"{where}: describes SGLang engines; not with --rollout-engine {rollout['rollout_engine']}")
    groups = m.get("server_groups", m.get("engine_groups"))
    if not groups or not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ConfigError(f"{at}.server_groups: required, a list of {{worker_type, num_gpus, ...}}")
    policy = layers.get("model", {}).get("model")
    default_gpe = m.get("num_gpus_per_engine") or int(rollout.get("rollout_num_gpus_per_engine") or 1)
    total, kinds, gpes, overrides, paths, types = _server_groups(at, groups, default_gpe)
    paths.insert(0, (f"{at}.model_path", m.get("model_path")))
    for key, model_path in paths:
        if model_path and not (policy and Path(str(model_path)).resolve() == Path(policy).resolve()):
            raise ConfigError(f"{key} {model_path}: not the policy's checkpoint ({policy or 'none given'}); agentrl's "
                              "engines serve the policy and take its weights at every sync")
    if m.get("update_weights") is False:
        raise ConfigError(f"{at}.update_weights false: the engines would keep their start weights while the policy "
                          "trains; agentrl's engines serve the policy and take its weights at every sync")
    if not kinds:
        raise ConfigError(f"{at}.server_groups: only placeholders, no engine to generate with")
    if set(kinds) not in ({"regular"}, {"prefill", "decode"}):
        raise ConfigError(f"{at}.server_groups: worker types {', '.join(sorted(kinds))}: either regular groups or "
                          "prefill with decode groups (as slime requires)")
    first = min(gpes)
    for i, gpe in gpes.items():
        if gpe != gpes[first]:
            raise ConfigError(f"{at}.server_groups[{i}].num_gpus_per_engine {gpe} differs from server_groups[{first}]'s "
                              f"{gpes[first]}: agentrl's engines all take one --rollout-num-gpus-per-engine (--tp-size)")
    shared, prefill_own, decode_own = _split_overrides(at, overrides, types)
    given = rollout.get("rollout_num_gpus")
    if given is not None and int(given) != total:
        raise ConfigError(f"{where}: its server groups have {total} GPUs, --rollout-num-gpus is {given} (slime requires "
                          "them equal)")
    engines = sum(kinds.values())
    if rollout.get("num_engines") is not None and int(rollout["num_engines"]) != engines:
        raise ConfigError(f"{where}: {engines} engine(s), --num-engines is {rollout['num_engines']}: drop one")
    rollout.update(rollout_engine="sglang", rollout_num_gpus=total, rollout_num_gpus_per_engine=gpes[first],
                   num_engines=engines,
                   engine_model_name=str(m["name"]))
    read = ""
    if "prefill" in kinds:
        rollout["prefill_num_servers"] = kinds["prefill"]
        read = f" --prefill-num-servers {kinds['prefill']}"
        for kind, own in (("prefill", prefill_own), ("decode", decode_own)):
            if own:  # over the command line's, as slime applies a group's overrides
                rollout[f"{kind}_sglang_args"] = {**rollout.get(f"{kind}_sglang_args", {}), **own}
                read += f" --{kind}-sglang-args '{json.dumps(own)}'"
    sglang = layers.setdefault("sglang_args", {})
    for key, value in shared.items():  # over the command line's --sglang-*, as slime applies them
        if value is False:
            sglang.pop(key, None)
        else:
            sglang[key] = value
    notices.append(f"{where}: read as --rollout-num-gpus {total} --rollout-num-gpus-per-engine {gpes[first]} "
                   f"--num-engines {engines}" + read + "".join(f" --sglang-{k}" + (f" {v}" if v is not None else "")
                                                                for k, v in shared.items() if v is not False))


def _is_slime_flag(name: str) -> bool:
    """A flag translate() or the pass-through takes (not an agentrl field)."""
    from agentrl.trainers.megatron.flags import is_megatron_flag

    special = (*SHAPE_VALUES, *SHAPE_SWITCHES, *SHAPE_FROM_CONFIG, *NO_EFFECT, *REFUSED, *RENAMED, *MAPPED)
    return name in special or name.startswith(("sglang_", "router_")) or is_megatron_flag(name)


def _as_words(name: str, value: Any) -> list[str]:
    """A YAML value as the command line would give the flag (a false or null switch: absent)."""
    flag = "--" + name.replace("_", "-")
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, list):
        return [flag, *map(str, value)]
    return [flag, json.dumps(value) if isinstance(value, dict) else str(value)]


def apply_custom_config(path: str, flags: SlimeFlags, fields, aliases: dict[str, str]) -> list[str]:
    """slime sets each key of the YAML on its args, over the command line. Here: an agentrl field
    (or its alias) goes to flags.custom_config, a layer over the command line's; a slime flag
    agentrl translates or passes through comes back as words for the end of argv; any other key
    only reaches slime's hooks (their args, agentrl/rollout/slime.py), and a notice says so."""
    words, hook_only = [], []
    for name, value in read_custom_config(path).items():
        field_name = aliases.get("--" + name.replace("_", "-"), name)
        if name == "custom_config_path":
            raise ConfigError(f"--custom-config-path {path}: names another custom_config_path")
        if field_name in fields:
            flags.custom_config[field_name] = value
        elif _is_slime_flag(name):
            words += _as_words(name, value)
        else:
            hook_only.append(name)
    if hook_only:
        flags.notices.append(f"--custom-config-path {path}: {', '.join(hook_only)}: no agentrl or slime flag; "
                             "slime's hooks read them as args attributes")
    return words


def translate(argv: list[str], fields=(), aliases: dict[str, str] | None = None) -> tuple[list[str], SlimeFlags]:
    """slime's flags that are not agentrl fields -> (argv for agentrl's parser, SlimeFlags).
    fields, aliases: agentrl's config field names and flag aliases (a --custom-config-path key may name one)."""
    out, flags = [], SlimeFlags()
    argv = list(argv)  # --custom-config-path's slime flags are appended: read last, they win as in slime
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            out.append(arg)
            i += 1
            continue
        flag, eq, inline = arg.partition("=")
        name = flag[2:].replace("-", "_")
        if eq:
            values, nxt = [inline], i + 1
        else:
            values, nxt = _values(argv, i)
        value = values[-1] if values else None
        if name in SHAPE_VALUES or name in SHAPE_SWITCHES:
            flags.shape[name] = True if name in SHAPE_SWITCHES and value is None else value
            if name in SHAPE_VALUES and value is None:
                raise ConfigError(f"{flag}: needs a value")
            if name == "mtp_num_layers":  # the Megatron trainer builds them (checked in finish)
                flags.megatron[name] = value
        elif name in SHAPE_FROM_CONFIG:
            flags.note(flag, "the Megatron model is built from the HF config.json, which sets this")
        elif name in NO_EFFECT:
            if name == "use_dynamic_batch_size":
                flags.dynamic_batch_size = True
            else:
                flags.note(flag, NO_EFFECT[name])
        elif name == "train_backend":  # slime's one choice
            if value != "megatron":
                raise ConfigError(f"{flag} {value}: slime's only backend is megatron; agentrl's trainers are "
                                  "--trainer torch|megatron")
            out += ["--trainer", "megatron"]
        elif name == "update_weight_mode":
            if value not in ("full", "delta"):
                raise ConfigError(f"{flag} {value}: expected full or delta")
            flags.update_weight_mode = value
        elif name == "update_weight_transport":
            if value not in ("nccl", "disk"):
                raise ConfigError(f"{flag} {value}: expected nccl or disk")
            flags.update_weight_transport = value
        elif name in REFUSED:
            raise ConfigError(f"{flag}: not supported by agentrl: {REFUSED[name]} (docs/slime.md)")
        elif name in RENAMED:
            out += [RENAMED[name], *values]
        elif name == "custom_config_path":
            if value is None:
                raise ConfigError(f"{flag}: needs a YAML file")
            argv += apply_custom_config(value, flags, fields, aliases or {})
            out += [arg] if eq else [arg, *values]
        elif name == "update_weight_buffer_size":  # bytes -> MB
            if value is None:
                raise ConfigError(f"{flag}: needs a value (bytes)")
            out += ["--weight-sync-bucket-mb", repr(_number(value, flag) / 2**20)]
        elif name == "lr_warmup_fraction":
            flags.lr_warmup_fraction = _number(value or "", flag)
        elif name == "ref_ckpt_step":
            flags.ref_ckpt_step = int(_number(value or "", flag))
        elif name == "sglang_server_concurrency":  # slime's own, not an SGLang server argument
            flags.server_concurrency = int(_number(value or "", flag))
        elif name == "sglang_config":  # slime's own too (SGLang's --config would misread it)
            if not value:
                raise ConfigError(f"{flag}: needs a YAML file")
            flags.sglang_config = value
        elif name == "moe_layer_freq":
            flags.megatron[name] = _layer_freq(value or "")
        elif name in ("wandb_key", "wandb_team", "wandb_host"):
            if value:  # `--wandb-key ${WANDB_KEY}` with the variable unset gives no value: no key
                env = {"wandb_key": "WANDB_API_KEY", "wandb_team": "WANDB_ENTITY", "wandb_host": "WANDB_BASE_URL"}
                flags.environ[env[name]] = value
        else:
            if name == "ref_load":
                flags.present = True
            out += [arg] if eq else [arg, *values]
        i = nxt
    flags.present = flags.present or bool(flags.shape)
    return out + _weight_sync_mode(flags), flags


def _weight_sync_mode(flags: SlimeFlags) -> list[str]:
    """slime's --update-weight-mode and --update-weight-transport -> --weight-sync-mode: nccl is auto
    (a broadcast to engines on GPUs of their own, CUDA IPC when colocated, as auto picks), full
    disk is disk, delta (disk only, as slime checks) is delta."""
    mode, transport = flags.update_weight_mode, flags.update_weight_transport
    if mode == "delta":
        if transport != "disk":
            raise ConfigError(f"--update-weight-mode delta requires --update-weight-transport disk (as slime), got "
                              f"{transport or 'nccl, the default'}")
        return ["--weight-sync-mode", "delta"]
    return ["--weight-sync-mode", {"nccl": "auto", "disk": "disk"}[transport]] if transport else []


MAPPED = {"update_weight_buffer_size", "lr_warmup_fraction", "moe_layer_freq", "wandb_key", "wandb_team",
          "wandb_host", "ref_ckpt_step", "train_backend", "update_weight_mode", "update_weight_transport",
          "sglang_server_concurrency", "sglang_config"}  # translate() turns these into agentrl's settings


def flag_status(flag: str, parser_flags: set[str]) -> str:
    """How `agentrl train` takes a slime flag (docs/slime.md is checked against this):
    agentrl (a field or mapped onto one), model-shape, no-effect, refused, megatron, sglang,
    router, or unknown (refused by the parser)."""
    from agentrl.trainers.megatron.flags import is_megatron_flag

    name = flag.lstrip("-").replace("-", "_")
    if flag in parser_flags or name in RENAMED or name in MAPPED or name == "use_dynamic_batch_size":
        return "agentrl"
    if name in SHAPE_VALUES or name in SHAPE_SWITCHES:
        return "model-shape"
    if name in SHAPE_FROM_CONFIG or name in NO_EFFECT:
        return "no-effect"
    if name in REFUSED:
        return "refused"
    if flag.startswith("--sglang-"):
        return "sglang"
    if flag.startswith("--router-"):
        return "router"
    return "megatron" if is_megatron_flag(name) else "unknown"


def defaults(flags: SlimeFlags, megatron_args: dict) -> dict[str, dict[str, Any]]:
    """The layer a slime run puts under YAML and flags: what slime would run."""
    if not flags.present:
        return {}
    dtype = "float16" if "fp16" in megatron_args else "bfloat16"
    return {"train": {"trainer": "megatron"}, "rollout": {"rollout_engine": "sglang"},
            "model": {"dtype": dtype}, "run": {"env": SLIME_ENV}}


def prepare(layers: dict, flags: SlimeFlags) -> None:
    """Before resolve (layers: section -> fields, edited in place): --ref-load and --load as slime
    reads them, the slime env's module, --lr-warmup-fraction, --rm-type's reward."""
    run, model, algo = layers.setdefault("run", {}), layers.setdefault("model", {}), layers.setdefault("algo", {})
    ref, load = run.get("ref_load"), run.get("load")
    if flags.ref_ckpt_step is not None:  # slime: that iteration of --ref-load's Megatron checkpoint, not its latest
        if not ref:
            raise ConfigError("--ref-ckpt-step: names an iteration of --ref-load's checkpoint; give --ref-load")
        ref = run["ref_load"] = str(Path(ref) / f"iter_{flags.ref_ckpt_step:07d}")
    if load and not _has_checkpoint(Path(load)) and megatron_checkpoint_dir(load) is not None:
        # slime would start its actor from it; starting from the reference instead would be a quiet restart
        raise ConfigError(f"--load {load}: a Megatron checkpoint (slime's torch_dist), which agentrl does not read "
                          "as the actor's start yet: give --load the HF folder it converts to (slime's "
                          "tools/convert_torch_dist_to_hf.py), or an agentrl checkpoint to resume")
    start = load and (_has_checkpoint(Path(load)) or _is_hf(load))  # slime: else the actor starts from --ref-load
    if ref and _is_hf(ref) and not start:
        given = model.get("model")
        if given and Path(given).resolve() != Path(ref).resolve():
            flags.notices.append(f"--ref-load {ref}: training starts from it, as slime's actor does when --load holds "
                                 f"no checkpoint (--hf-checkpoint {given} is not used)")
        model["model"] = ref
    elif ref and not _is_hf(ref):
        flags.notices.append(f"--ref-load {ref}: not an HF folder, so a Megatron checkpoint: the Megatron trainer "
                             f"reads the KL reference from it when a KL term needs one; training starts from "
                             f"--hf-checkpoint's weights, the same ones converted")
    if load and not _has_checkpoint(Path(load)):
        run["load"] = None
        if _is_hf(load):  # slime: an HF folder in --load is the starting model (its finetune mode)
            model["model"] = load
            flags.notices.append(f"--load {load}: an HF checkpoint, not a run checkpoint: training starts from it")
        else:
            flags.notices.append(f"--load {load}: no checkpoint there yet, so training starts from the reference "
                                 f"({model.get('model') or 'the built-in tiny model'}); --save writes there")
    ev = layers.setdefault("eval", {})
    if ev.get("eval_config"):  # slime: it overrides --eval-prompt-data
        sets = read_eval_config(ev["eval_config"])
        ev["eval_prompt_data"] = [str(x) for d in sets for x in (d["name"], d["path"])]
        for key, name in EVAL_SHARED_KEYS.items():
            if key in sets[0]:
                ev[name] = sets[0][key]
    data = ev.get("eval_prompt_data")
    if isinstance(data, list) and len(data) == 1:  # slime's legacy form: one path, named aime
        ev["eval_prompt_data"] = ["aime", data[0]]
        flags.notices.append(f"--eval-prompt-data {data[0]}: one path, no name: named 'aime', as slime names it")
    if run.get("env") == SLIME_ENV and SLIME_ENV_MODULE not in run.get("env_module", []):
        run["env_module"] = [*run.get("env_module", []), SLIME_ENV_MODULE]
    train = layers.setdefault("train", {})
    if train.get("balance_by_flops"):  # slime: it implies --balance-data (ranks balanced by FLOPs too)
        train["balance_data"] = True
    slime_opd(algo, flags)
    if algo.get("rm_type") and not algo.get("custom_rm_path"):
        algo["custom_rm_path"] = RM_HUB_REWARD  # slime: --custom-rm-path wins over --rm-type


SLIME_OPD_REWARD = "slime.rollout.on_policy_distillation.reward_func"
SLIME_OPD_POST_PROCESS = "slime.rollout.on_policy_distillation.post_process_rewards"
NO_TASK_REWARD = "agentrl.teacher.no_task_reward"


def _spec(value) -> str | None:
    return value.replace(":", ".") if isinstance(value, str) and ".py:" not in value else value


def slime_opd(algo: dict, flags: SlimeFlags) -> None:
    """slime's --use-opd --opd-type sglang (examples/on_policy_distillation): its reward function
    POSTs each sample's tokens to the teacher at --rm-url (SGLang /generate, max_new_tokens 0,
    return_logprob) and returns the reply; its post-process hook keeps the response tokens'
    logprobs as sample.teacher_log_probs and gives every sample reward 0; the loss subtracts
    --opd-kl-coef x (student - teacher logprob) from each token's advantage. agentrl's served
    teacher does the same: --rm-url's server becomes --opd-teacher-url (the same /generate
    prefill, before each training step), the task reward is 0 (agentrl.teacher.no_task_reward)
    and the post-process hook is not run (agentrl.algorithms.compute_advantages adds the term)."""
    reward, post = _spec(algo.get("custom_rm_path")), _spec(algo.get("custom_reward_post_process_path"))
    if reward != SLIME_OPD_REWARD:
        if post == SLIME_OPD_POST_PROCESS:
            raise ConfigError(f"--custom-reward-post-process-path {SLIME_OPD_POST_PROCESS} reads the teacher's reply "
                              f"that --custom-rm-path {SLIME_OPD_REWARD} returns, not --custom-rm-path "
                              f"{algo.get('custom_rm_path') or '(none)'}: name slime's pair (with --use-opd --opd-type "
                              "sglang --rm-url URL), or give the teacher to agentrl with --opd-teacher-url URL")
        return
    where = f"--custom-rm-path {algo['custom_rm_path']}"
    if not (algo.get("use_opd") and algo.get("opd_type") == "sglang"):
        raise ConfigError(f"{where}: slime's on-policy-distillation reward (the teacher's logprobs, task reward 0) is "
                          "for --use-opd --opd-type sglang; without them nothing would train: add both")
    if post != SLIME_OPD_POST_PROCESS:
        raise ConfigError(f"{where}: returns the teacher's reply, which slime turns into teacher logprobs with "
                          f"--custom-reward-post-process-path {SLIME_OPD_POST_PROCESS} (given: "
                          f"{algo.get('custom_reward_post_process_path') or 'none'}): name it, as slime's script does")
    url = (algo.get("rm_url") or "").rstrip("/")
    if not url.endswith("/generate"):
        raise ConfigError(f"{where}: asks the teacher at --rm-url, SGLang's /generate (e.g. http://HOST:PORT/generate); "
                          f"got {algo.get('rm_url') or 'no --rm-url'}")
    for other in ("opd_teacher_url", "opd_teacher_load"):
        if algo.get(other):
            raise ConfigError(f"{where}: the teacher is --rm-url's {algo['rm_url']}; drop "
                              f"--{other.replace('_', '-')} {algo[other]} (or slime's reward pair)")
    algo["opd_teacher_url"] = url[:-len("/generate")]
    algo["custom_rm_path"], algo["custom_reward_post_process_path"] = NO_TASK_REWARD, None
    flags.notices.append(f"{where} with its post-process hook and --rm-url {algo['rm_url']}: slime's on-policy "
                         f"distillation, run as agentrl's --opd-teacher-url {algo['opd_teacher_url']}: the teacher "
                         "scores each sample's response tokens by the same /generate prefill before each training "
                         f"step, each token's advantage loses --opd-kl-coef {algo.get('opd_kl_coef', 1.0)} x (student "
                         "- teacher logprob), and the task reward is 0 (slime's post-process returns 0)")


def concurrency(rollout: dict, run: dict, per_engine: int, engine: str) -> None:
    """--sglang-server-concurrency N: slime allows N requests in flight per engine, N x its engines
    in all (rollout GPUs / GPUs per engine; colocated, the rollout GPUs are the actor's): agentrl's
    --max-concurrency."""
    flag = f"--sglang-server-concurrency {per_engine}"
    if engine == "embedded":
        engines = rollout.get("num_engines") or 1
    else:
        gpus = rollout.get("rollout_num_gpus") or (
            int(run.get("actor_num_nodes") or 1) * int(run.get("actor_num_gpus_per_node") or 1)
            if run.get("colocate") else None)
        engines = rollout.get("num_engines") or (
            max(1, int(gpus) // int(rollout.get("rollout_num_gpus_per_engine") or 1)) if gpus else None)
    if engines is None:
        raise ConfigError(f"{flag}: requests per engine, but the number of engines is not given: add "
                          "--rollout-num-gpus or --num-engines (or --max-concurrency for the total)")
    total = per_engine * int(engines)
    given = rollout.get("max_concurrency")
    if given is not None and int(given) != total:
        raise ConfigError(f"{flag}: {total} requests in flight over {engines} engine(s), but --max-concurrency "
                          f"{given} is given too: drop one")
    rollout["max_concurrency"] = total


def warmup(layers: dict, flags: SlimeFlags, sections: dict[str, Any]) -> None:
    """What needs the config's defaults: --sglang-config's engines; --sglang-server-concurrency's
    total; --num-steps-per-rollout without --global-batch-size sets it, as slime does; then
    --lr-warmup-fraction: Megatron's warmup in optimizer steps, of the run's total. `sections`: the
    config's section classes by name (their defaults fill what the layers leave out)."""
    def get(section, name):
        return layers.get(section, {}).get(name, sections[section].model_fields[name].default)

    if flags.sglang_config:  # before the concurrency: it sets the engines
        apply_sglang_config(flags.sglang_config, layers, flags.notices)
    if flags.server_concurrency is not None:
        concurrency(layers.setdefault("rollout", {}), layers.get("run", {}), flags.server_concurrency,
                    get("rollout", "rollout_engine"))

    train = layers.setdefault("train", {})
    if train.get("num_steps_per_rollout") is not None and train.get("global_batch_size") is None:
        # slime: global_batch_size = rollout_batch_size * n_samples_per_prompt // num_steps_per_rollout
        samples = int(get("rollout", "rollout_batch_size")) * int(get("rollout", "n_samples_per_prompt"))
        steps = int(train["num_steps_per_rollout"])
        if steps > samples or samples % steps:
            raise ConfigError(f"--num-steps-per-rollout {steps} does not divide the {samples} samples of a rollout "
                              f"(--rollout-batch-size x --n-samples-per-prompt): give a divisor of {samples}")
        train["global_batch_size"] = samples // steps
    if flags.lr_warmup_fraction is None:
        return

    steps = (int(get("rollout", "num_rollout")) * int(get("rollout", "rollout_batch_size"))
             * int(get("rollout", "n_samples_per_prompt")) // int(get("train", "global_batch_size")))
    layers.setdefault("megatron_args", {})["lr_warmup_iters"] = str(math.floor(flags.lr_warmup_fraction * steps))


def finish(cfg, flags: SlimeFlags) -> None:
    """After resolve: the model-shape flags against config.json, and the checks slime makes."""
    if flags.dynamic_batch_size and cfg.train.max_tokens_per_gpu is None:
        raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu (as in slime)")
    if cfg.train.balance_by_flops and cfg.train.max_tokens_per_gpu is None:
        raise ConfigError("--balance-by-flops needs --use-dynamic-batch-size with --max-tokens-per-gpu (as in "
                          "slime): the token budget sets how many micro-batches the FLOPs are balanced over")
    if (cfg.train.balance_data or cfg.train.balance_by_flops) and cfg.train.trainer != "megatron":
        flags.notices.append("--balance-data/--balance-by-flops: accepted, no effect here: the torch trainer "
                             "has one data-parallel rank and forms micro-batches by --max-tokens-per-gpu")
    a = cfg.algo
    ref, start = cfg.run.ref_load, cfg.model.model
    kl = a.use_kl_loss and a.kl_loss_coef > 0 or a.kl_coef > 0  # algorithms.needs_reference (it imports this module)
    if ref and not kl and not (start and Path(start).resolve() == Path(ref).resolve()):
        flags.notices.append(f"--ref-load {ref}: unused, not loaded: no KL term reads a reference (--use-kl-loss "
                             f"with --kl-loss-coef above 0, or --kl-coef above 0)")
    if a.use_rollout_logprobs and (a.use_tis or a.recompute_old_logprobs):
        raise ConfigError(f"--use-rollout-logprobs takes the engine's logprobs as the old policy's, so there is no "
                          f"trainer/rollout gap to correct or recompute: drop "
                          f"{'--use-tis' if a.use_tis else '--recompute-old-logprobs'} (slime refuses it with --use-tis too)")
    if a.custom_tis_function_path:
        from agentrl.plugins import load_function

        load_function(a.custom_tis_function_path, flag="--custom-tis-function-path")
        if not a.use_tis:  # slime calls it under --use-tis (its mis.yaml sets use_tis: true)
            raise ConfigError("--custom-tis-function-path computes the --use-tis importance weights, which are off: "
                              "add --use-tis (or use_tis: true in --custom-config-path's YAML)")
    if a.custom_reward_post_process_path:
        from agentrl.plugins import load_function

        load_function(a.custom_reward_post_process_path, flag="--custom-reward-post-process-path")  # a typo fails here
        if a.overlong_buffer_len is not None:
            raise ConfigError("--overlong-buffer-len shapes the rewards the estimator normalises; with "
                              "--custom-reward-post-process-path the function's rewards are used as they are: drop one")
    if cfg.eval.eval_config and any(d.get("rm_type") for d in read_eval_config(cfg.eval.eval_config)) \
            and a.custom_rm_path != RM_HUB_REWARD:
        raise ConfigError(f"--eval-config {cfg.eval.eval_config}: a dataset's rm_type is read by rm_hub's reward "
                          "(--rm-type, or the slime env), which this run does not score with"
                          + (f" (--custom-rm-path {a.custom_rm_path})" if a.custom_rm_path else ": add --rm-type"))
    if cfg.algo.reward_key not in (None, "score"):
        raise ConfigError(f"--reward-key {cfg.algo.reward_key}: agentrl's advantages read a dict reward's 'score' "
                          "entry; return the reward under 'score' (other keys are logged as they are)")
    if cfg.algo.rm_type:
        from agentrl.rm_hub import check_rm_type

        check_rm_type(cfg.algo.rm_type, rm_url=cfg.algo.rm_url, judge=cfg.algo.judge_url or cfg.algo.judge_load)
    r = cfg.rollout
    if r.prefill_num_servers:
        check_pd(r)
    for kind, own in (("prefill", r.prefill_sglang_args), ("decode", r.decode_sglang_args)):
        if own and not r.prefill_num_servers:
            raise ConfigError(f"--{kind}-sglang-args: the {kind} engines' own SGLang arguments need "
                              "--prefill-num-servers (prefill/decode engines)")
    if cfg.run.env == SLIME_ENV and not (cfg.algo.custom_rm_path or r.custom_generate_function_path
                                         or r.rollout_function_path):
        raise ConfigError("the slime env scores with --rm-type or --custom-rm-path: give one (slime raises "
                          "'Rule-based RM type is not specified' too)")
    if flags.shape:
        check_shape(flags.shape, read_hf_config(cfg.model.model, sorted(flags.shape)), cfg.model.model)
    check_mtp(cfg, flags)


def check_mtp(cfg, flags: SlimeFlags) -> None:
    """slime's --mtp-num-layers (checked against config.json by check_shape) and --enable-mtp-training
    (slime: it needs --mtp-num-layers): the Megatron trainer builds and trains the MTP layers of the
    model types in MTP_FAMILIES; any other model is refused, saying why."""
    m = cfg.megatron_args
    layers, training = m.get("mtp_num_layers"), "enable_mtp_training" in m
    if "mtp_loss_scaling_factor" in m and not training:
        flags.note("--mtp-loss-scaling-factor", "without --enable-mtp-training no MTP loss is computed")
    if layers is None and not training:
        return
    if cfg.train.trainer != "megatron":
        if training:
            raise ConfigError("--enable-mtp-training: the MTP layers are trained by the Megatron trainer only "
                              "(--trainer megatron)")
        flags.note("--mtp-num-layers", MTP_NOT_BUILT)
        return
    if training and layers is None:
        raise ConfigError("--enable-mtp-training needs --mtp-num-layers N (as in slime): the MTP layers to build "
                          "and train")
    hf = read_hf_config(cfg.model.model, ["mtp_num_layers"])
    model_type = hf.get("model_type")
    if model_type not in MTP_FAMILIES:
        flag = "--enable-mtp-training" if training else "--mtp-num-layers"
        raise ConfigError(f"{flag}: {cfg.model.model} is model_type {model_type!r}; the Megatron trainer builds and "
                          f"trains the multi-token-prediction layers of {', '.join(MTP_FAMILIES)} only (MiMo's "
                          "model.mtp_layers.*; GLM-4.x's and DeepSeek-V3's MTP layers, layer num_hidden_layers + i, "
                          "are not mapped: docs/slime.md, Multi-token prediction)")


def check_pd(r) -> None:
    """--prefill-num-servers as slime checks it: SGLang engines it launches, and a decode engine left."""
    n = r.prefill_num_servers
    if r.rollout_engine != "sglang" or r.rollout_engine_urls:
        raise ConfigError(f"--prefill-num-servers {n}: prefill/decode engines are SGLang engines agentrl launches "
                          "(--rollout-engine sglang; slime refuses it with external engines too)")
    if r.use_router == "never":
        raise ConfigError(f"--prefill-num-servers {n}: the router pairs prefill and decode engines; drop "
                          "--use-router never")
    engines = r.num_engines or (r.rollout_num_gpus // r.rollout_num_gpus_per_engine if r.rollout_num_gpus else None)
    if engines is not None and engines <= n:
        raise ConfigError(f"--prefill-num-servers {n}: no decode engine left of {engines} "
                          f"(--rollout-num-gpus {r.rollout_num_gpus} / --rollout-num-gpus-per-engine "
                          f"{r.rollout_num_gpus_per_engine}; slime: 'No decode GPUs')")


def read_hf_config(model: str | None, names: list[str]) -> dict:
    given = ", ".join("--" + n.replace("_", "-") for n in names) or "slime's model flags"
    if not model:
        raise ConfigError(f"{given}: checked against the model's config.json, but no --hf-checkpoint is given")
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{given}: checked against the model's config.json, but {path} does not exist")
    hf = json.loads(path.read_text())
    return {**hf, **(hf.get("text_config") or {})}  # a multimodal model's text half


def check_shape(shape: dict[str, Any], hf: dict, model: str) -> None:
    """Each flag equal to the HF config's value, else an error naming both."""
    for name, given in shape.items():
        flag = "--" + name.replace("_", "-")
        try:
            expected = SHAPE_SWITCHES[name](hf) if name in SHAPE_SWITCHES else SHAPE_VALUES[name](hf)
        except (KeyError, TypeError):
            raise ConfigError(f"{flag} {given}: {model}/config.json has no value to check it against") from None
        if name in SHAPE_SWITCHES:
            if given is not True:
                raise ConfigError(f"{flag}: a switch, takes no value (got {given!r})")
            if not expected:
                raise ConfigError(f"{flag}: {model}/config.json says otherwise (model_type "
                                  f"{hf.get('model_type')!r}); drop the flag or use the model it was written for")
            continue
        if not _equal(given, expected):
            raise ConfigError(f"{flag} {given} differs from {model}/config.json ({expected}); the Megatron model "
                              "is built from config.json: drop the flag or fix it")


def _equal(given: str, expected) -> bool:
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        try:
            return math.isclose(float(given), float(expected), rel_tol=1e-9)
        except ValueError:
            return False
    return str(given).strip('"') == str(expected)


def check_family(hf: dict, model: str) -> None:
    """The Megatron trainer's weight mapping knows this model_type (else it would fail at start)."""
    from agentrl.trainers.megatron.families import FAMILIES

    known = sorted(t for m in FAMILIES for t in m.MODEL_TYPES)
    if hf.get("model_type") not in known:
        raise ConfigError(f"{model}: model family {hf.get('model_type')!r} not supported yet by the Megatron trainer "
                          f"(supported: {', '.join(known)})")


def _is_hf(folder: str) -> bool:
    return (Path(folder) / "config.json").is_file()


def check_reference(ref: str, trainer: str, start: str | None = None) -> None:
    """--ref-load is a checkpoint `trainer` reads: an HF folder (either trainer), or a Megatron
    distributed checkpoint (the Megatron trainer), else an error naming it (slime's too). An HF
    folder other than the start model `start` must score the actor's tokens: check_compatible."""
    if _is_hf(ref):
        if start and _is_hf(start) and Path(ref).resolve() != Path(start).resolve():
            check_compatible(ref, start, trainer)
        return
    if megatron_checkpoint_dir(ref) is None:
        raise ConfigError(f"--ref-load {ref}: neither an HF folder (config.json) nor a Megatron checkpoint "
                          "(latest_checkpointed_iteration.txt, or dist_checkpointing's metadata.json)")
    if trainer != "megatron":
        raise ConfigError(f"--ref-load {ref}: a Megatron checkpoint is read by the Megatron trainer only "
                          "(use --trainer megatron, or give the reference as an HF folder)")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_compatible(ref: str, start: str, trainer: str) -> None:
    """The HF reference `ref` reads the start model's token ids as the same tokens: the same
    vocab_size, and the same tokenizer when both folders hold one. The
    Megatron trainer builds the reference in the policy's shape, so there the shape must match too."""
    ref_hf, start_hf = read_hf_config(ref, ["ref_load"]), read_hf_config(start, ["ref_load"])
    keys = {"vocab_size": lambda hf: hf.get("vocab_size")}
    if trainer == "megatron":  # max_position_embeddings sizes no weight: a longer-context fine-tune is fine
        shape = {k: v for k, v in SHAPE_VALUES.items() if k != "max_position_embeddings"}
        keys = {"model_type": lambda hf: hf.get("model_type"), **keys, **shape, **SHAPE_SWITCHES}
    for key, value in keys.items():
        try:
            got, want = value(ref_hf), value(start_hf)
        except (KeyError, TypeError):  # a key one family lacks (MLA's ranks on a dense model): model_type decides
            continue
        if got != want:
            why = ("the KL reference must score the actor's token ids" if key == "vocab_size" else
                   "the Megatron trainer builds the reference in the policy's shape")
            raise ConfigError(f"--ref-load {ref}: {key} {got} differs from the start model {start}'s {want}: {why}")
    if not all(any((Path(m) / f).is_file() for f in TOKENIZER_FILES) for m in (ref, start)):
        return  # a folder without a tokenizer: its token ids are the vocab_size checked above
    from agentrl.models import load_tokenizer

    if load_tokenizer(ref).get_vocab() != load_tokenizer(start).get_vocab():
        raise ConfigError(f"--ref-load {ref}: its tokenizer differs from the start model {start}'s (another "
                          "vocabulary or token ids): the KL reference must read the actor's token ids as the same tokens")


def megatron_checkpoint_dir(folder: str | Path) -> Path | None:
    """The Megatron distributed checkpoint (dist_checkpointing's metadata.json) that `folder`
    names, or None: megatron.training's save folder (latest_checkpointed_iteration.txt ->
    iter_NNNNNNN or release, slime's --ref-load / --opd-teacher-load torch_dist), one of its
    iterations, or an agentrl checkpoint (its megatron/)."""
    folder = Path(folder)
    latest = folder / "latest_checkpointed_iteration.txt"
    if latest.is_file():
        it = latest.read_text().strip()
        folder = folder / ("release" if it == "release" else f"iter_{int(it):07d}")
    for candidate in (folder, folder / "megatron"):
        if (candidate / "metadata.json").is_file():
            return candidate
    return None


def _has_checkpoint(folder: Path) -> bool:
    return (folder / "trainer_state.json").exists() or any(folder.glob("iter_*/trainer_state.json"))
