"""slime's --custom-config-path, --use-rollout-logprobs, --rollout-stop-token-ids,
--rollout-max-context-len and --custom-reward-post-process-path: through `agentrl train
--dry-run`, and each one's behaviour (the YAML's keys where slime puts them, the old policy's
logprobs, where a turn and a trajectory stop, the advantages a post-process function gives)."""

import asyncio
import json
import subprocess
from types import SimpleNamespace

import pytest
import torch
import yaml

from spine_helpers import agentrl_cli, run_env

from agentrl.algorithms import compute_advantages, policy_objective, train_iteration
from agentrl.config import AlgoConfig, parse_config
from agentrl.errors import ConfigError
from agentrl.rollout.agent_loop import LoopSettings, Renderer, run_trajectory
from agentrl.rollout.client import GenerateResult
from agentrl.rollout.slime import slime_args
from agentrl.types import Sample, SampleStatus

# the example's own keys (slime's examples/train_infer_mismatch_helper/mis.yaml), plus slime flags
MIS_YAML = """
use_tis: true
tis_mode: "mask"
tis_level: "token"
tis_upper_bound: 2.0
rs_lower_bound: null
rs_veto_threshold: 1.0e-4
rollout_seed: 7
sglang_mem_fraction_static: 0.5
hf_checkpoint: /models/q
max_turns: 3
"""

POST_PROCESS = """
def post_process(args, samples):
    raw = [s.get_reward_value(args) for s in samples]
    return raw, [10 * r + 1 for r in raw]
"""


@pytest.mark.e2e
def test_the_flags_pass_agentrl_train_dry_run(tmp_path):
    (tmp_path / "mis.yaml").write_text(MIS_YAML)
    (tmp_path / "post.py").write_text(POST_PROCESS)
    (tmp_path / "tis.py").write_text(TIS)
    proc = subprocess.run([agentrl_cli(), "train", "--dry-run", "--custom-config-path", str(tmp_path / "mis.yaml"),
                           "--tis-mode", "truncate", "--rollout-stop-token-ids", "151329", "151336",
                           "--rollout-max-context-len", "4096", "--custom-reward-post-process-path",
                           f"{tmp_path / 'post.py'}:post_process", "--num-rollout", "2"],
                          capture_output=True, text=True, env=run_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["algo"]["tis_mode"] == "mask"  # the YAML over the command line, as slime's setattr
    assert cfg["algo"]["use_tis"] and cfg["algo"]["rs_veto_threshold"] == 1e-4
    assert cfg["run"]["seed"] == 7 and cfg["model"]["model"] == "/models/q" and cfg["rollout"]["max_turns"] == 3
    assert cfg["sglang_args"] == {"mem-fraction-static": "0.5"}
    assert cfg["rollout"]["rollout_stop_token_ids"] == [151329, 151336]
    assert cfg["rollout"]["rollout_max_context_len"] == 4096
    assert "tis_upper_bound, rs_lower_bound: no agentrl or slime flag" in proc.stderr

    proc = subprocess.run([agentrl_cli(), "train", "--dry-run", "--use-rollout-logprobs", "--num-rollout", "2"],
                          capture_output=True, text=True, env=run_env(), timeout=300)
    assert proc.returncode == 0 and yaml.safe_load(proc.stdout)["algo"]["use_rollout_logprobs"], proc.stderr[-2000:]
    proc = subprocess.run([agentrl_cli(), "train", "--dry-run", "--custom-reward-post-process-path",
                           f"{tmp_path / 'post.py'}:post_proces"], capture_output=True, text=True, env=run_env(),
                          timeout=300)  # a typo fails the dry run, naming the flag
    assert proc.returncode != 0 and "--custom-reward-post-process-path" in proc.stderr
    proc = subprocess.run([agentrl_cli(), "train", "--dry-run", "--custom-config-path", str(tmp_path / "mis.yaml"),
                           "--custom-tis-function-path", f"{tmp_path / 'tis.py'}:truncated", "--eval-config",
                           str(_eval_config(tmp_path)), "--rm-type", "deepscaler", "--rollout-top-p", "0.7",
                           "--eval-interval", "2", "--num-rollout", "2"],
                          capture_output=True, text=True, env=run_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["algo"]["custom_tis_function_path"].endswith("tis.py:truncated")
    assert cfg["eval"]["eval_prompt_data"][::2] == ["aime", "gpqa"] and cfg["eval"]["eval_max_response_len"] == 24


def test_custom_config_keys_reach_fields_flags_and_hooks(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(MIS_YAML + "rollout_interaction_env_path: examples.geo3k.env\n")
    cfg, ns = parse_config(["--custom-config-path", str(path), "--seed", "1", "--max-turns", "9"])
    assert (cfg.algo.tis_mode, cfg.run.seed, cfg.rollout.max_turns) == ("mask", 7, 3)
    assert ns.slime_notices == [f"--custom-config-path {path}: tis_upper_bound, rs_lower_bound, "
                                "rollout_interaction_env_path: no agentrl or slime flag; slime's hooks read them "
                                "as args attributes"]
    args = slime_args(cfg, engine_url="http://127.0.0.1:1", model_path="/models/q")
    assert args.tis_upper_bound == 2.0 and args.rs_lower_bound is None
    assert args.rollout_interaction_env_path == "examples.geo3k.env" and args.max_turns == 3 and args.use_tis
    path.write_text("custom_loss_function_path: x.loss\n")  # a refused slime flag is refused from the YAML too
    with pytest.raises(ConfigError, match="--custom-loss-function-path: not supported by agentrl"):
        parse_config(["--custom-config-path", str(path)])
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="the top level must map argument names to values"):
        parse_config(["--custom-config-path", str(path)])
    path.write_text("n_samples_per_prompt: many\n")
    with pytest.raises(ConfigError, match="n-samples-per-prompt"):
        parse_config(["--custom-config-path", str(path)])
    with pytest.raises(ConfigError, match="--custom-config-path /nope.yaml: no such file"):
        parse_config(["--custom-config-path", "/nope.yaml"])


def _sample(reward, n, group=0, rollout_lp=-1.0):
    s = Sample(prompt_tokens=[1, 2], group_id=group, reward=reward, status=SampleStatus.COMPLETED)
    s.append_generated([5] * n, [rollout_lp] * n, 0)
    return s


class RecordingTrainer:
    """train_iteration's trainer side: records what the optimizer step got as the old logprobs."""
    critic, ref_model, train_forward_has_dropout = None, None, False

    def __init__(self):
        self.logprob_passes, self.old = 0, None

    def compute_logprobs(self, samples, model=None):
        self.logprob_passes += 1
        return [[-3.0] * s.response_length for s in samples]

    def policy_step(self, idx, samples, advantages, old, ref):
        self.old = old
        return {"loss": 0.0}


def test_use_rollout_logprobs_makes_the_engines_logprobs_the_old_policys():
    samples = [_sample(1.0, 2, rollout_lp=-0.25), _sample(0.0, 3, rollout_lp=-0.5)]
    trainer = RecordingTrainer()
    out = train_iteration(trainer, samples, AlgoConfig(use_rollout_logprobs=True, kl_coef=0.0), 1)
    assert trainer.logprob_passes == 0 and out["old_logprob_pass"] == 0.0
    assert trainer.old == [[-0.25, -0.25], [-0.5, -0.5, -0.5]]
    trainer = RecordingTrainer()  # two steps without it: the trainer's pass gives them
    train_iteration(trainer, samples, AlgoConfig(), 1)
    assert trainer.logprob_passes == 1 and trainer.old == [[-3.0] * 2, [-3.0] * 3]
    # in the loss: the ratio is pi_train / pi_rollout (clipped), and the gap is measured by the step
    algo = AlgoConfig(use_rollout_logprobs=True, eps_clip=0.2)
    logprobs, rollout = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, -1.02]])
    kw = dict(advantages=torch.ones(1, 2), mask=torch.ones(1, 2), denom=2.0, rollout_logprobs=rollout)
    _, stats = policy_objective(algo, logprobs=logprobs, old_logprobs=rollout, **kw)
    assert stats["clipfrac"].item() == pytest.approx(0.5)  # exp(0.5) is past 1.2, exp(0.02) is not
    assert stats["train_rollout_logprob_abs_diff"].item() == pytest.approx((0.5 + 0.02) / 2)
    with pytest.raises(ConfigError, match="--use-rollout-logprobs .* drop --use-tis"):
        parse_config(["--use-rollout-logprobs", "--use-tis"])


def test_a_post_process_functions_rewards_are_the_advantages(tmp_path):
    (tmp_path / "post.py").write_text(POST_PROCESS + """
def wrong_length(args, samples):
    return [0.0], [0.0]
""")
    samples = [_sample(1.0, 2), _sample(0.0, 1), _sample(1.0, 1, group=1), _sample(1.0, 2, group=1)]
    algo = AlgoConfig(custom_reward_post_process_path=f"{tmp_path / 'post.py'}:post_process")
    assert compute_advantages(samples, algo).advantages == [[11.0, 11.0], [1.0], [11.0], [11.0, 11.0]]
    # without it the group normalisation: the all-1 group carries nothing
    assert compute_advantages(samples, AlgoConfig()).advantages[2:] == [[0.0], [0.0, 0.0]]
    algo = AlgoConfig(custom_reward_post_process_path=f"{tmp_path / 'post.py'}:wrong_length")
    with pytest.raises(ValueError, match="1 rewards for 4 samples"):
        compute_advantages(samples, algo)


class StopClient:
    """Ends each turn with token 9 (a stop id, not EOS) after two tokens, or at max_new_tokens."""

    def __init__(self):
        self.params = []

    async def generate(self, input_ids, sampling_params, **kw):
        self.params.append(dict(sampling_params))
        ids = ([3, 4, 9] if 9 in (sampling_params.get("stop_token_ids") or []) else [3, 4, 5, 6, 7, 8])
        ids = ids[:sampling_params["max_new_tokens"]]
        finish = "stop" if ids[-1] == 9 else "length"
        return GenerateResult(ids, [-0.5] * len(ids), finish, len(input_ids), 0, "0")


class EchoEnv:
    max_turns, stop = 4, None

    async def areset(self, seed=None, options=None):
        return [{"role": "user", "content": "go"}], {}

    async def astep(self, action):
        self.last = action
        return [{"role": "user", "content": "more"}], 0.0, False, False, {}

    async def aclose(self):
        pass


def _play(tokenizer, client, **settings):
    env = EchoEnv()
    sample = asyncio.run(run_trajectory(env, {}, renderer=Renderer(tokenizer, True), client=client,
                                        settings=LoopSettings(max_turns=1, **settings), trajectory_id="t",
                                        group_id=0, seed=0))
    return sample, env


def test_stop_token_ids_end_a_turn_and_the_context_cap_bounds_prompt_plus_response(tokenizer):
    sample, env = _play(tokenizer, StopClient(), max_response_len=50, sampling_params={"stop_token_ids": [9]})
    assert sample.response_tokens == [3, 4, 9] and str(env.last) == tokenizer.decode([3, 4])  # the stop id not in it
    prompt = len(sample.prompt_tokens)
    client = StopClient()
    sample, _ = _play(tokenizer, client, max_response_len=50, sampling_params={}, max_context_len=prompt + 4)
    assert client.params[0]["max_new_tokens"] == 4 and len(sample.tokens) == prompt + 4
    assert sample.status == SampleStatus.TRUNCATED and sample.metadata["truncation"] == "max_context_len"
    sample, _ = _play(tokenizer, StopClient(), max_response_len=50, sampling_params={}, max_context_len=prompt)
    assert sample.response_length == 0 and not sample.trainable  # the prompt fills it: nothing to train
    assert sample.metadata["truncation"] == "max_context_len"
    # the run's flags reach the loop's settings and slime's hooks
    cfg, _ = parse_config(["--rollout-stop-token-ids", "9", "--rollout-max-context-len", "64"])
    args = slime_args(cfg, engine_url="http://127.0.0.1:1", model_path="/m")
    assert args.rollout_stop_token_ids == [9] and args.rollout_max_context_len == 64
    assert json.loads(json.dumps(cfg.rollout.rollout_stop_token_ids)) == [9]


TIS = """
import torch

def truncated(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths):
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weights = ratio.clamp(max=args.tis_upper_bound)
    return pg_loss * weights, loss_masks, {"ratio": ratio}

def reject_first(args, *, pg_loss, loss_masks, **kw):
    masks = [m.clone() for m in loss_masks]
    masks[0] = torch.zeros_like(masks[0])  # the first sequence rejected
    return pg_loss, masks, {}
"""


def test_a_custom_tis_function_gives_the_importance_weights(tmp_path):
    (tmp_path / "tis.py").write_text(TIS)
    (tmp_path / "mis.yaml").write_text("use_tis: true\ntis_upper_bound: 1.1\n")
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -0.3], [-0.7, -1.2, -2.5, -0.1]])
    rollout = old + torch.tensor([[-0.3, 0.05, 0.0, -0.02], [0.2, 0.0, -0.04, 0.0]])
    kw = dict(old_logprobs=old, advantages=torch.tensor([[1.0] * 4, [-0.5] * 4]), mask=mask, denom=5.0,
              rollout_logprobs=rollout)

    def loss(algo, logprobs, **extra):
        lp = logprobs.clone().requires_grad_()
        value, stats = policy_objective(algo, logprobs=lp, **{**kw, **extra})
        value.backward()
        return value.item(), lp.grad, stats

    custom = AlgoConfig(use_tis=True, custom_tis_function_path=f"{tmp_path / 'tis.py'}:truncated",
                        custom_config_path=str(tmp_path / "mis.yaml"))
    builtin = AlgoConfig(use_tis=True, tis_mode="truncate", tis_clip=1.1)
    logprobs = old + 0.01
    (v1, g1, s1), (v2, g2, _) = loss(custom, logprobs), loss(builtin, logprobs)
    assert v1 == pytest.approx(v2) and torch.allclose(g1, g2)  # the same truncation, computed by the function
    ratio = torch.exp(old - rollout)
    assert s1["tis/ratio"].item() == pytest.approx((ratio * mask).sum().item() / 5, rel=1e-5)
    packed = {"seq_ids": torch.tensor([0, 0, 0, 1, 1]), "mask": torch.ones(5), "denom": 5.0}  # the trained tokens, packed
    pick = mask.bool()
    v3, _, _ = loss(custom, logprobs[pick], old_logprobs=old[pick], rollout_logprobs=rollout[pick],
                    advantages=kw["advantages"][pick], **packed)
    assert v3 == pytest.approx(v1)  # the Megatron trainer's packed layout: the same sequences, the same loss
    reject = custom.model_copy(update={"custom_tis_function_path": f"{tmp_path / 'tis.py'}:reject_first"})
    _, grad, _ = loss(reject, logprobs)
    assert grad[0].abs().sum() == 0 and grad[1].abs().sum() > 0  # a rejected sequence leaves the loss

    argv = ["--custom-config-path", str(tmp_path / "mis.yaml"), "--custom-tis-function-path",
            f"{tmp_path / 'tis.py'}:truncated", "--num-rollout", "2"]
    assert parse_config(argv)[0].algo.custom_tis_function_path.endswith("tis.py:truncated")
    with pytest.raises(ConfigError, match="--custom-tis-function-path computes the --use-tis importance weights"):
        parse_config(argv[2:])
    with pytest.raises(ConfigError, match="--custom-tis-function-path .*tis.py:nope"):
        parse_config(["--use-tis", "--custom-tis-function-path", f"{tmp_path / 'tis.py'}:nope"])


def _eval_config(tmp_path, extra=""):
    for name in ("aime", "gpqa"):
        rows = [{"prompt": f"{name} q{i}", "label": str(i)} for i in range(2)]
        rows[0]["metadata"] = {"rm_type": "math"}  # a row's own rm_type wins over its set's
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "multi_task.yaml"  # the shape of slime's examples/eval_multi_task/multi_task.yaml
    path.write_text(f"""eval:
  defaults:
    max_response_len: 24
    top_p: 0.7
  datasets:
    - name: aime
      path: {tmp_path / 'aime.jsonl'}
      rm_type: deepscaler
      n_samples_per_eval_prompt: 4
    - name: gpqa
      path: {tmp_path / 'gpqa.jsonl'}
      rm_type: gpqa
      n_samples_per_eval_prompt: 2
{extra}""")
    return path


def test_a_missing_eval_config_dataset_is_named_among_the_start_up_checks(tmp_path):
    """train's start-up checks (before Ray) name an --eval-config dataset whose file is missing, as
    load_eval_sets would beside Ray's start."""
    import re

    from agentrl.build import check_data_files
    from agentrl.errors import DatasetError

    path = _eval_config(tmp_path)
    cfg, _ = parse_config(["--eval-config", str(path), "--rm-type", "deepscaler"])
    check_data_files(cfg)  # both files there
    (tmp_path / "gpqa.jsonl").unlink()
    with pytest.raises(DatasetError, match=re.escape(f"--eval-config {path}: dataset 'gpqa': {tmp_path / 'gpqa.jsonl'}: "
                                                     "no such file")):
        check_data_files(cfg)


def test_eval_config_gives_the_eval_sets_with_their_own_settings(tmp_path):
    from agentrl.build import load_eval_sets
    from agentrl.evaluation import evaluate

    path = _eval_config(tmp_path)
    base = ["--rm-type", "deepscaler", "--rollout-top-p", "0.7", "--eval-interval", "2", "--num-rollout", "2"]
    cfg, _ = parse_config(["--eval-config", str(path), *base])
    assert cfg.eval.eval_prompt_data == ["aime", str(tmp_path / "aime.jsonl"), "gpqa", str(tmp_path / "gpqa.jsonl")]
    assert cfg.eval.eval_max_response_len == 24
    sets = load_eval_sets(cfg)
    assert [(name, n) for name, _, n in sets] == [("aime", 4), ("gpqa", 2)]
    assert [t["metadata"]["rm_type"] for t in sets[1][1]] == ["math", "gpqa"]

    class Runner:  # the group runner's face: how many samples each set's groups get
        n_samples = 1

        async def run_group(self, task, group_id):
            return [Sample(prompt_tokens=[1], reward=1.0) for _ in range(self.n_samples)]

    out = asyncio.run(evaluate(Runner(), sets))
    assert "eval/aime/pass@4" in out and "eval/gpqa/pass@2" in out

    assert parse_config(["--eval-config", str(path), "--rm-type", "deepscaler"])[0].eval.eval_top_p == 0.7
    with pytest.raises(ConfigError, match="a dataset's rm_type is read by rm_hub's reward .*add --rm-type"):
        parse_config(["--eval-config", str(path), "--rollout-top-p", "0.7"])
    bad = _eval_config(tmp_path, "      min_new_tokens: 3\n")
    with pytest.raises(ConfigError, match="dataset 'gpqa': min_new_tokens not supported per eval set"):
        parse_config(["--eval-config", str(bad), *base])
    bad = _eval_config(tmp_path, "      temperature: 0.5\n")
    with pytest.raises(ConfigError, match="temperature differs between datasets"):
        parse_config(["--eval-config", str(bad), *base])
