"""Issue 20 through `agentrl train`: a hook that always fails stops the run naming it, with
what it made saved; SIGTERM and SIGINT mid-rollout (two engines behind sglang-router, MCP tool
servers in docker sandboxes) stop the run within seconds, leave no process or container behind,
and write the partial iteration."""

import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from spine_helpers import agentrl_cli, run_env
from waiting import wait_until


def alive(proc) -> bool:
    """True while `proc` runs; once it ended, the test fails with its stderr's end."""
    if proc.poll() is None:
        return True
    pytest.fail(f"the run ended (exit {proc.returncode}): {proc.communicate()[1][-3000:]}")

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--no-progress",
         "--rollout-max-response-len", "8"]


@pytest.mark.e2e
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



@pytest.mark.e2e
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


@pytest.mark.e2e
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


TOOLS_ENV = """
import json
import uuid
from pathlib import Path

import agentrl
from agentrl.envs.math_python import MathPythonEnv

CALL = {"name": "python", "arguments": {"code": "import time\\ntime.sleep(600)", "timeout": 600}}
SLEEP = "<tool_call>" + json.dumps(CALL) + "</tool_call>"


@agentrl.register_env("tools-hang")
class ToolsHang(MathPythonEnv):
    \"\"\"math-python's python tool: an MCP server per trajectory in a docker sandbox of the run's pool.
    The first group to get its tools finishes after one turn (reward 0.5); in every other group
    the agent calls python with code that runs until the run stops: the run is always mid-rollout.\"\"\"

    tool_timeout = 600.0
    first_seed = None
    finishes = False

    async def areset(self, *, seed=None, options=None):
        out = await super().areset(seed=seed, options=options)  # the tool server is up in its sandbox
        if ToolsHang.first_seed is None:
            ToolsHang.first_seed = seed
        self.finishes = seed == ToolsHang.first_seed
        return out

    async def astep(self, action):  # after a first turn generated through the router
        if self.finishes:
            return [], 0.5, True, False, {}
        Path(HANGING).touch()
        return await super().astep(SLEEP)

    async def aclose(self):
        await super().aclose()
        if self.finishes:
            (Path(DONE) / uuid.uuid4().hex).touch()
"""


def processes(marker: str, where: str = "environ") -> dict[int, str]:
    """{pid: command line} of the processes whose environment (or command line) holds `marker`."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / where).read_bytes():
                found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


def descendants_alive(marker: str) -> list[str]:
    """Processes whose environment carries the run's marker: what it started, Ray's included. Not
    all: the MCP SDK starts tool servers with a minimal environment (`tool_server_clients`), and
    a process that retitles itself (sglang-router: "sglang::router") overwrites what /proc shows
    of its environment (`process_tree`)."""
    return list(processes(marker).values())


def tool_server_clients(container_ids: list[str]) -> list[str]:
    """Host processes that talk into the run's containers (`docker exec -i ID ...`: the sandboxes'
    exec servers and the MCP tool servers), found by the container ids on their command lines."""
    return [cmd for cid in container_ids for cmd in processes(cid, "cmdline").values() if cmd.startswith("docker exec")]


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, start time, state) of a process; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[19], fields[0]


def process_tree(root: int) -> dict[int, tuple[str, str]]:
    """{pid: (start time, command line)} of every process descended from `root` now."""
    parents = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and (st := _stat(int(proc.name))) is not None:
            parents[int(proc.name)] = st[0]
    tree, frontier = {}, {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in tree}
        for pid in frontier:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                tree[pid] = (_stat(pid)[1], cmd)
            except (OSError, TypeError):
                continue
    return tree


def still_running(procs: dict[int, tuple[str, str]]) -> list[str]:
    """The processes of `procs` that live on (the same pid and start time, not a zombie)."""
    return [cmd for pid, (start, cmd) in procs.items()
            if (st := _stat(pid)) is not None and st[1] == start and st[2] != "Z"]


def containers(run_id: str) -> list[str]:
    out = subprocess.run(["docker", "ps", "-aq", "--no-trunc", "--filter", f"label=agentrl.run_id={run_id}"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.split()


def docker_ready() -> bool:
    try:
        images = subprocess.run(["docker", "images", "-q", "agentrl-sandbox"], capture_output=True, text=True,
                                timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return bool(images.strip())


@pytest.mark.e2e
@pytest.mark.skipif(not docker_ready(), reason="needs docker and the sandbox image (scripts/build_sandbox_image.sh)")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_rollout_stops_everything_within_seconds(tmp_path, signum):
    """Two engines behind sglang-router, MCP tool servers in docker sandboxes of the run's pool, one
    group finished, the others mid tool call or waiting for a sandbox: a signal stops it all within
    seconds (no container, no process of the run), writes the finished group's trajectories and
    marks the iteration's metrics partial."""
    marker, run_id = f"agentrl-test-{uuid.uuid4().hex[:8]}", f"run-{uuid.uuid4().hex[:12]}"
    hanging, done = tmp_path / "hanging", tmp_path / "done"
    done.mkdir()
    (tmp_path / "tools_env.py").write_text(f"HANGING, DONE = {str(hanging)!r}, {str(done)!r}\n" + TOOLS_ENV)
    out = tmp_path / "run"
    env = run_env() | {"AGENTRL_TEST_MARKER": marker, "AGENTRL_RUN_ID": run_id}
    # 3 groups (over-sampling) and 3 sandboxes: the first two trajectories of the finishing group
    # and of the others take them in launch order; when the finishing group is done, 3 hang mid
    # tool call and the last one waits for a sandbox
    proc = subprocess.Popen([agentrl_cli(), "train", "--env-module", str(tmp_path / "tools_env.py"), "--env",
                             "tools-hang", "--sandbox", "docker", "--sandbox-max-active", "3", "--num-engines", "2",
                             "--engine-num-threads", "1", "--over-sampling-batch-size", "3", "--num-rollout", "2",
                             "--output-dir", str(out), *SMALL],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # What the run started is there to stop, and the checks below see each kind of it: Ray,
        # the two engines, the router, the sandboxes' exec servers and the tool servers (the
        # `docker exec` that runs each in its sandbox), as the run's process tree, as processes
        # with the run's environment, and as `docker exec` into the run's containers.
        kinds = {"ray": lambda cmd: "raylet" in cmd, "engine": lambda cmd: "agentrl.engines.embedded" in cmd,
                 "router": lambda cmd: cmd.startswith("sglang::router"),
                 "exec server": lambda cmd: cmd.startswith("docker exec") and "AGENTRL_MCP_SERVER=" not in cmd,
                 "tool server": lambda cmd: cmd.startswith("docker exec") and "AGENTRL_MCP_SERVER=" in cmd}
        seen = {}

        def everything_running() -> bool:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            nonlocal ids, tree
            ids, tree = containers(run_id), process_tree(proc.pid)
            seen.update({kind: sum(map(found, (cmd for _, cmd in tree.values()))) for kind, found in kinds.items()})
            return (hanging.exists() and len(list(done.iterdir())) == 2 and all(seen.values()) and seen["engine"] == 2
                    and seen["tool server"] == 3)

        ids, tree = [], {}
        wait_until(everything_running, timeout_s=240, what=lambda: f"the rollout getting there ({seen})")
        marked, clients = descendants_alive(marker), tool_server_clients(ids)
        assert all(any(map(kinds[kind], marked)) for kind in ("ray", "engine", "exec server"))
        assert any(map(kinds["tool server"], clients))
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
    assert "Task was destroyed but it is pending" not in err, err[-3000:]
    assert stopped_s < 30, f"took {stopped_s:.1f}s to stop"
    left = lambda: (still_running(tree), descendants_alive(marker), tool_server_clients(ids),  # noqa: E731
                    containers(run_id))
    # what the stop killed may take a moment to be reaped
    wait_until(lambda: not any(left()), timeout_s=10, what=lambda: f"everything the run started ending ({left()})")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == [rows[0]] and rows[0]["partial"] is True and rows[0]["rollout_id"] == 0
    saved = [json.loads(x) for x in (out / "trajectories" / "rollout_00000.jsonl").read_text().splitlines()]
    # the finished group (2 members), nothing of the groups stopped mid tool call
    assert len(saved) == 2 and {t["status"] for t in saved} == {"completed"} and {t["reward"] for t in saved} == {0.5}
    assert rows[0]["reward_mean"] == 0.5
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


@pytest.mark.e2e
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_writes_the_trajectories_finished_so_far(tmp_path, signum):
    hanging, done = tmp_path / "hanging", tmp_path / "done"
    (tmp_path / "half_env.py").write_text(f"MARKER, DONE = {str(hanging)!r}, {str(done)!r}\n" + HALF_DONE_ENV)
    out = tmp_path / "run"
    proc = subprocess.Popen([agentrl_cli(), "train", "--env-module", str(tmp_path / "half_env.py"), "--env",
                             "half-done", "--num-rollout", "2", "--output-dir", str(out), *SMALL],
                            env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: hanging.exists() and done.exists(), timeout_s=240, what="the rollout getting there",
                   while_=lambda: alive(proc))
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


@pytest.mark.e2e
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_load_resumes_from_the_last_checkpoint_after_a_signal(tmp_path, signum):
    first, second = tmp_path / "first", tmp_path / "second"
    proc = subprocess.Popen([agentrl_cli(), "train", "--num-rollout", "50", "--save-interval", "1",
                             "--output-dir", str(first), *SMALL], env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until((first / "checkpoints" / "iter_000001" / "trainer_state.json").exists, timeout_s=240,
                   what="checkpoint iter_000001", while_=lambda: alive(proc))
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
from agentrl.cluster.ray_session import stop_on_signals

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


STACKS = """
import threading, time
from agentrl.cluster.ray_session import stop_on_signals

stop_on_signals()
threading.Thread(target=lambda: time.sleep(60), name="sleeper", daemon=True).start()
print("ready", flush=True)
time.sleep(1.5)
print("went on", flush=True)
"""


def test_sigusr2_prints_every_threads_stack_and_the_run_goes_on():
    import sys

    proc = subprocess.Popen([sys.executable, "-c", STACKS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGUSR2)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out == "went on\n", err
    assert err.lower().count("thread 0x") == 2 and "in <lambda>" in err and "in <module>" in err, err


@pytest.mark.e2e
def test_a_run_survives_sigpipe_and_a_listing_ends_quietly_in_a_closed_pipe(tmp_path):
    """`agentrl train` keeps Python's SIGPIPE handling (ignored: a write into the pipe of a child
    that exited raises BrokenPipeError where it happened). With SIGPIPE's default for every
    command, an MCP server that died before the client wrote to its stdin killed the whole run
    (exit -13, nothing cleaned up). A listing piped into a reader that left ends quietly."""
    proc = subprocess.Popen([agentrl_cli(), "train", "--num-rollout", "1", "--output-dir", str(tmp_path / "run"),
                             *SMALL], stderr=subprocess.PIPE, text=True, env=run_env())
    try:
        assert proc.stderr.readline()  # its first line comes after main() began
        status = Path(f"/proc/{proc.pid}/status").read_text()
        ignored = int(next(x for x in status.splitlines() if x.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGPIPE - 1)), "agentrl train dies of SIGPIPE"
    finally:
        proc.terminate()
        proc.communicate(timeout=120)
    listing = subprocess.Popen([agentrl_cli(), "envs", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=run_env())
    listing.stdout.close()  # the reader left before the first line
    _, err = listing.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()[-2000:]
