"""slime's on-policy-distillation script (examples/on_policy_distillation/run-qwen3-8B-opd.sh) runs
with slime's meaning (issue 33): its teacher is an SGLang server at --rm-url, asked by slime's
reward function (slime.rollout.on_policy_distillation.reward_func) whose reply slime's post-process
hook turns into teacher logprobs (task reward 0); the loss subtracts --opd-kl-coef x (student -
teacher logprob) from each token's advantage. agentrl runs it as its served teacher
(--opd-teacher-url = --rm-url's server): the same logprobs, the same advantages."""

import asyncio
import sys
from types import SimpleNamespace

import pytest

from slime_scripts import OTHER_SCRIPTS, checked_in, script_args, slime_checkout
from test_slime_scripts import localize

from agentrl.algorithms import compute_advantages
from agentrl.cli import dry_run_checks
from agentrl.config import parse_config
from agentrl.errors import ConfigError
from agentrl.slime_args import NO_TASK_REWARD, SLIME_OPD_POST_PROCESS, SLIME_OPD_REWARD
from agentrl.types import Sample


@pytest.fixture(scope="module")
def slime(tmp_path_factory):
    return slime_checkout(tmp_path_factory.mktemp("slime"))


def test_the_checked_in_opd_arguments_are_slimes(slime):
    if slime is None:
        pytest.skip("no slime checkout (AGENTRL_SLIME_SRC or the git mirror)")
    assert script_args(slime, OTHER_SCRIPTS["opd"]) == checked_in("opd"), \
        "refresh tests/data/slime_scripts: python tests/slime_scripts.py SLIME_DIR"


def test_slimes_opd_script_runs_as_agentrls_served_teacher(tmp_path):
    args = localize(checked_in("opd"), tmp_path, "opd")
    cfg, ns = parse_config(args)
    a = cfg.algo
    assert (cfg.train.trainer, cfg.rollout.rollout_engine, cfg.model.dtype) == ("megatron", "sglang", "bfloat16")
    assert (a.use_opd, a.opd_type, a.opd_kl_coef, a.advantage_estimator) == (True, "sglang", 1.0, "grpo")
    # the script's TEACHER_IP/TEACHER_PORT, as bash expands them: the server agentrl's teacher asks
    assert a.opd_teacher_url == "http://127.0.0.1:13141" and a.opd_teacher_load is None
    assert a.custom_rm_path == NO_TASK_REWARD and a.custom_reward_post_process_path is None
    assert any(n.startswith(f"--custom-rm-path {SLIME_OPD_REWARD} with its post-process hook") for n in ns.slime_notices)
    dry_run_checks(cfg)  # the reward hook imports with slime's signature; no slime needed on sys.path


def test_slimes_opd_flags_that_cannot_mean_slimes_run_are_refused(tmp_path):
    args = localize(checked_in("opd"), tmp_path, "opd")

    def without(*flags):
        out, skip = [], False
        for word in args:
            skip = word in flags or (skip and not word.startswith("--"))
            if not skip:
                out.append(word)
        return out

    for argv, message in (
            (without("--custom-reward-post-process-path"), "which slime turns into teacher logprobs with "
                                                          "--custom-reward-post-process-path"),
            (without("--use-opd", "--opd-type", "--opd-kl-coef"), "is for --use-opd --opd-type sglang"),
            (without("--rm-url"), "asks the teacher at --rm-url, SGLang's /generate"),
            (args + ["--opd-teacher-url", "http://other:1"], "drop --opd-teacher-url http://other:1"),
            (without("--custom-rm-path") + ["--rm-type", "math"],
             f"{SLIME_OPD_POST_PROCESS} reads the teacher's reply")):
        with pytest.raises(ConfigError, match=message):
            parse_config(argv)


def _teacher_logprob(position: int, token: int) -> float:
    return -0.1 * position - 0.001 * token


async def _fake_sglang(request):
    """SGLang's /generate with max_new_tokens 0: input_token_logprobs from logprob_start_len on,
    [logprob, token id, None], the first entry's logprob always None (SGLang's scheduler pads it)."""
    from aiohttp import web

    body = await request.json()
    assert body["sampling_params"]["max_new_tokens"] == 0 and body["return_logprob"]
    ids, start = body["input_ids"], body.get("logprob_start_len", 0)
    return web.json_response({"meta_info": {"input_token_logprobs": [
        [None if p == start else _teacher_logprob(p, t), t, None] for p, t in enumerate(ids) if p >= start]}})


def test_slimes_opd_functions_and_agentrls_served_teacher_give_the_same_advantages(slime, tmp_path, monkeypatch):
    """On one teacher server: slime's reward_func + post_process_rewards (run as slime runs them)
    and agentrl's served teacher give the same teacher logprobs, and the mapped run's advantages are
    slime's apply_opd_kl_to_advantages on a 0 reward: -opd_kl_coef x (student - teacher)."""
    if slime is None:
        pytest.skip("no slime checkout (AGENTRL_SLIME_SRC or the git mirror)")
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from agentrl.teacher import teacher_logprobs

    monkeypatch.syspath_prepend(str(slime))
    for name in [m for m in sys.modules if m.split(".")[0] == "slime"]:
        monkeypatch.delitem(sys.modules, name)
    from slime.rollout.on_policy_distillation import post_process_rewards, reward_func

    prompts, responses = [[11, 12, 13], [21, 22]], [[31, 32, 33, 34], [41, 42]]
    samples = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        s = Sample(prompt_tokens=p, group_id=0, reward=0.0, trajectory_id=f"t{i}")
        s.append_generated(r, [-0.5 - 0.1 * k for k in range(len(r))], 0)
        samples.append(s)

    async def main():
        app = web.Application()
        app.router.add_post("/generate", _fake_sglang)
        server = TestServer(app)
        await server.start_server()
        try:
            base = str(server.make_url("")).rstrip("/")
            slime_args = SimpleNamespace(rollout_temperature=1.0, rm_url=f"{base}/generate")
            slime_samples = [SimpleNamespace(tokens=p + r, response_length=len(r), multimodal_inputs=None)
                             for p, r in zip(prompts, responses)]
            replies = [await reward_func(slime_args, s) for s in slime_samples]
            for s, reply in zip(slime_samples, replies):
                s.get_reward_value = lambda args, reply=reply: reply
            raw, rewards = post_process_rewards(slime_args, slime_samples)
            ours = await teacher_logprobs(base, samples)
            return [s.teacher_log_probs.tolist() for s in slime_samples], rewards, ours, base
        finally:
            await server.close()

    slime_teacher, slime_rewards, ours, base = asyncio.run(main())
    assert slime_rewards == [0.0, 0.0]
    assert [len(x) for x in ours] == [4, 2]
    for got, want in zip(ours, slime_teacher):
        assert got == pytest.approx(want, abs=1e-6)
    assert ours[0] == pytest.approx([_teacher_logprob(3 + k, t) for k, t in enumerate(responses[0])], abs=1e-6)

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg, _ = parse_config(["--hf-checkpoint", str(model), "--advantage-estimator", "grpo", "--use-opd",
                           "--opd-type", "sglang", "--opd-kl-coef", "0.5", "--custom-rm-path", SLIME_OPD_REWARD,
                           "--custom-reward-post-process-path", SLIME_OPD_POST_PROCESS,
                           "--rm-url", f"{base}/generate", "--n-samples-per-prompt", "2"])
    assert cfg.algo.opd_teacher_url == base
    old = [list(s.rollout_logprobs) for s in samples]
    adv = compute_advantages(samples, cfg.algo, old_logprobs=old, teacher_logprobs=ours).advantages
    want = [[0.0 - 0.5 * (o - t) for o, t in zip(o_, t_)] for o_, t_ in zip(old, slime_teacher)]
    for got, w in zip(adv, want, strict=True):
        assert got == pytest.approx(w, abs=1e-6)
