"""The trainer's recomputed logprobs equal the engine's rollout logprobs for the same
weights (fp32, CPU; tolerance 1e-4 per token), over multi-turn trajectories with env
tokens in between, so the first update is on-policy."""

import asyncio

import agentrl
from agentrl.config import AlgoConfig, TrainConfig
from agentrl.rollout.agent_loop import LoopSettings, Renderer
from agentrl.rollout.client import EngineClient
from agentrl.rollout.manager import generate_rollout

TOLERANCE = 1e-4


class Chatty(agentrl.Env):
    max_turns = 3

    def reset(self, *, seed=None, options=None):
        self.turn = 0
        return options["prompt"], {}

    def step(self, action):
        self.turn += 1
        return f"go on ({self.turn})", 0.1 * self.turn + 0.01 * len(action), self.turn == 3, False, {}


def test_trainer_logprobs_match_engine_rollout_logprobs(engine, tiny_model, tokenizer):
    from agentrl.trainers.torch_trainer import TorchTrainer

    trainer = TorchTrainer(str(tiny_model), train=TrainConfig(lr=1e-3, micro_batch_size=5), algo=AlgoConfig(),
                           temperature=0.8)
    renderer = Renderer(tokenizer, True)
    settings = LoopSettings(max_response_len=60, max_turns=3, sampling_params={"temperature": 0.8},
                            max_tokens_per_turn=12)

    async def go():
        async with EngineClient(engine.url) as client:
            await client.post("/update_weights_from_disk", {"model_path": str(tiny_model), "weight_version": "0"})
            return await generate_rollout(
                [{"prompt": "tell me about the river"}, {"prompt": "what is 2 plus 2"}],
                make_env=lambda name: (Chatty(), "chatty"), n_samples=6, renderer=renderer, client=client,
                settings_for=lambda env: settings, rollout_id=0, run_seed=0, max_concurrency=64)

    samples = asyncio.run(go())
    assert all(s.status.value != "failed" for s in samples), [s.metadata for s in samples]
    assert any(0 in s.loss_mask for s in samples)  # env tokens sit between policy turns
    recomputed = trainer.compute_logprobs(samples)
    diffs = [abs(a - b) for s, r in zip(samples, recomputed)
             for a, b, m in zip(r, s.rollout_logprobs, s.loss_mask) if m]
    assert len(diffs) > 50
    print(f"logprob parity: {len(diffs)} tokens, max |trainer - engine| = {max(diffs):.2e}")
    assert max(diffs) < TOLERANCE, f"max |trainer - engine| logprob diff {max(diffs):.2e}"

    metrics = trainer.train_rollout(samples)
    assert metrics["ppo_kl"] == 0.0 and metrics["clipfrac"] == 0.0  # one step per rollout: on-policy
    assert metrics["train_rollout_logprob_abs_diff"] < TOLERANCE
    assert trainer.version == 1
