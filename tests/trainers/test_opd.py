"""On-policy distillation (--use-opd): the student samples, the teacher (loaded beside it in the
trainer) scores the sampled tokens, and each token's advantage loses opd_kl_coef x (student
logprob - teacher logprob). With a constant reward that is distillation alone: the student's
exact KL to the teacher on held-out contexts falls."""

import shutil

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
