"""A multi-turn env for the rollout benches (bench/rollout_breakdown.py --cpu, tests/test_rollout_vs_bare.py):
episodes of 1, 2 or 3 turns (the task's label says how many), user turns between them.
Loaded with `--env-module bench/talk_env.py --env count-talk`."""
import agentrl
from agentrl.env import Env


@agentrl.register_env("count-talk")
class Talk(Env):
    max_turns = 3

    @classmethod
    def dataset(cls, seed=0, **kw):
        i = 0
        while True:
            yield {"prompt": f"Count with me, part {i}.", "label": str(1 + i % 3)}
            i += 1

    def reset(self, *, seed=None, options=None):
        self.t, self.turns = 0, int((options or {}).get("label") or 3)
        return (options or {}).get("prompt", "Count."), {}

    def step(self, action):
        self.t += 1
        return [{"role": "user", "content": f"Go on ({self.t})."}], 0.0, self.t >= self.turns, False, {}
