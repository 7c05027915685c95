"""slime's launch scripts run unchanged through `agentrl train --dry-run` (issue 33).

Five of slime's scripts (tests/slime_scripts.py lists them), their train.py / train_async.py
arguments built as bash builds them: from slime's own files when a slime checkout is there (the
git mirror, as tests/test_slime_real.py finds it), and always from the copies checked in under
tests/data/slime_scripts/ (which must equal what slime's files give). Each runs through the
parse and the dry run's checks: what it selects (Megatron, SGLang, bf16, the reward of
--rm-type), its model-shape flags checked against the model's config.json, its hooks imported."""

import json
import sys
from pathlib import Path

import pytest

from slime_scripts import HF_CONFIGS, HOOK_DIRS, SCRIPTS, checked_in, script_args, slime_checkout

from agentrl.cli import dry_run_checks
from agentrl.config import parse_config
from agentrl.errors import ConfigError

# hooks of the scripts, written here when slime is absent: user functions with slime's signatures
FIXTURE_HOOKS = {
    "generate_with_search.py": "async def generate(args, sample, sampling_params):\n    return sample\n\n"
                               "async def reward_func(args, sample, **kwargs):\n    return 0.0\n",
    "generate_with_retool.py": "async def generate(args, sample, sampling_params):\n    return sample\n\n"
                               "async def reward_func(args, sample, **kwargs):\n    return 0.0\n",
    "slime/__init__.py": "", "slime/rollout/__init__.py": "",
    "slime/rollout/fully_async_rollout.py": "def generate_rollout_fully_async(args, rollout_id, data_source, "
                                            "evaluation=False):\n    return []\n",
}


@pytest.fixture(scope="module")
def slime(tmp_path_factory):
    return slime_checkout(tmp_path_factory.mktemp("slime"))


@pytest.fixture
def hooks_importable(slime, tmp_path, monkeypatch):
    """slime's example folders on sys.path (as the scripts' PYTHONPATH), else fixture hooks."""
    if slime is not None:
        for folder in HOOK_DIRS:
            monkeypatch.syspath_prepend(str(slime / folder))
    else:
        for name, text in FIXTURE_HOOKS.items():
            (tmp_path / "hooks" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "hooks" / name).write_text(text)
        monkeypatch.syspath_prepend(str(tmp_path / "hooks"))
    for name in [m for m in sys.modules if m.split(".")[0] in ("slime", "generate_with_search", "generate_with_retool")]:
        monkeypatch.delitem(sys.modules, name)


def localize(args: list[str], root: Path, name: str) -> list[str]:
    """The script's /root/... and /tmp/... paths moved under `root`; its model folder gets the
    model's config.json."""
    args = [str(root) + a if a.startswith(("/root/", "/tmp/")) else a for a in args]
    model = Path(args[args.index("--hf-checkpoint") + 1])
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(HF_CONFIGS[name]))
    ref = Path(args[args.index("--ref-load") + 1])  # the torch_dist the user converted: what the dry run looks for
    (ref / "iter_0000000").mkdir(parents=True, exist_ok=True)
    (ref / "iter_0000000" / "metadata.json").write_text("{}")
    (ref / "latest_checkpointed_iteration.txt").write_text("0")
    return args


def megatron_families() -> set[str]:
    from agentrl.trainers.megatron.families import FAMILIES

    return {t for m in FAMILIES for t in m.MODEL_TYPES}


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_slime_script_runs_what_slime_would(name, tmp_path, hooks_importable):
    text = " ".join(checked_in(name))
    args = localize(checked_in(name), tmp_path, name)
    cfg, ns = parse_config(args)
    assert (cfg.train.trainer, cfg.rollout.rollout_engine, cfg.model.dtype) == ("megatron", "sglang", "bfloat16")
    assert cfg.model.model == str(tmp_path) + args[args.index("--hf-checkpoint") + 1][len(str(tmp_path)):]
    assert cfg.data.input_key == "prompt" and cfg.rollout.rollout_batch_size == int(text.split("--rollout-batch-size ")[1].split()[0])
    # the model-shape flags were checked against config.json, not handed to Megatron to override it
    assert not {"num_layers", "hidden_size", "num_attention_heads", "num_query_groups"} & set(cfg.megatron_args)
    assert cfg.megatron_args["tensor_model_parallel_size"] == text.split("--tensor-model-parallel-size ")[1].split()[0]
    assert "accumulate_allreduce_grads_in_fp32" in cfg.megatron_args
    assert cfg.algo.use_kl_loss and cfg.algo.kl_loss_type == "low_var_kl" and cfg.algo.eps_clip_high == 0.28
    assert cfg.train.max_tokens_per_gpu == int(text.split("--max-tokens-per-gpu ")[1].split()[0])
    assert cfg.train.balance_data and not any(n.startswith("--balance-data") for n in ns.slime_notices)
    # the KL reference is the script's torch_dist (read by the Megatron trainer); the start, --hf-checkpoint
    assert cfg.run.ref_load.rstrip("/").endswith("_torch_dist")
    assert any("so a Megatron checkpoint: the Megatron trainer reads the KL reference" in n for n in ns.slime_notices)
    if "--rm-type" in text:  # the reward slime's rm_hub would give, here agentrl's rm_hub
        assert cfg.algo.rm_type == "deepscaler" and cfg.algo.custom_rm_path == "agentrl.rm_hub.async_rm"
        assert cfg.run.env == "slime" and "agentrl.rm_hub.env" in cfg.run.env_module
    if "--custom-rm-path" in text:
        assert cfg.algo.custom_rm_path.endswith(".reward_func") and cfg.rollout.custom_generate_function_path
    if name == "qwen3-30B-A3B":
        assert cfg.sglang_args["cuda-graph-bs"].split() == ["1", "2", "4", "8"] + [str(n) for n in range(16, 257, 8)]
        assert cfg.megatron_args["moe_layer_freq"] == [1] * 48
    if "--load" in args:  # slime's load-and-save folder, empty on the first run: start from the reference
        assert cfg.run.load is None and any("no checkpoint there yet" in n for n in ns.slime_notices)
    if HF_CONFIGS[name]["model_type"] in megatron_families():
        dry_run_checks(cfg)
    else:  # the MoE family is the scale work's: here the run gets as far as the model
        with pytest.raises(ConfigError, match=r"model family 'qwen3_moe' not supported yet"):
            dry_run_checks(cfg)


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_checked_in_arguments_are_slimes(name, slime):
    if slime is None:
        pytest.skip("no slime checkout (AGENTRL_SLIME_SRC or the git mirror)")
    assert script_args(slime, SCRIPTS[name]) == checked_in(name), \
        "refresh tests/data/slime_scripts: python tests/slime_scripts.py SLIME_DIR"


def test_a_model_flag_that_differs_from_config_json_names_both(tmp_path, hooks_importable):
    args = localize(checked_in("qwen3-4B"), tmp_path, "qwen3-4B")
    args[args.index("--num-layers") + 1] = "35"
    with pytest.raises(ConfigError, match=r"--num-layers 35 differs from .*config.json \(36\)"):
        parse_config(args)
    args = localize(checked_in("qwen3-4B"), tmp_path, "qwen3-4B") + ["--untie-embeddings-and-output-weights"]
    with pytest.raises(ConfigError, match="--untie-embeddings-and-output-weights: .*config.json says otherwise"):
        parse_config(args)
    with pytest.raises(ConfigError, match=r"--rotary-base: checked against the model's config.json, but "
                                          r".*nowhere/config.json does not exist"):
        parse_config(["--rotary-base", "10000", "--hf-checkpoint", str(tmp_path / "nowhere"), "--rm-type", "math"])


def test_a_hook_path_with_a_typo_fails_the_dry_run(tmp_path, hooks_importable):
    args = localize(checked_in("search-r1"), tmp_path, "search-r1")
    args[args.index("--custom-generate-function-path") + 1] = "generate_with_serch.generate"
    cfg, _ = parse_config(args)
    with pytest.raises(ConfigError, match=r"--custom-generate-function-path generate_with_serch.generate: "
                                          r"cannot import it: ModuleNotFoundError"):
        dry_run_checks(cfg)


def test_load_as_slime_reads_it(tmp_path):
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = ["--hf-checkpoint", str(model)]
    cfg, ns = parse_config(base + ["--load", str(tmp_path / "empty")])  # not there yet: start from the model
    assert cfg.run.load is None and cfg.model.model == str(model) and "no checkpoint there yet" in ns.slime_notices[0]
    run = tmp_path / "run"
    (run / "iter_000002").mkdir(parents=True)
    (run / "iter_000002" / "trainer_state.json").write_text("{}")
    assert parse_config(base + ["--load", str(run)])[0].run.load == str(run)  # a checkpoint: resume
    cfg, _ = parse_config(["--load", str(model)])  # an HF folder: slime's finetune start
    assert cfg.run.load is None and cfg.model.model == str(model)
    cfg, _ = parse_config(["--ref-load", str(model), "--rm-type", "math"])  # an HF reference: the start and the KL reference
    assert cfg.model.model == str(model) and cfg.run.ref_load == str(model) and cfg.train.trainer == "megatron"
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    # slime: with no checkpoint in --load the actor starts from --ref-load (--hf-checkpoint gives the tokenizer)
    cfg, ns = parse_config(["--ref-load", str(model), "--hf-checkpoint", str(other), "--rm-type", "math"])
    assert cfg.model.model == str(model) and "training starts from it" in ns.slime_notices[0]
    # an HF --load is the start, --ref-load stays the KL reference (read by the trainers: trainers/test_ref_load.py)
    cfg, ns = parse_config(["--ref-load", str(model), "--load", str(other), "--rm-type", "math"])
    assert (cfg.model.model, cfg.run.ref_load, cfg.run.load) == (str(other), str(model), None)
    # a resumed run keeps --ref-load as its reference
    cfg, _ = parse_config(["--ref-load", str(model), "--hf-checkpoint", str(other), "--load", str(run),
                           "--rm-type", "math"])
    assert (cfg.model.model, cfg.run.ref_load, cfg.run.load) == (str(other), str(model), str(run))
    # slime's torch_dist in --load: slime starts its actor from it; here refused, never a quiet restart
    dist = tmp_path / "torch_dist"
    (dist / "iter_0000002").mkdir(parents=True)
    (dist / "iter_0000002" / "metadata.json").write_text("{}")
    (dist / "latest_checkpointed_iteration.txt").write_text("2")
    with pytest.raises(ConfigError, match=rf"--load {dist}: a Megatron checkpoint \(slime's torch_dist\)"):
        parse_config(["--ref-load", str(model), "--load", str(dist), "--rm-type", "math"])


def test_ref_load_is_checked_where_a_kl_term_reads_it(tmp_path):
    from agentrl.slime_args import megatron_checkpoint_dir

    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(HF_CONFIGS["qwen3-4B"]))
    dist = tmp_path / "torch_dist"
    base = ["--hf-checkpoint", str(model), "--ref-load", str(dist), "--rm-type", "math", "--use-kl-loss"]
    cfg, _ = parse_config(base + ["--kl-loss-coef", "0"])  # slime too reads it only for a KL term
    dry_run_checks(cfg)
    cfg, _ = parse_config(base + ["--kl-loss-coef", "0.01"])
    with pytest.raises(ConfigError, match=f"--ref-load {dist}: neither an HF folder"):
        dry_run_checks(cfg)
    (dist / "iter_0000007").mkdir(parents=True)
    (dist / "iter_0000007" / "metadata.json").write_text("{}")
    (dist / "latest_checkpointed_iteration.txt").write_text("7\n")
    assert megatron_checkpoint_dir(dist) == dist / "iter_0000007"
    dry_run_checks(cfg)
    # slime's --ref-ckpt-step: that iteration, not the latest
    (dist / "iter_0000003").mkdir()
    (dist / "iter_0000003" / "metadata.json").write_text("{}")
    cfg, _ = parse_config(base + ["--kl-loss-coef", "0.01", "--ref-ckpt-step", "3"])
    assert megatron_checkpoint_dir(cfg.run.ref_load) == dist / "iter_0000003"
    dry_run_checks(cfg)
    with pytest.raises(ConfigError, match=f"--ref-load {dist / 'iter_0000004'}: neither"):
        dry_run_checks(parse_config(base + ["--kl-loss-coef", "0.01", "--ref-ckpt-step", "4"])[0])
    with pytest.raises(ConfigError, match="read by the Megatron trainer only"):
        dry_run_checks(parse_config(base + ["--kl-loss-coef", "0.01", "--trainer", "torch"])[0])


def test_a_script_with_an_hf_reference_other_than_its_start_runs(tmp_path, hooks_importable):
    """slime's SFT start with the KL kept at the base: --load the SFT model's HF folder, --ref-load
    the base's. The dry run checks the reference against the start (vocab_size, the policy's shape
    for the Megatron trainer, the tokenizer where both have one) and refuses a mismatch naming it."""
    args = localize(checked_in("qwen3-4B"), tmp_path, "qwen3-4B")
    sft, base = tmp_path / "sft", tmp_path / "base"
    for folder in (sft, base):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(HF_CONFIGS["qwen3-4B"]))
    args[args.index("--ref-load") + 1], args[args.index("--load") + 1] = str(base), str(sft)
    args[args.index("--kl-loss-coef") + 1] = "0.01"
    cfg, ns = parse_config(args)
    assert (cfg.model.model, cfg.run.ref_load, cfg.run.load) == (str(sft), str(base), None)
    assert not any("unused" in n for n in ns.slime_notices)
    dry_run_checks(cfg)
    for key, value, shown in (("vocab_size", 151937, "vocab_size 151937 differs"),
                              ("num_hidden_layers", 35, "num_layers 35 differs")):
        (base / "config.json").write_text(json.dumps({**HF_CONFIGS["qwen3-4B"], key: value}))
        with pytest.raises(ConfigError, match=rf"--ref-load {base}: {shown} from the start model {sft}'s"):
            dry_run_checks(cfg)
    # the torch trainer builds the reference from its own config.json: only the token ids must agree
    dry_run_checks(parse_config(args + ["--trainer", "torch"])[0])
    # no KL term: the reference is not read, and a notice says so
    args[args.index("--kl-loss-coef") + 1] = "0.00"
    cfg, ns = parse_config(args)
    dry_run_checks(cfg)
    assert any(n.startswith(f"--ref-load {base}: unused, not loaded") for n in ns.slime_notices)


def test_slime_flags_without_an_effect_say_so_and_refused_ones_say_why(tmp_path, monkeypatch):
    cfg, ns = parse_config(["--use-tensorboard", "--update-weight-buffer-size", str(256 * 2**20),
                            "--rollout-seed", "7", "--wandb-key", "secret", "--wandb-team", "team",
                            "--lr-warmup-fraction", "0.5", "--num-rollout", "4", "--rollout-batch-size", "4",
                            "--n-samples-per-prompt", "4", "--global-batch-size", "8"])
    assert ns.slime_notices == ["--use-tensorboard: accepted, no effect here: tensorboard/ is always written in the "
                                "run folder"]
    assert cfg.train.weight_sync_bucket_mb == 256 and cfg.run.seed == 7
    assert ns.slime_environ == {"WANDB_API_KEY": "secret", "WANDB_ENTITY": "team"}
    assert "secret" not in json.dumps(cfg.model_dump(mode="json"))
    assert cfg.megatron_args["lr_warmup_iters"] == "4"  # half of 4 rollouts x 2 steps
    assert parse_config(["--wandb-key", "--num-rollout", "2"])[1].slime_environ == {}  # ${WANDB_KEY} unset
    with pytest.raises(ConfigError, match="--custom-loss-function-path: not supported by agentrl: agentrl's losses"):
        parse_config(["--custom-loss-function-path", "x.loss"])
    with pytest.raises(ConfigError, match="--use-dynamic-batch-size needs --max-tokens-per-gpu"):
        parse_config(["--use-dynamic-batch-size"])
    assert parse_config(["--eval-top-p", "0.9"])[0].eval.eval_top_p == 0.9  # evaluations sample with it
    with pytest.raises(ConfigError, match="--rm-type nope: unknown; choose from deepscaler"):
        parse_config(["--rm-type", "nope"])
    with pytest.raises(ConfigError, match="the slime env scores with --rm-type or --custom-rm-path"):
        parse_config(["--env", "slime", "--prompt-data", "x.jsonl"])


def test_list_flags_take_slimes_lists():
    cfg, _ = parse_config(["--sglang-cuda-graph-bs", "1", "2", "4", "--router-policy", "cache_aware",
                           "--recompute-modules", "core_attn", "mlp", "--num-rollout", "2"])
    assert cfg.sglang_args == {"cuda-graph-bs": "1 2 4"} and cfg.router_args == {"policy": "cache_aware"}
    assert cfg.megatron_args["recompute_modules"] == "core_attn mlp"


def test_did_you_mean_suggests_only_close_flags(capsys):
    from agentrl.cli import suggest_flags
    from agentrl.config import build_parser

    with pytest.raises(SystemExit):
        suggest_flags(build_parser()).parse_args(["--num-rolout", "2"])
    assert "--num-rolout: did you mean --num-rollout?" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the issue's --rotary-base -> --ray-address: no far-off hint
        suggest_flags(build_parser()).parse_args(["--rotary-bass", "2", "--rm-typ", "x"])
    assert "did you mean" not in capsys.readouterr().err


@pytest.mark.e2e
def test_rm_type_scores_a_real_run(tmp_path):
    """The slime env and --rm-type in the loop: 2 iterations on the tiny model, every saved
    trajectory scored by rm_hub's math (1/0), none failed."""
    import subprocess

    from spine_helpers import agentrl_cli, run_env

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {n}.", "label": str(n)}) + "\n" for n in range(8)))
    out = tmp_path / "run"
    proc = subprocess.run([agentrl_cli(), "train", "--env", "slime", "--rm-type", "math", "--prompt-data", str(data),
                           "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
                           "--global-batch-size", "8", "--rollout-max-response-len", "8", "--no-progress",
                           "--output-dir", str(out)], capture_output=True, text=True, env=run_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for i in range(2)
            for line in (out / "trajectories" / f"rollout_{i:05d}.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(r["reward"] in (0, 1) for r in rows)
    assert all(r["status"] != "failed" for r in rows), [r.get("metadata", {}).get("error") for r in rows]


def test_backend_and_weight_sync_flags_take_slimes_meaning():
    cfg, ns = parse_config(["--train-backend", "megatron", "--update-weight-mode", "full",
                            "--update-weight-transport", "disk", "--update-weight-disk-dir", "/tmp/w", "--allgather-cp"])
    assert (cfg.train.trainer, cfg.train.weight_sync_mode, cfg.train.weight_sync_dir) == ("megatron", "disk", "/tmp/w")
    assert [n.split(":")[0] for n in ns.slime_notices] == ["--allgather-cp"]
    assert parse_config(["--update-weight-transport", "nccl"])[0].train.weight_sync_mode == "auto"
    for argv, message in ((["--update-weight-mode", "delta"], "--update-weight-mode delta requires "
                                                               "--update-weight-transport disk"),
                          (["--update-weight-mode", "delta", "--update-weight-transport", "nccl"],
                           "requires --update-weight-transport disk .as slime., got nccl"),
                          (["--update-weight-mode", "partial"], "--update-weight-mode partial: expected full or delta"),
                          (["--train-backend", "fsdp"], "--train-backend fsdp: slime's only backend is megatron"),
                          (["--update-weight-transport", "ipc"], "--update-weight-transport ipc: expected nccl or disk")):
        with pytest.raises(ConfigError, match=message):
            parse_config(argv)


def test_slimes_delta_weight_sync_flags_are_agentrls_delta_sync():
    """slime's delta example's flags (examples/delta_weight_sync), in either order of mode and transport."""
    sync = ["--update-weight-disk-dir", "/shared/fs/d", "--update-weight-local-checkpoint-dir", "/local/nvme/c",
            "--update-weight-delta-encoding", "overwrite", "--update-weight-delta-checksum", "adler32"]
    for order in (["--update-weight-mode", "delta", "--update-weight-transport", "disk"],
                  ["--update-weight-transport", "disk", "--update-weight-mode", "delta"]):
        cfg, ns = parse_config([*order, *sync])
        t = cfg.train
        assert (t.weight_sync_mode, t.weight_sync_dir, t.weight_sync_local_dir, t.weight_delta_encoding,
                t.weight_delta_checksum) == ("delta", "/shared/fs/d", "/local/nvme/c", "overwrite", "adler32")
        assert not ns.slime_notices
    defaults = parse_config(["--update-weight-mode", "delta", "--update-weight-transport", "disk"])[0].train
    assert (defaults.weight_delta_encoding, defaults.weight_delta_checksum) == ("xor", "xxh3-128")  # slime's
    with pytest.raises(ConfigError, match="--weight-sync-mode delta is for engines apart from the trainer"):
        parse_config(["--update-weight-mode", "delta", "--update-weight-transport", "disk", "--colocate"])
    with pytest.raises(ConfigError, match="--weight-sync-local-dir shapes the delta weight sync, which is off"):
        parse_config(["--update-weight-local-checkpoint-dir", "/local/nvme/c"])


@pytest.mark.parametrize("flag", ["--rollout-sample-hook-path", "--rollout-data-postprocess-path",
                                  "--custom-convert-samples-to-train-data-path", "--custom-pg-loss-reducer-function-path",
                                  "--custom-rollout-log-function-path", "--custom-megatron-init-path",
                                  "--custom-model-provider-path", "--megatron-config-path"])
def test_every_slime_hook_flag_is_taken_or_refused_saying_why(flag):
    """slime's hook flags agentrl cannot run fail naming the flag and the reason (not the parser's
    bare 'unrecognized arguments')."""
    with pytest.raises(ConfigError, match=f"^{flag}: not supported by agentrl: .{{20,}}"):
        parse_config([flag, "mod.fn"])


def test_no_slime_hook_flag_is_left_unrecognised():
    """Every `-path`/hook flag of slime's own parser is agentrl's, or refused with a reason."""
    import re

    from agentrl.config import build_parser
    from agentrl.slime_args import flag_status

    text = (Path(__file__).parent / "data" / "slime_scripts" / "slime_arguments_flags.txt").read_text()
    parser_flags = {f for action in build_parser()._actions for f in action.option_strings}
    hooks = [f for f in text.split() if re.search(r"-path$|hook|function-path", f)]
    assert len(hooks) > 20
    assert not [f for f in hooks if flag_status(f, parser_flags) == "unknown"]


def test_the_parser_flag_list_is_slimes(slime):
    from slime_scripts import DATA, parser_flags

    if slime is None:
        pytest.skip("no slime checkout (AGENTRL_SLIME_SRC or the git mirror)")
    assert parser_flags(slime) == (DATA / "slime_arguments_flags.txt").read_text().split(), \
        "refresh tests/data/slime_scripts: python tests/slime_scripts.py SLIME_DIR"


# What still stops a `python3 train.py` line of slime's scripts/ and examples/ (slime 624b824) before
# the model's config.json is read: script -> the refusal, each saying why (docs/slime.md). GLM-5.2's
# --sglang-config (the YAML its script writes) is read onto prefill and decode engines with their
# own SGLang arguments, so it gets to the model.
STILL_REFUSED = {
    "examples/on_policy_distillation/run-qwen3-8B-opd-megatron.sh": "--opd-teacher-load /root/.*: no such folder",
}


def test_every_train_line_of_slimes_scripts_gets_to_the_model(slime, monkeypatch, tmp_path):
    """Every script of slime's with a `python3 train.py` / `train_async.py` line, its arguments built
    as bash builds them, run from slime's root (its relative paths) through the parse: each gets as
    far as the model's config.json (absent here: /root/...), or stops at a refusal listed above:
    of slime 624b824's 41 such lines, 40 reach the model and 1 is refused (geo3k's VLM run, with
    --multimodal-keys and the Megatron trainer it selects, reaches it too: its Qwen3.5 family is then issue #30's; MiMo's and GLM-4.7's
    --enable-mtp-training reach it: MiMo's MTP layers are trained, GLM-4.x's refused once its config.json
    says glm4_moe, tests/test_slime_mtp.py)."""
    import re

    if slime is None:
        pytest.skip("no slime checkout (AGENTRL_SLIME_SRC or the git mirror)")
    monkeypatch.chdir(slime)
    monkeypatch.syspath_prepend(str(slime))
    outcomes = {}
    for sh in sorted([*slime.glob("scripts/**/*.sh"), *slime.glob("examples/**/*.sh")]):
        name = str(sh.relative_to(slime))
        if not re.search(r"python3 train(?:_async)?\.py \\\n", sh.read_text()):
            continue
        try:
            parse_config(script_args(slime, name, scratch=tmp_path))
            outcomes[name] = "parsed"
        except ConfigError as exc:
            outcomes[name] = str(exc)
    model = [n for n, o in outcomes.items()
             if re.search(r"checked against the model's config.json, but .*/config.json does not exist", o)]
    wrong = {n: o[:300] for n, o in outcomes.items() if n not in model and not (
        n in STILL_REFUSED and re.search(STILL_REFUSED[n], o))}
    assert not wrong, wrong
    assert (len(outcomes), len(model), sorted(set(outcomes) - set(model))) == (41, 40, sorted(STILL_REFUSED))


def test_glm52s_engines_are_its_sglang_config(slime, tmp_path):
    """GLM-5.2's script (slime 624b824): its SGLang flags and the --sglang-config YAML it writes
    -> 1 prefill engine and 3 decode engines of 64 GPUs, each type with its group's own SGLang
    arguments over the script's --sglang-* (which the YAML's shared overrides replace)."""
    if slime is None:
        pytest.skip("no slime checkout (AGENTRL_SLIME_SRC or the git mirror)")
    args = script_args(slime, "scripts/run-glm5.2-744B-A40B.sh", scratch=tmp_path)
    starts = [i for i, a in enumerate(args) if a.startswith("--")] + [len(args)]
    keep = [w for i, j in zip(starts, starts[1:]) if args[i].startswith("--sglang-")
            or args[i] == "--rollout-num-gpus-per-engine" for w in args[i:j]]
    cfg, _ = parse_config(keep)
    r = cfg.rollout
    assert (r.rollout_num_gpus, r.rollout_num_gpus_per_engine, r.num_engines, r.prefill_num_servers,
            r.engine_model_name) == (256, 64, 4, 1, "default")
    assert {k: cfg.sglang_args[k] for k in ("dp-size", "ep-size", "enable-dp-attention", "mem-fraction-static",
                                             "deepep-mode", "max-running-requests", "cuda-graph-max-bs")} == {
        "dp-size": "64", "ep-size": "64", "enable-dp-attention": None, "mem-fraction-static": "0.70",
        "deepep-mode": "auto", "max-running-requests": "512", "cuda-graph-max-bs": "8"}
    assert r.prefill_sglang_args == {"load-balance-method": "follow_bootstrap_room", "chunked-prefill-size": "131072",
                                     "max-running-requests": "512", "deepep-mode": "auto"}
    assert r.decode_sglang_args == {"load-balance-method": "round_robin", "max-running-requests": "768",
                                    "cuda-graph-max-bs": "12", "deepep-mode": "low_latency",
                                    "moe-runner-backend": "deep_gemm", "disable-overlap-schedule": None}
