"""On-policy distillation (--use-opd): the student samples, the teacher (loaded beside it in the
trainer) scores the sampled tokens, and each token's advantage loses opd_kl_coef x (student
logprob - teacher logprob). With a constant reward that is distillation alone: the student's
exact KL to the teacher on held-out contexts falls."""

import asyncio
import shutil

import aiohttp
import pytest
import torch

from agentrl.algorithms import compute_advantages
from agentrl.config import AlgoConfig, TrainConfig, parse_config
from agentrl.errors import ConfigError
from agentrl.trainers.torch_trainer import TorchTrainer
from agentrl.types import Sample

RESPONSE = 6


@pytest.fixture(scope="module")
def teacher(tiny_model, tmp_path_factory):
    """The tiny model with its final norm's gain x4: every logit x4, a far sharper teacher."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("teacher")
    shutil.copytree(tiny_model, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        model.model.norm.weight.mul_(4)
    model.save_pretrained(out)
    return out


def sample_from(model, prompts: torch.Tensor, generator: torch.Generator) -> list[Sample]:
    """One response of RESPONSE tokens for each prompt row, sampled from `model` at temperature 1."""
    ids, lps = prompts, []
    with torch.no_grad():
        for _ in range(RESPONSE):
            logp = torch.log_softmax(model(ids).logits[:, -1].float(), -1)
            tok = torch.multinomial(logp.exp(), 1, generator=generator)
            lps.append(logp.gather(1, tok))
            ids = torch.cat([ids, tok], 1)
    lps = torch.cat(lps, 1)
    out = []
    for g in range(len(prompts)):
        s = Sample(prompt_tokens=prompts[g].tolist(), group_id=g, reward=0.0, trajectory_id=f"t{g}")
        s.append_generated(ids[g, prompts.shape[1]:].tolist(), lps[g].tolist(), 0)
        out.append(s)
    return out


def exact_kl(student, teacher_model, contexts: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Mean over the contexts' positions from `start` of KL(student || teacher), over the whole vocabulary."""
    ls = torch.log_softmax(student(contexts).logits.float(), -1)[:, start:]
    with torch.no_grad():
        lt = torch.log_softmax(teacher_model(contexts).logits.float(), -1)[:, start:]
    return (ls.exp() * (ls - lt)).sum(-1).mean()


def test_the_opd_step_follows_the_exact_reverse_kl_and_moves_the_student_toward_the_teacher(tiny_model, teacher):
    """The sampled, per-token OPD gradient (what the trainer computes from its advantages) points
    along the exact gradient of KL(student || teacher) on the same contexts, and a small step
    along it lowers the exact KL on held-out contexts. (A multi-step learning curve needs a real
    model: on this random tiny model Adam's steps are dominated by sampling noise.)"""
    torch.manual_seed(0)
    trainer = TorchTrainer(str(tiny_model), train=TrainConfig(lr=1e-9, global_batch_size=256, micro_batch_size=256),
                           algo=AlgoConfig(use_opd=True, opd_kl_coef=1.0, opd_teacher_load=str(teacher)),
                           temperature=1.0)
    trainer.optimizer.step = lambda: None  # keep the gradient, move nothing
    g = torch.Generator().manual_seed(0)
    samples = sample_from(trainer.model, torch.randint(3, 500, (256, 4), generator=g), g)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer.model.zero_grad()
    metrics = trainer.train_rollout(samples)
    sampled = [p.grad.detach().clone() for p in params]

    trainer.model.zero_grad()
    contexts = torch.tensor([s.prompt_tokens + s.response_tokens for s in samples])
    exact_kl(trainer.model, trainer.teacher_model, contexts[:, :-1], start=3).backward()  # the response positions
    exact = [p.grad.detach().clone() for p in params]
    cosine = float(torch.nn.functional.cosine_similarity(torch.cat([x.flatten() for x in sampled]),
                                                         torch.cat([x.flatten() for x in exact]), 0))

    held_out = torch.randint(3, 500, (8, 10), generator=g)
    with torch.no_grad():
        before = float(exact_kl(trainer.model, trainer.teacher_model, held_out))
        for p, grad in zip(params, sampled):
            p.sub_(1e-4 * grad.sign())  # Adam's first step
        after = float(exact_kl(trainer.model, trainer.teacher_model, held_out))
    print(f"sampled reverse KL {metrics['opd_reverse_kl']:.3f}; cosine to the exact gradient {cosine:.3f}; "
          f"held-out exact KL {before:.5f} -> {after:.5f}")
    assert cosine > 0.1
    assert after < before


def test_opd_term_is_the_per_token_reverse_kl_after_the_estimator():
    s = [Sample(prompt_tokens=[1], group_id=0, reward=r, trajectory_id=f"t{i}") for i, r in enumerate((1.0, 0.0))]
    for x in s:
        x.append_generated([5, 6], [-1.0, -2.0], 0)
        x.append_observation([7])
    old = [[-1.0, -2.0, 0.0], [-1.0, -2.0, 0.0]]
    teacher = [[-1.5, -1.0, -9.0], [-1.0, -4.0, -9.0]]
    algo = AlgoConfig(advantage_estimator="dr_grpo", use_opd=True, opd_kl_coef=0.5, opd_teacher_load="/t")
    adv = compute_advantages(s, algo, old_logprobs=old, teacher_logprobs=teacher).advantages
    # dr_grpo gives +-0.5 on policy tokens; then -0.5 x (old - teacher) per token; env token untouched
    assert adv == [[0.5 - 0.25, 0.5 + 0.5, 0.0], [-0.5, -0.5 - 1.0, 0.0]]
    with pytest.raises(ValueError, match="teacher"):
        compute_advantages(s, algo, old_logprobs=old)


def test_opd_flags_fail_fast(tmp_path):
    with pytest.raises(ConfigError, match="--opd-teacher-load"):
        parse_config(["--use-opd"])
    with pytest.raises(ConfigError, match="no such folder"):
        parse_config(["--use-opd", "--opd-teacher-load", str(tmp_path / "missing")])
    cfg, _ = parse_config(["--use-opd", "--opd-teacher-load", str(tmp_path), "--opd-kl-coef", "0.3"])
    assert cfg.algo.use_opd and cfg.algo.opd_kl_coef == 0.3


def test_an_engine_served_teacher_scores_as_the_in_trainer_one_and_its_step_moves_the_student(tiny_model, teacher):
    """--opd-type sglang: the teacher's engine (here the embedded one) scores the student's sampled
    tokens by prefill (/generate, max_new_tokens 0, logprob_start_len = the prompt's length - 1); its
    logprobs equal the in-trainer teacher's on the same tokens, the OPD gradient from the logprobs
    carried on the samples equals the in-trainer one, and a step along it lowers the held-out KL."""
    from aiohttp.test_utils import TestServer

    from agentrl.engines.embedded import EmbeddedEngine
    from agentrl.teacher import teacher_logprobs

    torch.manual_seed(0)
    train = TrainConfig(lr=1e-9, global_batch_size=256, micro_batch_size=256)
    inside = TorchTrainer(str(tiny_model), train=train, temperature=1.0,
                          algo=AlgoConfig(use_opd=True, opd_teacher_load=str(teacher)))
    g = torch.Generator().manual_seed(0)
    samples = sample_from(inside.model, torch.randint(3, 500, (256, 4), generator=g), g)
    samples[0].append_observation([11, 12])  # an env token is scored too (it is context, not trained)
    engine = EmbeddedEngine(str(teacher))

    async def score():
        server = TestServer(engine.app())
        await server.start_server()
        try:
            return await teacher_logprobs(str(server.make_url("")).rstrip("/"), samples)
        finally:
            await server.close()

    served = asyncio.run(score())
    in_trainer = inside.compute_logprobs(samples, inside.teacher_model)
    diff = max(abs(a - b) for x, y in zip(served, in_trainer) for a, b in zip(x, y))
    assert all(len(x) == s.response_length for x, s in zip(served, samples)) and diff < 1e-4, diff

    grads = []
    for t, algo in ((inside, None), (None, AlgoConfig(use_opd=True, opd_type="sglang", opd_teacher_url="http://t"))):
        if t is None:
            t = TorchTrainer(str(tiny_model), train=train, algo=algo, temperature=1.0)
            assert t.teacher_model is None  # the served teacher is not loaded in the trainer
            for s, lps in zip(samples, served):
                s.metadata["teacher_logprobs"] = lps
        t.optimizer.step = lambda: None
        t.model.zero_grad()
        metrics = t.train_rollout(samples)
        grads.append([p.grad.detach().clone() for p in t.model.parameters() if p.requires_grad])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))
    assert metrics["opd_reverse_kl"] > 0
    trained = [s for s in samples if s.trainable]  # a response's sum: the token mean times its trained tokens
    tokens_per_response = sum(sum(s.loss_mask) for s in trained) / len(trained)
    assert abs(metrics["opd_reverse_kl_seq"] - metrics["opd_reverse_kl"] * tokens_per_response) < 1e-6

    held_out = torch.randint(3, 500, (8, 10), generator=g)
    with torch.no_grad():
        before = float(exact_kl(t.model, inside.teacher_model, held_out))
        for p, grad in zip([p for p in t.model.parameters() if p.requires_grad], grads[1]):
            p.sub_(1e-4 * grad.sign())
        after = float(exact_kl(t.model, inside.teacher_model, held_out))
    assert after < before


def test_a_served_teacher_reply_that_does_not_score_the_response_is_refused(tiny_model):
    """The embedded engine refuses a logprob_start_len not below the input's length (as SGLang
    aborts it) and, as SGLang, leaves the first entry's logprob None; a teacher that ignores
    logprob_start_len (scores the whole input) is an error, never misaligned logprobs; a sample
    without carried logprobs fails its step loudly."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from agentrl.engines.embedded import EmbeddedEngine
    from agentrl.errors import EngineError
    from agentrl.algorithms import carried_teacher_logprobs
    from agentrl.teacher import teacher_logprobs

    s = Sample(prompt_tokens=[5, 6, 7], trajectory_id="t0")
    s.append_generated([8, 9], [-1.0, -1.0], 0)

    async def ignoring(request):  # scores every input token, as if logprob_start_len were 0
        body = await request.json()
        return web.json_response({"meta_info": {"input_token_logprobs": [[None, body["input_ids"][0], None]] + [
            [-1.0, t, None] for t in body["input_ids"][1:]]}})

    async def main():
        engine_server = TestServer(EmbeddedEngine(str(tiny_model)).app())
        app = web.Application()
        app.router.add_post("/generate", ignoring)
        bad_server = TestServer(app)
        await engine_server.start_server()
        await bad_server.start_server()
        try:
            url = str(engine_server.make_url("/generate"))
            async with aiohttp.ClientSession() as session:
                async with session.post(url, json={"input_ids": [5, 6, 7], "return_logprob": True,
                                                   "logprob_start_len": 3,
                                                   "sampling_params": {"max_new_tokens": 0}}) as r:
                    refused = (r.status, await r.text())
                # as SGLang's scheduler: the entry at logprob_start_len is padded None (never scored)
                async with session.post(url, json={"input_ids": [5, 6, 7, 8], "return_logprob": True,
                                                   "logprob_start_len": 1,
                                                   "sampling_params": {"max_new_tokens": 0}}) as r:
                    padded = (await r.json())["meta_info"]["input_token_logprobs"]
            good = await teacher_logprobs(str(engine_server.make_url("")).rstrip("/"), [s])
            with pytest.raises(EngineError, match="logprob_start_len"):
                await teacher_logprobs(str(bad_server.make_url("")).rstrip("/"), [s])
            return refused, good, padded
        finally:
            await engine_server.close()
            await bad_server.close()

    (status, text), good, padded = asyncio.run(main())
    assert status == 400 and "logprob_start_len" in text
    assert [e[1] for e in padded] == [6, 7, 8] and padded[0][0] is None and all(e[0] < 0 for e in padded[1:])
    assert len(good[0]) == 2 and all(lp < 0 for lp in good[0])
    with pytest.raises(ValueError, match="carries no teacher logprobs"):
        carried_teacher_logprobs([s])


def test_served_opd_and_judge_flags_fail_fast(tmp_path):
    with pytest.raises(ConfigError, match="--opd-teacher-load PATH .* or --opd-teacher-url"):
        parse_config(["--use-opd", "--opd-type", "sglang"])
    with pytest.raises(ConfigError, match="--opd-teacher-url is the served teacher"):
        parse_config(["--use-opd", "--opd-teacher-load", str(tmp_path), "--opd-teacher-url", "http://t"])
    cfg, _ = parse_config(["--use-opd", "--opd-type", "sglang", "--opd-teacher-url", "http://t:1"])
    assert cfg.algo.opd_teacher_url == "http://t:1"
    with pytest.raises(ConfigError, match="exclude each other"):
        parse_config(["--judge-url", "http://j/v1", "--judge-load", str(tmp_path)])
    with pytest.raises(ConfigError, match="--judge-load .*no such folder"):
        parse_config(["--judge-load", str(tmp_path / "missing")])
