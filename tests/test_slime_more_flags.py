"""slime's --disable-rewards-normalization, --normalize-advantages, --use-unbiased-kl and the cispo
estimator: each one's numbers against slime's formulas written out here, and the combinations that
cannot work refused when the config is parsed."""

import math

import pytest
import torch

from agentrl.algorithms import compute_advantages, policy_objective
from agentrl.config import AlgoConfig, parse_config
from agentrl.errors import ConfigError
from agentrl.types import Sample, SampleStatus


def _sample(reward, mask, group=0):
    s = Sample(prompt_tokens=[1, 2], group_id=group, reward=reward, status=SampleStatus.COMPLETED)
    for m in mask:  # 1: a token the policy sampled, 0: an env token (context, not trained)
        if m:
            s.append_generated([5], [-1.0], 0)
        else:
            s.append_observation([6])
    return s


def test_disable_rewards_normalization_gives_the_raw_rewards():
    samples = [_sample(r, [1, 1]) for r in (1.0, 0.0, 0.0, 0.5)]
    normalised = compute_advantages(samples, AlgoConfig(advantage_estimator="grpo")).advantages
    assert normalised[0][0] != pytest.approx(1.0)
    for est in ("grpo", "dr_grpo", "gspo", "cispo", "rloo"):
        adv = compute_advantages(samples, AlgoConfig(advantage_estimator=est, disable_rewards_normalization=True))
        assert [a[0] for a in adv.advantages] == [1.0, 0.0, 0.0, 0.5], est
    # reinforce_plus_plus_baseline: the raw reward is the final reward (no group mean), then whitened
    two = [_sample(1.0, [1], 0), _sample(0.0, [1], 0), _sample(1.0, [1], 1), _sample(1.0, [1], 1)]
    base = dict(advantage_estimator="reinforce_plus_plus_baseline")
    raw, plain_rpp, centred = ([a[0] for a in compute_advantages(two, algo).advantages] for algo in (
        AlgoConfig(**base, disable_rewards_normalization=True), AlgoConfig(advantage_estimator="reinforce_plus_plus"),
        AlgoConfig(**base)))
    assert raw == pytest.approx(plain_rpp)
    assert raw[1] < raw[0] == pytest.approx(raw[2])  # the rewards 1, 0, 1, 1 whitened
    assert centred[2] != pytest.approx(centred[0])  # centred, group 1's samples sit at the group mean
    # a failed sample gives and gets nothing either way
    failed = _sample(9.0, [1, 1])
    failed.status = SampleStatus.FAILED
    adv = compute_advantages([*samples, failed], AlgoConfig(disable_rewards_normalization=True)).advantages
    assert adv[-1] == [0.0, 0.0]


def test_normalize_advantages_whitens_over_the_trained_tokens():
    # dr_grpo advantages 0.75, -0.25, -0.25, -0.25 on 3, 1, 2 and 1 trained tokens (env tokens between)
    samples = [_sample(1.0, [1, 0, 1, 1]), _sample(0.0, [1]), _sample(0.0, [1, 0, 1]), _sample(0.0, [0, 1])]
    algo = AlgoConfig(advantage_estimator="dr_grpo", normalize_advantages=True)
    adv = compute_advantages(samples, algo).advantages
    trained = [a for s, row in zip(samples, adv) for a, m in zip(row, s.loss_mask) if m]
    plain = [0.75] * 3 + [-0.25] * 4
    mean = sum(plain) / 7
    var = sum((x - mean) ** 2 for x in plain) / 6  # slime: Bessel-corrected, eps inside the root
    assert trained == pytest.approx([(x - mean) / math.sqrt(var + 1e-8) for x in plain])
    assert adv[0][1] == 0.0 and adv[3][0] == 0.0  # env tokens stay untrained
    assert compute_advantages(samples, AlgoConfig(advantage_estimator="dr_grpo")).advantages[0][0] == 0.75
    # after OPD's per-token term, as slime orders them
    teacher = [[-2.0] * s.response_length for s in samples]
    old = [[-1.0] * s.response_length for s in samples]
    opd = dict(advantage_estimator="dr_grpo", use_opd=True, opd_kl_coef=1.0, opd_teacher_load="/t")
    with_opd = compute_advantages(samples, AlgoConfig(**opd, normalize_advantages=True), old_logprobs=old,
                                  teacher_logprobs=teacher).advantages
    assert with_opd[0][0] == pytest.approx(adv[0][0])  # a constant -1 everywhere is removed by the whitening
    assert compute_advantages(samples, AlgoConfig(**opd), old_logprobs=old,
                              teacher_logprobs=teacher).advantages[0][0] == pytest.approx(-0.25)


def make_samples():
    """Six trajectories of random tokens (policy, env, policy), two groups, rewards 0/1."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(6):
        s = Sample(prompt_tokens=torch.randint(3, 500, (5 + i,), generator=g).tolist(), group_id=i // 3,
                   reward=float(i % 2), trajectory_id=f"t{i}")
        s.append_generated(torch.randint(3, 500, (4,), generator=g).tolist(), [-6.0] * 4, 0)
        s.append_observation(torch.randint(3, 500, (3,), generator=g).tolist())
        s.append_generated(torch.randint(3, 500, (2 + i,), generator=g).tolist(), [-6.0] * (2 + i), 0)
        out.append(s)
    return out


MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_cispo_weights_minus_advantage_times_logprob_by_the_clipped_detached_ratio():
    samples = [_sample(r, [1]) for r in (1.0, 0.0, 0.0, 1.0)]
    grpo = compute_advantages(samples, AlgoConfig(advantage_estimator="grpo")).advantages
    assert compute_advantages(samples, AlgoConfig(advantage_estimator="cispo")).advantages == grpo

    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    lp = torch.tensor([[-1.0, -0.5, -1.6, -1.0]], requires_grad=True)  # ratios 1, e^0.5 = 1.65, e^-0.6 = 0.55
    adv = torch.tensor([[1.0, 1.0, -1.0, 5.0]])
    algo = AlgoConfig(advantage_estimator="cispo", eps_clip=0.2, eps_clip_high=0.28)
    loss, stats = policy_objective(algo, logprobs=lp, old_logprobs=old, advantages=adv, mask=MASK, denom=3.0)
    w = torch.tensor([1.0, 1.28, 0.8])
    expected = -(w * adv[0, :3] * lp[0, :3].detach()).sum() / 3
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)
    loss.backward()
    # the gradient flows through the logprob with the clipped ratio as its weight, clipped tokens included
    assert lp.grad[0].tolist() == pytest.approx([-1 / 3, -1.28 / 3, 0.8 / 3, 0.0])
    lp.grad = None
    ppo, _ = policy_objective(AlgoConfig(eps_clip=0.2, eps_clip_high=0.28), logprobs=lp, old_logprobs=old,
                              advantages=adv, mask=MASK, denom=3.0)
    ppo.backward()
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[0, 2].item() == 0.0  # PPO's clip drops them: the difference


def test_unbiased_kl_weights_each_tokens_kl_by_pi_over_pi_old():
    old = torch.tensor([[-1.0, -1.0, -2.0, -1.0]])
    ref = torch.tensor([[-1.5, -0.7, -2.0, -1.0]])
    lp = torch.tensor([[-0.8, -1.1, -2.3, -1.0]], requires_grad=True)
    adv = torch.zeros(1, 4)
    base = dict(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k3")
    _, plain = policy_objective(AlgoConfig(**base), logprobs=lp, old_logprobs=old, advantages=adv, mask=MASK,
                                denom=3.0, ref_logprobs=ref)
    loss, stats = policy_objective(AlgoConfig(**base, use_unbiased_kl=True), logprobs=lp, old_logprobs=old,
                                   advantages=adv, mask=MASK, denom=3.0, ref_logprobs=ref)
    d = (lp - ref).detach()[0, :3]
    k3 = torch.exp(-d) - 1 + d
    ratio = torch.exp(lp.detach() - old)[0, :3]
    assert plain["kl_loss"].item() == pytest.approx((k3.sum() / 3).item(), rel=1e-6)
    assert stats["kl_loss"].item() == pytest.approx(((ratio * k3).sum() / 3).item(), rel=1e-6)
    loss.backward()  # the ratio carries gradient too (slime's is not detached): d/dlp [r * k3] = r * k3 + r * k3'
    grad = (ratio * k3 + ratio * (1 - torch.exp(-d))) / 3
    assert lp.grad[0, :3].tolist() == pytest.approx(grad.tolist(), rel=1e-5)


def test_the_flags_parse_and_bad_combinations_are_refused():
    cfg, _ = parse_config(["--advantage-estimator", "cispo", "--normalize-advantages", "--disable-rewards-normalization",
                           "--use-kl-loss", "--kl-loss-coef", "0.01", "--use-unbiased-kl", "--eps-clip", "1",
                           "--eps-clip-high", "4"])
    a = cfg.algo
    assert (a.advantage_estimator, a.normalize_advantages, a.disable_rewards_normalization, a.use_unbiased_kl) == \
        ("cispo", True, True, True)
    with pytest.raises(ConfigError, match="--use-unbiased-kl .* --use-kl-loss"):
        parse_config(["--use-unbiased-kl"])
    with pytest.raises(ConfigError, match="--use-unbiased-kl"):
        parse_config(["--use-unbiased-kl", "--use-kl-loss"])  # a KL loss of weight 0
    with pytest.raises(ConfigError, match="--disable-rewards-normalization .* ppo has none"):
        parse_config(["--disable-rewards-normalization", "--advantage-estimator", "ppo"])
    with pytest.raises(ConfigError, match="--disable-rewards-normalization: --custom-reward-post-process-path"):
        parse_config(["--disable-rewards-normalization", "--custom-reward-post-process-path", "m:f"])
    with pytest.raises(ConfigError, match="--dual-clip-c"):
        parse_config(["--advantage-estimator", "cispo", "--dual-clip-c", "3"])


def test_ref_update_interval_makes_the_policy_the_reference_every_n_rollouts(tiny_model, tmp_path):
    from agentrl.config import TrainConfig
    from agentrl.trainers.torch_trainer import TorchTrainer

    train = TrainConfig(lr=1e-2, global_batch_size=6, micro_batch_size=6)
    kl = dict(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3")

    def run(algo, n):
        trainer = TorchTrainer(str(tiny_model), train=train, algo=algo, temperature=1.0)
        return trainer, [trainer.train_rollout(make_samples()) for _ in range(n)]

    _, fixed = run(AlgoConfig(**kl), 3)
    trainer, moving = run(AlgoConfig(**kl, ref_update_interval=2), 3)
    assert [m["ref_updated"] for m in moving] == [0.0, 1.0, 0.0]
    assert moving[1]["kl_loss"] == pytest.approx(fixed[1]["kl_loss"]) and fixed[1]["kl_loss"] > 1e-6
    # rollout 3 trains from the policy that became the reference after rollout 2: no KL left; without it, some
    assert abs(moving[2]["kl_loss"]) < 1e-9 < fixed[2]["kl_loss"]

    # a resumed run counts from the checkpoint's rollout id, as slime's (rollout_id + 1) % N
    trainer.save(tmp_path / "ckpt", {"rollout_id": 3})
    resumed = TorchTrainer(str(tiny_model), train=train, algo=AlgoConfig(**kl, ref_update_interval=2), temperature=1.0)
    resumed.load(tmp_path / "ckpt")
    assert resumed.train_rollout(make_samples())["ref_updated"] == 1.0

    # LoRA: the reference takes the merged weights
    lora = TorchTrainer(str(tiny_model), train=TrainConfig(lr=1e-2, global_batch_size=6, micro_batch_size=6,
                                                           lora_rank=4), algo=AlgoConfig(**kl), temperature=1.0)
    lora.train_rollout(make_samples())
    lora.train_rollout(make_samples())  # the adapters' B moves off 0 after the first step: a nonzero delta now
    lora.update_reference()
    merged = dict(lora.named_tensors())
    ref = dict(lora.ref_model.named_parameters())
    assert all(torch.equal(ref[name], t) for name, t in merged.items())
    assert any(not torch.equal(t, p) for (name, t), p in
               zip(merged.items(), [dict(lora._base_tensors())[n] for n in merged]))


def test_ref_update_interval_needs_a_reference():
    with pytest.raises(ConfigError, match="--ref-update-interval 2 refreshes the KL reference, and none is in use"):
        parse_config(["--ref-update-interval", "2"])
    cfg, _ = parse_config(["--ref-update-interval", "2", "--use-kl-loss", "--kl-loss-coef", "0.1"])
    assert cfg.algo.ref_update_interval == 2


def test_ref_update_interval_in_the_megatron_trainer(tiny_model):
    """The same refresh in the Megatron trainer (CPU, gloo: tests/trainers/megatron_cpu_shim.py);
    with --lora-rank it is refused, naming why."""
    import sys
    from pathlib import Path

    megatron_trainer = pytest.importorskip("agentrl.trainers.megatron.trainer")
    sys.path.insert(0, str(Path(__file__).parent / "trainers"))
    import megatron_cpu_shim

    from agentrl.config import TrainConfig

    megatron_cpu_shim.apply()
    train = TrainConfig(lr=1e-2, global_batch_size=6, micro_batch_size=6)
    algo = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3", ref_update_interval=2)
    trainer = megatron_trainer.MegatronTrainer(str(tiny_model), train=train, algo=algo, temperature=1.0,
                                               device="cpu", dtype="float32")
    out = [trainer.train_rollout(make_samples()) for _ in range(3)]
    assert [m["ref_updated"] for m in out] == [0.0, 1.0, 0.0]
    assert out[1]["kl_loss"] > 1e-6 and abs(out[2]["kl_loss"]) < 1e-9
    with pytest.raises(ConfigError, match="--ref-update-interval with --lora-rank"):
        megatron_trainer.MegatronTrainer(str(tiny_model), train=TrainConfig(lr=1e-2, global_batch_size=6, lora_rank=4),
                                         algo=algo, temperature=1.0, device="cpu", dtype="float32")


THINKING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
                     "<think></think>{% endif %}{% endif %}")


def test_apply_chat_template_kwargs_reach_every_rendering(tiny_model):
    from agentrl.models import load_tokenizer
    from agentrl.rollout.agent_loop import Renderer

    tokenizer = load_tokenizer(tiny_model)
    tokenizer.chat_template = THINKING_TEMPLATE
    cfg, _ = parse_config(["--apply-chat-template-kwargs", '{"enable_thinking": false}'])
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    plain, off = Renderer(tokenizer), Renderer(tokenizer, True, cfg.data.apply_chat_template_kwargs)
    turns = [{"role": "user", "content": "hi"}]
    assert plain.render(turns, None) == "<user>hi<assistant>"
    assert off.render(turns, None) == "<user>hi<assistant><think></think>"
    # a message the direct path does not take (a None value) goes through tokenizer.apply_chat_template: the same
    odd = [{"role": "user", "content": "hi", "name": None}]
    assert off.render(odd, None) == "<user>hi<assistant><think></think>"
    assert off.prompt(turns, None)[1] == tokenizer.encode("<user>hi<assistant><think></think>", add_special_tokens=False)

    with pytest.raises(ConfigError, match="--apply-chat-template-kwargs: the chat template is off"):
        parse_config(["--apply-chat-template-kwargs", '{"enable_thinking": false}', "--no-apply-chat-template"])
    with pytest.raises(ConfigError, match="add_generation_prompt set by agentrl's renderer"):
        parse_config(["--apply-chat-template-kwargs", '{"add_generation_prompt": false}'])
    with pytest.raises(SystemExit):  # argparse: not a JSON object
        parse_config(["--apply-chat-template-kwargs", "[1]"])


class SpecialClient:
    """Each turn: two plain tokens, <|im_start|> (special, not a stop), a plain one, then the length limit."""

    async def generate(self, input_ids, sampling_params, **kw):
        from agentrl.rollout.client import GenerateResult

        ids = [3, 4, 1, 5][:sampling_params["max_new_tokens"]]
        return GenerateResult(ids, [-0.5] * len(ids), "length", len(input_ids), 0, "0")


class RecordingEnv:
    max_turns, stop = 2, None

    def __init__(self):
        self.actions = []

    async def areset(self, seed=None, options=None):
        return [{"role": "user", "content": "go"}], {}

    async def astep(self, action):
        self.actions.append(str(action))
        return [{"role": "user", "content": "more"}], 0.0, False, False, {}

    async def aclose(self):
        pass


def test_rollout_skip_special_tokens_gives_the_env_text_without_them(tokenizer):
    import asyncio

    from agentrl.rollout.agent_loop import LoopSettings, Renderer, run_trajectory
    from agentrl.rollout.slime import slime_args

    def play(skip):
        env = RecordingEnv()
        sample = asyncio.run(run_trajectory(
            env, {}, renderer=Renderer(tokenizer, True), client=SpecialClient(), trajectory_id="t", group_id=0, seed=0,
            settings=LoopSettings(max_response_len=40, max_turns=2, sampling_params={}, max_tokens_per_turn=4,
                                  skip_special_tokens=skip)))
        return sample, env

    kept, env_kept = play(False)
    skipped, env_skipped = play(True)
    assert env_kept.actions == [tokenizer.decode([3, 4, 1, 5])] * 2 and "<|im_start|>" in env_kept.actions[0]
    assert env_skipped.actions == [tokenizer.decode([3, 4, 5])] * 2  # both turns: no template drift in between
    # what trains and what the template rendered are the same either way
    assert skipped.tokens == kept.tokens and skipped.loss_mask == kept.loss_mask
    cfg, _ = parse_config(["--rollout-skip-special-tokens"])
    assert cfg.rollout.rollout_skip_special_tokens
    args = slime_args(cfg, engine_url="http://127.0.0.1:1", model_path="/m")
    assert args.rollout_skip_special_tokens  # slime's hooks ask SGLang for it (slime_sampling_params)


def test_rollout_max_prompt_len_leaves_long_prompts_out_at_load(tiny_model, tmp_path):
    import json

    from agentrl.build import build_prompt_source
    from agentrl.models import load_tokenizer
    from agentrl.rollout.agent_loop import Renderer

    rows = [{"prompt": "hi", "label": "1"}, {"prompt": "word " * 60, "label": "2"},
            {"prompt": [{"role": "user", "content": "a short one"}], "label": "3"}]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    renderer = Renderer(load_tokenizer(tiny_model))
    lengths = [len(renderer.prompt([{"role": "user", "content": r["prompt"]}] if isinstance(r["prompt"], str)
                                   else r["prompt"], None)[1]) for r in rows]
    limit = max(lengths[0], lengths[2])
    assert lengths[1] > limit  # the long one is over the limit, the others at or under it

    def labels(*flags):
        cfg, _ = parse_config(["--model", str(tiny_model), "--prompt-data", str(data), "--no-rollout-shuffle", *flags])
        return sorted(t["label"] for t in build_prompt_source(cfg, None).tasks)

    assert labels() == ["1", "2", "3"]
    assert labels("--rollout-max-prompt-len", str(limit)) == ["1", "3"]
    assert labels("--rollout-max-prompt-len", str(limit - 1)) == sorted(
        r["label"] for r, n in zip(rows, lengths) if n <= limit - 1)
    with pytest.raises(ConfigError, match="every one of the 3 prompts"):
        labels("--rollout-max-prompt-len", "1")
    with pytest.raises(ConfigError, match="must be below --rollout-max-context-len"):
        labels("--rollout-max-prompt-len", "64", "--rollout-max-context-len", "64")
    with pytest.raises(ConfigError, match="without --prompt-data"):
        parse_config(["--rollout-max-prompt-len", "64"])


def test_no_save_optim_checkpoints_hold_no_optimizer_state(tiny_model, tmp_path):
    from agentrl.config import TrainConfig
    from agentrl.trainers.torch_trainer import TorchTrainer

    def trainer(no_save_optim):
        train = TrainConfig(lr=1e-2, global_batch_size=6, micro_batch_size=6, no_save_optim=no_save_optim)
        return TorchTrainer(str(tiny_model), train=train, algo=AlgoConfig(), temperature=1.0)

    full, light = trainer(False), trainer(True)
    for t, folder in ((full, "full"), (light, "light")):
        t.train_rollout(make_samples())
        t.save(tmp_path / folder, {"rollout_id": 1})
    assert (tmp_path / "full" / "optimizer.pt").exists() and not (tmp_path / "light" / "optimizer.pt").exists()
    resumed = trainer(True)
    resumed.load(tmp_path / "light")  # the weights come back, the optimizer starts afresh (slime's --no-load-optim)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(resumed.named_tensors(), light.named_tensors()))
    assert not resumed.optimizer.state
    with pytest.raises(ConfigError, match="saved with --no-save-optim"):
        trainer(False).load(tmp_path / "light")
    exact = trainer(False)
    exact.load(tmp_path / "full")
    assert exact.optimizer.state  # without the flag a full checkpoint resumes Adam's moments


@pytest.mark.slow
def test_no_save_optim_in_the_megatron_trainer(tiny_model, tmp_path):
    import sys
    from pathlib import Path

    megatron_trainer = pytest.importorskip("agentrl.trainers.megatron.trainer")
    sys.path.insert(0, str(Path(__file__).parent / "trainers"))
    import megatron_cpu_shim
    from megatron.core import dist_checkpointing

    from agentrl.config import TrainConfig

    megatron_cpu_shim.apply()

    def trainer(no_save_optim):
        train = TrainConfig(lr=1e-2, global_batch_size=6, micro_batch_size=6, no_save_optim=no_save_optim)
        return megatron_trainer.MegatronTrainer(str(tiny_model), train=train, algo=AlgoConfig(), temperature=1.0,
                                                device="cpu", dtype="float32")

    light = trainer(True)
    light.train_rollout(make_samples())
    light.save(tmp_path / "light", {"rollout_id": 1})
    keys = list(dist_checkpointing.load_tensors_metadata(str(tmp_path / "light" / "megatron")))
    assert keys and not [k for k in keys if k.startswith("optimizer.")]
    resumed = trainer(True)
    resumed.load(tmp_path / "light")
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(resumed.named_tensors(), light.named_tensors()))
    with pytest.raises(ConfigError, match="saved with --no-save-optim"):
        trainer(False).load(tmp_path / "light")
    full = trainer(False)
    full.train_rollout(make_samples())
    full.save(tmp_path / "full", {"rollout_id": 1})
    assert [k for k in dist_checkpointing.load_tensors_metadata(str(tmp_path / "full" / "megatron"))
            if k.startswith("optimizer.")]


@pytest.mark.e2e  # the lane: runs agentrl train end to end (docs/development.md, "Test lanes")
def test_start_rollout_id_is_the_first_iteration_of_the_run(tmp_path):
    import json
    import subprocess

    from spine_helpers import agentrl_cli, run_env

    proc = subprocess.run([agentrl_cli(), "train", "--num-rollout", "3", "--start-rollout-id", "2", "--output-dir",
                           str(tmp_path), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                           "--global-batch-size", "8", "--no-progress", "--advantage-estimator", "cispo",
                           "--normalize-advantages"], capture_output=True, text=True, timeout=600, env=run_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [2]  # slime's loop: range(start_rollout_id, num_rollout)
    state = json.loads((tmp_path / "checkpoints" / "iter_000003" / "trainer_state.json").read_text())
    assert state["rollout_id"] == 3 and state["version"] == 1
    with pytest.raises(ConfigError, match="--start-rollout-id 3: the run ends before it"):
        parse_config(["--num-rollout", "3", "--start-rollout-id", "3"])
