"""Issue 20 through `agentrl train`: a hook that always fails stops the run naming it, with
what it made saved; SIGTERM and SIGINT mid-rollout (docker sandboxes held) stop the run within
seconds, leave no process or container behind, and write the partial iteration."""

import json
import os
import signal
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from spine_helpers import agentrl_cli, run_env

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--no-progress",
         "--rollout-max-response-len", "8"]


def test_a_reward_hook_that_always_fails_stops_the_run_naming_it(tmp_path):
    (tmp_path / "rm.py").write_text("def rm(args, sample):\n    raise KeyError('no such field')\n")
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.run([agentrl_cli(), "train", "--num-rollout", "5", "--custom-rm-path", f"{tmp_path}/rm.py:rm",
                           "--max-failed-groups", "2", "--max-group-retries", "1", "--output-dir", str(out), *SMALL],
                          capture_output=True, text=True, timeout=300, env=run_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert "groups in a row failed" in err and "custom reward function (--custom-rm-path): KeyError" in err
    assert "no such field" in err and "Traceback (most recent call last)" in err, err[-3000:]
    assert err.count("first failure of its kind") == 1  # reported once, as it happened
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["partial"] is True and rows[-1]["dropped_failed"] >= 2
    saved = [json.loads(x) for x in (out / "trajectories" / "rollout_00000.jsonl").read_text().splitlines()]
    failed = [t for t in saved if t["status"] == "failed"]  # the others: siblings cancelled at the first failure
    assert failed and all("KeyError" in t["metadata"]["traceback"] for t in failed)
    assert all(t["status"] == "aborted" and t["metadata"]["aborted"] == "sibling failed"
               for t in saved if t not in failed)
    print(f"hopeless run stopped after {time.monotonic() - t0:.1f}s")



def test_a_generate_hook_that_always_fails_stops_the_run_naming_it(tmp_path):
    calls = tmp_path / "calls"
    gen = tmp_path / "gen.py"
    gen.write_text(f"async def generate(args, sample, sampling_params):\n"
                   f"    open({str(calls)!r}, 'a').write('x')\n"
                   f"    raise ConnectionError('engine unreachable')\n")
    out = tmp_path / "run"
    proc = subprocess.run([agentrl_cli(), "train", "--num-rollout", "5", "--custom-generate-function-path",
                           f"{gen}:generate", "--max-failed-groups", "2", "--max-group-retries", "1",
                           "--output-dir", str(out), *SMALL], capture_output=True, text=True, timeout=300, env=run_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert "2 groups in a row failed" in err, err[-3000:]
    assert f"--custom-generate-function-path {gen}:generate: ConnectionError" in err and "engine unreachable" in err
    assert "Traceback (most recent call last)" in err and f'File "{gen}", line 3, in generate' in err
    assert err.count("first failure of its kind") == 1
    # bounded: 2 groups x 2 tries x 1-2 members (a sibling not yet started is cancelled at the first
    # failure), plus the groups over-sampling had in flight (not 276,736 calls)
    assert 4 <= len(calls.read_text()) <= 16
    saved = [json.loads(x) for x in (out / "trajectories" / "rollout_00000.jsonl").read_text().splitlines()]
    failed = [t for t in saved if t["status"] == "failed"]
    assert failed and all("ConnectionError" in t["metadata"]["traceback"] for t in failed)
    assert all(t["status"] == "aborted" and t["metadata"]["aborted"] == "sibling failed"
               for t in saved if t not in failed)


# slime's generate_rollout without an engine: one made-up trained token per sample
FAKE_ROLLOUT = """
def generate_rollout(args, rollout_id, data_source, evaluation=False):
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for s in group:
            s.tokens = s.tokens + [s.tokens[0]]
            s.response_length, s.loss_mask, s.rollout_log_probs = 1, [1], [-1.0]
    return groups
"""


def test_a_rollout_function_whose_reward_hook_always_fails_stops_the_run(tmp_path):
    (tmp_path / "fns.py").write_text(FAKE_ROLLOUT + "\n\ndef rm(args, sample):\n    raise KeyError('no such field')\n")
    out = tmp_path / "run"
    proc = subprocess.run([agentrl_cli(), "train", "--num-rollout", "5", "--rollout-function-path",
                           f"{tmp_path}/fns.py:generate_rollout", "--custom-rm-path", f"{tmp_path}/fns.py:rm",
                           "--max-failed-groups", "2", "--output-dir", str(out), *SMALL],
                          capture_output=True, text=True, timeout=300, env=run_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert f"2 groups in a row from --rollout-function-path {tmp_path}/fns.py:generate_rollout had failed" in err
    assert "--custom-rm-path: KeyError" in err and "no such field" in err and "Traceback" in err, err[-3000:]
    assert err.count("first failure of its kind") == 1
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["partial"] is True
    saved = [json.loads(x) for x in (out / "trajectories" / "rollout_00000.jsonl").read_text().splitlines()]
    assert len(saved) == 4 and all("KeyError" in t["metadata"]["traceback"] for t in saved)


SLOW_SANDBOX_ENV = '''
import asyncio
from pathlib import Path
import agentrl

@agentrl.register_env("slow-sandbox")
class SlowSandbox(agentrl.Env):
    """Holds a sandbox from the run's pool and never finishes: the run is always mid-rollout."""

    def __init__(self, sandbox=None):
        self.pool, self.sb = sandbox, None

    async def areset(self, *, seed=None, options=None):
        self.sb = await self.pool.get()
        Path(MARKER).touch()
        await asyncio.sleep(3600)

    async def astep(self, action):
        raise AssertionError("never reached")

    async def aclose(self):
        if self.sb is not None:
            await self.pool.release(self.sb)
'''


def descendants_alive(marker: str) -> list[str]:
    """Processes whose environment carries the run's marker: everything it started, Ray's included."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120])
        except OSError:
            continue
    return found


def containers(run_id: str) -> list[str]:
    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=agentrl.run_id={run_id}"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.split()


def docker_ready() -> bool:
    try:
        images = subprocess.run(["docker", "images", "-q", "agentrl-sandbox"], capture_output=True, text=True,
                                timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return bool(images.strip())


@pytest.mark.skipif(not docker_ready(), reason="needs docker and the sandbox image (scripts/build_sandbox_image.sh)")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_rollout_stops_everything_within_seconds(tmp_path, signum):
    marker, run_id = f"agentrl-test-{uuid.uuid4().hex[:8]}", f"run-{uuid.uuid4().hex[:12]}"
    started = tmp_path / "started"
    (tmp_path / "slow_env.py").write_text(f"MARKER = {str(started)!r}\n" + textwrap.dedent(SLOW_SANDBOX_ENV))
    out = tmp_path / "run"
    env = run_env() | {"AGENTRL_TEST_MARKER": marker, "AGENTRL_RUN_ID": run_id}
    proc = subprocess.Popen([agentrl_cli(), "train", "--env-module", str(tmp_path / "slow_env.py"), "--env",
                             "slow-sandbox", "--sandbox", "docker", "--sandbox-max-active", "2", "--num-rollout", "2",
                             "--output-dir", str(out), *SMALL], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not started.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the rollout never started"
            time.sleep(0.2)
        assert containers(run_id) and descendants_alive(marker)  # what the run started is there to stop
        t0 = time.monotonic()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        stopped_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "agentrl: interrupted" in err and "Future exception was never retrieved" not in err, err[-3000:]
    assert stopped_s < 30, f"took {stopped_s:.1f}s to stop"
    time.sleep(1.0)
    assert descendants_alive(marker) == [] and containers(run_id) == []
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == [rows[0]] and rows[0]["partial"] is True and rows[0]["rollout_id"] == 0
    print(f"{signal.Signals(signum).name}: stopped in {stopped_s:.1f}s")


HALF_DONE_ENV = '''
import asyncio
from pathlib import Path
import agentrl

@agentrl.register_env("half-done")
class HalfDone(agentrl.Env):
    """The first group seen (by its seed) finishes in one turn; every other group hangs."""

    max_turns = 1
    first_seed = None

    @classmethod
    def dataset(cls, seed=0, **kw):
        while True:
            yield {"prompt": "say anything"}

    async def areset(self, *, seed=None, options=None):
        if HalfDone.first_seed is None:
            HalfDone.first_seed = seed
        if seed != HalfDone.first_seed:
            Path(MARKER).touch()
            await asyncio.sleep(3600)
        return options["prompt"], {}

    async def astep(self, action):
        Path(DONE).touch()
        return [], 0.5, True, False, {}
'''


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_writes_the_trajectories_finished_so_far(tmp_path, signum):
    hanging, done = tmp_path / "hanging", tmp_path / "done"
    (tmp_path / "half_env.py").write_text(f"MARKER, DONE = {str(hanging)!r}, {str(done)!r}\n" + HALF_DONE_ENV)
    out = tmp_path / "run"
    proc = subprocess.Popen([agentrl_cli(), "train", "--env-module", str(tmp_path / "half_env.py"), "--env",
                             "half-done", "--num-rollout", "2", "--output-dir", str(out), *SMALL],
                            env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (hanging.exists() and done.exists()):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the rollout never got there"
            time.sleep(0.2)
        time.sleep(1.0)  # the finished group's reward and hand-over
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "agentrl: interrupted" in err, err[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["partial"] is True and rows[0]["reward_mean"] == 0.5
    saved = [json.loads(x) for x in (out / "trajectories" / "rollout_00000.jsonl").read_text().splitlines()]
    # the one finished group (2 members), nothing of the groups still running
    assert len(saved) == 2 and {t["status"] for t in saved} == {"completed"} and {t["reward"] for t in saved} == {0.5}
    assert len({t["group_id"] for t in saved}) == 1


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_load_resumes_from_the_last_checkpoint_after_a_signal(tmp_path, signum):
    first, second = tmp_path / "first", tmp_path / "second"
    proc = subprocess.Popen([agentrl_cli(), "train", "--num-rollout", "50", "--save-interval", "1",
                             "--output-dir", str(first), *SMALL], env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (first / "checkpoints" / "iter_000001" / "trainer_state.json").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.2)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "agentrl: interrupted" in err, err[-3000:]
    saved = sorted(p.parent.name for p in (first / "checkpoints").glob("iter_*/trainer_state.json"))
    last = int(saved[-1].removeprefix("iter_"))
    assert last >= 1 and [json.loads(x)["rollout_id"] for x in (first / "metrics.jsonl").read_text().splitlines()
                          if not json.loads(x).get("partial")][-1] >= last - 1
    state = json.loads((first / "checkpoints" / saved[-1] / "trainer_state.json").read_text())

    proc = subprocess.run([agentrl_cli(), "train", "--num-rollout", str(last + 1), "--load", str(first / "checkpoints"),
                           "--output-dir", str(second), *SMALL], capture_output=True, text=True, timeout=300,
                          env=run_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {first / 'checkpoints' / saved[-1]}: iteration {last}" in proc.stderr
    rows = [json.loads(x) for x in (second / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [last] and rows[0]["policy_version"] == last + 1
    resumed = json.loads((second / "checkpoints" / f"iter_{last + 1:06d}" / "trainer_state.json").read_text())
    assert resumed["data"]["consumed"] > state["data"]["consumed"]  # the data position went on from the checkpoint


SLOW_CLEANUP = """
import os, signal, sys, time
from agentrl.orchestration import stop_on_signals

stop_on_signals()
try:
    print("ready", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print("cleaning up", flush=True)  # the first signal: cleanup starts, and hangs
    time.sleep(60)
sys.exit(3)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_exits_at_once(signum):
    import sys

    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLEANUP], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signum)
        assert proc.stdout.readline() == "cleaning up\n"
        t0 = time.monotonic()
        proc.send_signal(signum)
        assert proc.wait(timeout=10) == 128 + signum and time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
