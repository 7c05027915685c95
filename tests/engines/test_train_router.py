"""`agentrl train --num-engines 2`: one iteration of a multi-turn env (from --env-module) through
sglang-router in front of two embedded engines; metrics.jsonl gains router_affinity and
prefix_cache_hit_rate."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ENV = '''
from agentrl.env import Env
from agentrl.registry import register_env


@register_env("count-turns")
class CountTurns(Env):
    max_turns = 3

    @classmethod
    def dataset(cls, seed: int = 0, **_):
        i = 0
        while True:
            i += 1
            yield {"prompt": f"Task {i}: count with me, one word per turn, until I say stop. one two three four",
                   "label": "x"}

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return (options or {})["prompt"], {}

    def step(self, action):
        self.t += 1
        return [{"role": "user", "content": f"ok, turn {self.t} done, go on"}], 0.1 * self.t, self.t >= 3, False, {}
'''


@pytest.mark.e2e
def test_train_through_the_router_reports_affinity_and_cache_hits(tmp_path):
    (tmp_path / "count_env.py").write_text(textwrap.dedent(ENV))
    out = tmp_path / "run"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "agentrl"), "train", "--env", "count-turns", "--env-module",
         str(tmp_path / "count_env.py"), "--num-engines", "2", "--engine-num-threads", "1", "--num-rollout", "1",
         "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
         "--rollout-max-response-len", "60", "--rollout-max-tokens-per-turn", "6",
         "--router-retry-max-retries", "3", "--no-progress", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["router_affinity"] == 1.0
    assert row["prefix_cache_hit_rate"] > 0.3 and row["engines_used"] == 2
    assert (out / "logs" / "router.log").exists() and (out / "logs" / "engine-1.log").exists()
