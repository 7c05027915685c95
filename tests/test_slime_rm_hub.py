"""agentrl/rm_hub: slime's --rm-type rewards. Each type on answers it must score right and
wrong; where a slime checkout is there (tests/slime_scripts.py finds it), every case is also
scored by slime's own rm_hub (624b824) and the two must agree. slime's dynamic-sampling filter
runs on agentrl's Samples."""

import asyncio
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from slime_scripts import slime_checkout

from agentrl.config import parse_config
from agentrl.errors import ConfigError
from agentrl.rm_hub import async_rm, check_rm_type, remote_rm
from agentrl.types import Sample

# (rm_type, response, label, metadata, expected reward)
CASES = [
    ("deepscaler", "<think>6*7</think> So \\boxed{42}.", "42", {}, 1),
    ("deepscaler", "<think>6*7</think> So \\boxed{41}.", "42", {}, 0),
    ("deepscaler", "So \\boxed{42}.", "42", {}, 0),  # no </think>: slime scores 0
    ("deepscaler", "</think>\\boxed{\\frac{1}{2}}", "0.5", {}, 1),
    ("deepscaler", "</think>\\boxed{3}", "\\boxed{3}", {}, 1),
    ("deepscaler", "</think>\\boxed{1,000}", "1000", {}, 1),
    ("deepscaler", "</think>no box here", "3", {}, 0),
    ("dapo", "work...\nAnswer: 42", "42", {}, {"score": 1.0, "acc": True, "pred": "42"}),
    ("dapo", "work...\nAnswer: 41", "42", {}, {"score": -1.0, "acc": False, "pred": "41"}),
    ("dapo", "no final line", "42", {}, {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    ("dapo", "Answer: $1,000$", "1000", {}, {"score": 1.0, "acc": True, "pred": "1000"}),
    ("math", "it is \\boxed{2}", "2", {}, 1),
    ("math", "it is \\boxed{2}", "3", {}, 0),
    ("math", "it is \\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", {}, 1),
    ("f1", "The Eiffel Tower", "eiffel tower", {}, 1.0),
    ("f1", "Paris France", "Paris", {}, pytest.approx(2 / 3)),
    ("f1", "yes", "no", {}, 0.0),
    ("gpqa", "After thinking, the answer is B", "B", {}, 1.0),
    ("gpqa", "The answer is C", "B", {}, 0.0),
    ("gpqa", "I pick option A.", "blue", {"choices": ["blue", "red"]}, 1.0),
    ("gpqa", "answer: B", 1, {"choices": ["x", "y", "z"]}, 1.0),
    ("boxed_f1", "the answer is \\boxed{Eiffel Tower}", "Eiffel Tower", {}, 1.0),
]


def agentrl_sample(response: str, label, metadata: dict, reward=0.0) -> Sample:
    return Sample(prompt_tokens=[1], messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": response}],
                  metadata={**metadata, "label": label}, reward=reward)


@pytest.mark.parametrize("rm_type, response, label, metadata, expected", CASES)
def test_each_rm_type_scores_as_slimes(rm_type, response, label, metadata, expected):
    cfg, _ = parse_config(["--rm-type", rm_type, "--env", "slime", "--prompt-data", "x.jsonl"])
    assert asyncio.run(async_rm(cfg, agentrl_sample(response, label, metadata))) == expected


@pytest.fixture(scope="module")
def slime_rm_hub(tmp_path_factory):
    slime = slime_checkout(tmp_path_factory.mktemp("slime"))
    if slime is None:
        pytest.skip("no slime checkout (AGENTRL_SLIME_SRC or the git mirror)")
    sys.path.insert(0, str(slime))
    try:
        from slime.rollout.rm_hub import async_rm as slime_async_rm
        from slime.utils.types import Sample as SlimeSample
        yield slime_async_rm, SlimeSample
    finally:
        sys.path.remove(str(slime))


@pytest.mark.parametrize("rm_type, response, label, metadata, expected", CASES)
def test_slimes_own_rm_hub_agrees(slime_rm_hub, rm_type, response, label, metadata, expected):
    slime_async_rm, SlimeSample = slime_rm_hub
    args = SimpleNamespace(custom_rm_path=None, rm_type=rm_type)
    sample = SlimeSample(prompt="q", response=response, label=label, metadata=dict(metadata))
    ours = asyncio.run(async_rm(args, sample))  # slime's flat args and Sample work too
    assert asyncio.run(slime_async_rm(args, sample)) == ours == expected


def test_slimes_nonzero_std_filter_runs_on_agentrl_samples(slime_rm_hub):
    from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std

    cfg, _ = parse_config(["--num-rollout", "2"])
    mixed = [agentrl_sample("a", "1", {}, reward=r) for r in (1.0, 0.0)]
    same = [agentrl_sample("a", "1", {}, reward=r) for r in (1.0, 1.0)]
    assert bool(check_reward_nonzero_std(cfg, mixed).keep) and not bool(check_reward_nonzero_std(cfg, same).keep)


def test_get_reward_value_reads_the_reward_key():
    cfg, _ = parse_config(["--reward-key", "score", "--num-rollout", "2"])
    assert agentrl_sample("a", "1", {}, reward={"score": 0.25, "acc": 1.0}).get_reward_value(cfg) == 0.25
    assert agentrl_sample("a", "1", {}, reward=0.5).get_reward_value(SimpleNamespace(reward_key=None)) == 0.5
    with pytest.raises(ConfigError, match="--reward-key acc: agentrl's advantages read a dict reward's 'score'"):
        parse_config(["--reward-key", "acc"])


def test_the_rows_metadata_rm_type_wins():
    cfg, _ = parse_config(["--rm-type", "math", "--env", "slime", "--prompt-data", "x.jsonl"])
    sample = agentrl_sample("the answer is B", "B", {"rm_type": "gpqa"})
    assert asyncio.run(async_rm(cfg, sample)) == 1.0  # math would find no \boxed{}: 0


class RewardServer(BaseHTTPRequestHandler):
    seen: list = []
    fail = False

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        RewardServer.seen.append(body)
        self.send_response(500 if RewardServer.fail else 200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps({"score": 0.75}).encode())

    def log_message(self, *args):
        pass


def test_remote_rm_posts_the_sample_and_its_retries_end():
    server = ThreadingHTTPServer(("127.0.0.1", 0), RewardServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/reward"
        cfg, _ = parse_config(["--rm-type", "remote_rm", "--rm-url", url, "--env", "slime", "--prompt-data", "x"])
        assert asyncio.run(async_rm(cfg, agentrl_sample("hi", "gold", {}))) == {"score": 0.75}
        assert RewardServer.seen[-1] == {"prompt": "q", "response": "hi", "label": "gold"}
        RewardServer.fail, before = True, len(RewardServer.seen)
        with pytest.raises(Exception, match="500"):
            asyncio.run(remote_rm(cfg, agentrl_sample("hi", "gold", {}), attempts=2))
        assert len(RewardServer.seen) - before == 2
    finally:
        RewardServer.fail = False
        server.shutdown()


def test_types_that_cannot_run_say_why():
    with pytest.raises(ConfigError, match="--rm-type remote_rm needs --rm-url"):
        check_rm_type("remote_rm")
    with pytest.raises(ConfigError, match="--rm-type ifbench: allenai/IFBench's evaluation_lib is not importable"):
        check_rm_type("ifbench")
    check_rm_type("boxed_math")
