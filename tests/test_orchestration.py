"""Ray placement on one machine: quiet local start (no auth file), joining a running
cluster with --ray-address, and --colocate's offload/reload path."""

import contextlib
import json
import os
import shutil
import socket
import subprocess

import pytest

from spine_helpers import BIN, agentrl_cli, run_env
from waiting import wait_until

SMALL = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size",
         "4", "--no-progress"]


def train(*args, env=None):
    return subprocess.run([agentrl_cli(), "train", *args], capture_output=True, text=True, timeout=600,
                          env=env or run_env())


@pytest.mark.e2e
def test_local_ray_is_quiet_and_leaves_no_auth_file(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    shutil.copytree(os.path.expanduser("~/.cache/agentrl"), home / ".cache" / "agentrl")  # the tiny model
    env = {**run_env(), "HOME": str(home)}
    env.pop("RAY_AUTH_MODE", None)
    proc = train("--output-dir", str(tmp_path / "run"), *SMALL, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (home / ".ray").exists()
    assert "Token authentication" not in proc.stderr and "dashboard" not in proc.stderr.lower()


@pytest.mark.e2e
def test_colocate_runs_and_trains(tmp_path):
    """Two iterations of the handover (the embedded engine dies where SGLang's scheduler would:
    a resume of what was never released, a release while requests run, a generation or a
    generating /health while released), with over-sampled groups left running at the handover."""
    out = tmp_path / "run"
    small = [a if a != "1" or i != 1 else "2" for i, a in enumerate(SMALL)]  # --num-rollout 2
    heldout = tmp_path / "heldout.jsonl"  # evaluation too runs on the engines' memory: inside a handover
    heldout.write_text("".join(json.dumps({"prompt": f"Repeat the word: {w}", "label": w}) + "\n" for w in ("a", "b")))
    proc = train("--colocate", "--over-sampling-batch-size", "4", "--eval-interval", "1", "--eval-prompt-data", "h",
                 str(heldout), "--output-dir", str(out), *small)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2] and all("loss" in r for r in rows)
    assert "eval_before_train/h/reward_mean" in rows[0] and all(r["eval/h/failed"] == 0 for r in rows)
    assert "fatal" not in (out / "logs" / "engine.log").read_text()
    assert not (out / "logs" / "engine_events.jsonl").exists()  # no engine died or restarted
    proc = train("--colocate", "--async", "--output-dir", str(out), *SMALL)
    assert proc.returncode == 2 and "--colocate" in proc.stderr


@pytest.mark.e2e
def test_joins_a_running_cluster_with_ray_address(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**run_env(), "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    ray = str(BIN / "ray")
    temp = f"/tmp/ray-t{port}"  # short (socket paths) and ours alone, so only our cluster is stopped
    start = subprocess.run([ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                            "--temp-dir", temp,
                            "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats"],
                           capture_output=True, text=True, timeout=180, env=env)
    if start.returncode != 0:
        _stop_cluster(temp)  # a start that failed midway can leave its GCS and monitors running
        pytest.skip(f"ray start failed here: {start.stderr[-500:]}")
    try:
        out = tmp_path / "run"
        proc = train("--ray-address", f"127.0.0.1:{port}", "--output-dir", str(out), *SMALL, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (out / "metrics.jsonl").exists()
        # The cluster outlives the run: the run only joined it.
        status = subprocess.run([ray, "status", "--address", f"127.0.0.1:{port}"], capture_output=True, text=True,
                                timeout=60, env=env)
        assert status.returncode == 0, status.stderr[-500:]
    finally:
        _stop_cluster(temp)


def _stop_cluster(temp: str) -> None:
    """Stop the processes of this cluster only (`ray stop` would stop every Ray on the machine)."""
    import signal

    def ours():
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if temp in cmd or f"ray-t{temp.rsplit('ray-t', 1)[1]}" in cmd:
                pids.append(int(pid))
        return pids

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in ours():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        with contextlib.suppress(AssertionError):  # what SIGTERM leaves, SIGKILL ends
            wait_until(lambda: not ours(), timeout_s=2, what="the cluster's processes ending")
    shutil.rmtree(temp, ignore_errors=True)


def test_out_of_memory_names_the_knobs():
    from agentrl.config import parse_config
    from agentrl.cluster.trainer_actor import out_of_memory_hint

    cfg, _ = parse_config(["--colocate", "--sglang-mem-fraction-static", "0.5", "--micro-batch-size", "8"])
    msg = out_of_memory_hint(cfg, {"used_gib": 79.0, "total_gib": 79.6, "mine_gib": 40.0}, 256)
    assert "--sglang-mem-fraction-static" in msg and "now 0.5" in msg and "--micro-batch-size (now 8;" in msg
    assert "other processes (engines) 39.0 GiB" in msg and "256 samples" in msg


@pytest.mark.slow
def test_ray_workers_run_at_the_drivers_priority():
    """Ray starts workers at nice 15: the trainer and engines (its actors) then starved behind
    any other load on a shared machine (a parallel test made the trainer 40x slower). Without
    --ray-address the run starts a Ray of its own: a RAY_ADDRESS in the environment (or a
    `ray start` on the machine) is not joined."""
    code = ("import os, ray\n"
            "from agentrl.config import Config\n"
            "from agentrl.cluster.ray_session import start_ray\n"
            "start_ray(Config())\n"
            "print(ray.get(ray.remote(lambda: os.nice(0)).remote()), os.nice(0))\n"
            "ray.shutdown()\n")
    env = run_env()
    env.pop("RAY_worker_niceness", None)
    env["RAY_ADDRESS"] = "127.0.0.1:9"  # nothing listens there: joining it would fail
    proc = subprocess.run([str(BIN / "python"), "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    worker, driver = proc.stdout.split()[-2:]
    assert worker == driver


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value takes root (CAP_SYS_NICE)")
def test_actors_of_a_joined_cluster_return_to_nice_0():
    """A cluster started with `ray start` (no RAY_worker_niceness) runs workers at nice 15;
    the trainer and engine actors put themselves back at 0 (agentrl.cluster.ray_session.normal_priority)."""
    code = "import os\nfrom agentrl.cluster.ray_session import normal_priority\nnormal_priority()\nprint(os.nice(0))\n"
    proc = subprocess.run(["nice", "-n", "15", str(BIN / "python"), "-c", code], capture_output=True, text=True,
                          timeout=120, env=run_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "0"


def test_a_trainer_that_fails_to_build_says_what_it_raised():
    """Ray reports an actor whose constructor raised as "died (The actor died because of an error
    raised in its creation task ...)"; the user is told the constructor's own error instead: a
    ConfigError as itself, anything else named with its type."""
    from agentrl.errors import AgentRLError, ConfigError
    from agentrl.cluster.ray_session import init_failure

    ray_text = ("The actor died because of an error raised in its creation task, ray::TrainerWorker.__init__() "
                "(pid=1, ip=10.0.0.1)\n  File \"trainer.py\", line 70, in __init__\n    raise ConfigError(...)\n"
                "agentrl.errors.ConfigError: the Megatron trainer needs CUDA GPUs (on CPU use --trainer torch), "
                "has creation_task_exception_pb_bytes=1")
    err = init_failure("trainer rank 0", ray_text)
    assert type(err) is ConfigError and str(err) == "the Megatron trainer needs CUDA GPUs (on CPU use --trainer torch)"
    other = init_failure("trainer rank 1", ray_text.replace("agentrl.errors.ConfigError", "torch.OutOfMemoryError"))
    assert type(other) is AgentRLError and str(other).startswith("trainer rank 1 failed to start: torch.OutOfMemoryError")
