"""Issue 20: failures are bounded (a hopeless run stops, naming its first failure), visible
(first failure of each kind reported with its traceback; progress counts) and lose nothing
(failed attempts kept with their tracebacks); bad input fails at start."""

import asyncio
import gc
import json
import random
import sys
import time

import pytest

import agentrl
from agentrl.cli import main as cli_main
from agentrl.data import PromptSource, read_rows
from agentrl.errors import ConfigError, DatasetError
from agentrl.registry import check_env_kwargs
from agentrl.rollout.agent_loop import LoopSettings
from agentrl.rollout.manager import GroupRunner
from agentrl.rollout.producer import RolloutFailedError, RolloutProducer
from agentrl.tools import ToolServerError, ToolSet
from agentrl.types import Sample, SampleStatus


class BrokenEnv(agentrl.Env):
    """Fault injection: every reset raises."""

    def reset(self, *, seed=None, options=None):
        raise RuntimeError("injected env fault")

    def step(self, action):
        raise AssertionError("never reached")


def producer_for(run_group, **kwargs):
    source = PromptSource([{"prompt": f"p{i}"} for i in range(50)], shuffle=False)
    return RolloutProducer(source=source, run_group=run_group, over_sampling=2, **kwargs)


def test_an_env_that_always_raises_stops_the_run_naming_it_with_its_traceback():
    reports = []
    runner = GroupRunner(make_env=lambda name: (BrokenEnv(), "broken"), n_samples=2, renderer=None, client=None,
                         settings_for=lambda env: LoopSettings(max_response_len=8, max_turns=1, sampling_params={}),
                         run_seed=0, max_concurrency=4)
    producer = producer_for(runner.run_group, max_group_retries=1, max_failed_groups=3, report=reports.append)

    async def run():
        try:
            with pytest.raises(RolloutFailedError) as err:
                await asyncio.wait_for(producer.next_batch(2), 30)
        finally:
            await producer.aclose()
        return str(err.value)

    t0 = time.monotonic()
    message = asyncio.run(run())
    assert time.monotonic() - t0 >= 0.75  # each retry backed off (1 s, less up to a quarter of jitter) before it ran
    assert "3 groups in a row failed, each tried 2 times" in message
    assert "env 'broken': RuntimeError" in message and "injected env fault" in message
    assert "Traceback (most recent call last)" in message and "in reset" in message  # where it happened
    # reported once, as it happened, not once per trajectory
    assert len(reports) == 1 and "first failure of its kind" in reports[0] and "Traceback" in reports[0]
    assert producer.dropped["failed"] == 3 and producer.retried >= 3
    kept = producer.take_failed()  # every failed attempt, with its traceback, for the trajectory files
    assert len(kept) >= 3 * 2 * 2 and all("Traceback" in s.metadata["traceback"] for s in kept)
    assert producer.take_failed() == []


def flaky_groups(p_fail: float, seed: int = 0):
    """Groups of 4 trajectories, each failing (infrastructure) with probability p_fail."""
    rng = random.Random(seed)

    async def run_group(task, group_id, attempt):
        await asyncio.sleep(0)
        return [Sample(prompt_tokens=[1], trajectory_id=f"g{group_id}-s{k}-a{attempt}", group_id=group_id,
                       env_name="flaky",
                       status=SampleStatus.FAILED if rng.random() < p_fail else SampleStatus.COMPLETED,
                       metadata={"error": "ConnectionError: sandbox gone", "traceback": "Traceback: ..."})
                for k in range(4)]

    return run_group


def test_an_env_that_sometimes_raises_trains_on_and_counts_its_failures():
    producer = producer_for(flaky_groups(0.1), report=lambda text: None, retry_backoff_s=0)  # default bound

    async def run():
        batches = [await producer.next_batch(4) for _ in range(25)]
        await producer.aclose()
        return batches

    batches = asyncio.run(run())
    assert all(len(b) == 16 and all(s.status == SampleStatus.COMPLETED for s in b) for b in batches)
    stats = producer.stats()
    assert stats["groups_retried"] > 0 and stats["trajectories_failed"] > 0
    assert producer.failures == {"env 'flaky': ConnectionError": stats["trajectories_failed"]}
    line = producer.status()
    assert "groups 0/4 ready" in line and "failed trajectories" in line and "groups retried" in line


def test_the_bound_counts_groups_in_a_row_and_none_never_stops():
    producer = producer_for(flaky_groups(0.5, seed=1), max_group_retries=0, max_failed_groups=None,
                            report=lambda text: None, retry_backoff_s=0)

    async def run():
        batch = await asyncio.wait_for(producer.next_batch(1), 30)
        await producer.aclose()
        return batch

    assert len(asyncio.run(run())) == 4  # a run that cannot be hopeless by the user's choice goes on
    assert producer.dropped["failed"] > 8


def test_env_kwargs_are_checked_against_the_constructor_at_start():
    class Env(agentrl.Env):
        def __init__(self, targets, max_turns: int = 1):
            self.targets = targets

    check_env_kwargs("e", Env, {"targets": ["x"], "max_turns": 2})
    with pytest.raises(ConfigError, match=r"--env-kwargs: env 'e' takes no argument 'targetz'\. Did you mean "
                                          r"'targets'\? It takes: targets, max_turns"):
        check_env_kwargs("e", Env, {"targetz": ["x"]})
    with pytest.raises(ConfigError, match="env 'e' needs targets"):
        check_env_kwargs("e", Env, {})
    check_env_kwargs("e", lambda **kw: None, {"anything": 1})  # **kwargs: nothing to check


def test_a_label_key_no_row_has_fails_naming_file_and_key(tmp_path):
    data = tmp_path / "good.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    with pytest.raises(DatasetError, match=rf"{data}: no row has the label key 'answerz' \(--label-key\); "
                                           r"the rows' keys are \['answer', 'prompt'\]"):
        read_rows(str(data), label_key="answerz")
    assert read_rows(str(data), label_key="answer")[0]["label"] == "2"
    assert read_rows(str(data))[0]["label"] is None  # the default key may be absent (envs without labels)


@pytest.mark.e2e
def test_a_mistyped_env_kwarg_or_label_key_fails_train_at_start(tmp_path, capsys):
    data = tmp_path / "good.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    out = str(tmp_path / "run")
    assert cli_main(["train", "--env", "target-token", "--env-kwargs", '{"targetz": ["x"]}', "--output-dir", out]) == 2
    assert "takes no argument 'targetz'. Did you mean 'targets'?" in capsys.readouterr().err
    assert cli_main(["train", "--env", "math", "--prompt-data", str(data), "--label-key", "answerz",
                     "--output-dir", out]) == 2
    assert "no row has the label key 'answerz'" in capsys.readouterr().err



@pytest.mark.e2e
def test_data_without_the_label_an_env_grades_against_fails_at_start(tmp_path, capsys):
    data = tmp_path / "answers.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "label": "2"}) + "\n" + json.dumps({"prompt": "2+2?", "answer": "4"})
                    + "\n" + json.dumps({"prompt": "echo", "env": "target-token"}) + "\n")
    with pytest.raises(DatasetError, match=rf"{data}:2: no label under 'label' \(--label-key\), which env 'math' "
                                           r"grades against; keys are \['answer', 'prompt'\]"):
        read_rows(str(data), label_needed_by="math")
    assert len(read_rows(str(data))) == 3  # an env without labels takes them
    data.write_text(json.dumps({"prompt": "1+1?", "label": "2"}) + "\n" + json.dumps({"prompt": "echo", "env": "x"}))
    assert len(read_rows(str(data), label_needed_by="math")) == 2  # a row for another env is that env's business
    data.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    for env in ("math", "math-python", "search-r1"):
        assert cli_main(["train", "--env", env, "--prompt-data", str(data), "--output-dir", str(tmp_path / "run")]) == 2
        assert (f"{data}: no row has the label key 'label' (--label-key), which env '{env}' grades against; the "
                "rows' keys are ['answer', 'prompt']") in capsys.readouterr().err
    assert cli_main(["train", "--env", "math", "--eval-prompt-data", "ev", str(data), "--output-dir",
                     str(tmp_path / "run")]) == 2
    assert f"{data}: no row has the label key 'label' (--label-key), which env 'math'" in capsys.readouterr().err

@pytest.mark.e2e
def test_a_mistyped_flag_suggests_the_right_one(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["train", "--num-rolout", "1", "--dry-run"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --num-rolout 1" in err and "--num-rolout: did you mean --num-rollout?" in err


def test_a_tool_server_that_never_starts_is_an_infrastructure_failure_without_noise(tmp_path):
    mute = tmp_path / "mute.py"
    mute.write_text("import time\ntime.sleep(120)\n")  # never answers MCP's initialize

    async def run():
        unhandled = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unhandled.append(ctx.get("message")))
        t0 = time.monotonic()
        with pytest.raises(ToolServerError, match="did not start within 1 s"):
            await ToolSet([f"mute={sys.executable} {mute}"], start_timeout=1).start()
        took = time.monotonic() - t0
        gc.collect()  # a future whose exception nobody read complains when collected
        await asyncio.sleep(0)
        return took, unhandled

    took, unhandled = asyncio.run(run())
    assert took < 20 and unhandled == []  # no "Future exception was never retrieved"


DEAD_TOOL_ENV = '''
import agentrl
from agentrl.tools import ToolEnv


@agentrl.register_env("dead-tools")
class DeadTools(ToolEnv):
    """Its one MCP server exits before answering initialize: the tools never start."""

    max_turns = 2
    mcp_servers = (f"dead={DEAD}",)

    @classmethod
    def dataset(cls, seed=0, **kw):
        while True:
            yield {"prompt": "use the tool"}

    async def final_answer(self, action):
        return [], 0.0, True, False, {}
'''


@pytest.mark.e2e
def test_a_tool_server_that_never_starts_stops_the_run_naming_it(tmp_path):
    import subprocess

    from spine_helpers import agentrl_cli, run_env

    dead = tmp_path / "dead_server.py"
    dead.write_text("import sys\nsys.stderr.write('cannot bind the index\\n')\nsys.exit(3)\n")
    (tmp_path / "dead_env.py").write_text(f"DEAD = {f'{sys.executable} {dead}'!r}\n" + DEAD_TOOL_ENV)
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.run([agentrl_cli(), "train", "--env-module", str(tmp_path / "dead_env.py"), "--env",
                           "dead-tools", "--num-rollout", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt",
                           "2", "--global-batch-size", "4", "--rollout-max-response-len", "8", "--no-progress",
                           "--max-failed-groups", "2", "--max-group-retries", "1", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=300, env=run_env())
    took = time.monotonic() - t0
    err = proc.stderr
    assert proc.returncode == 2, err[-3000:]
    # an infrastructure failure (retried, then bounded), named with the server and its traceback
    assert "2 groups in a row failed, each tried 2 times" in err and "env 'dead-tools': ToolServerError" in err, \
        err[-3000:]
    assert "MCP server 'dead'" in err and "cannot bind the index" in err  # the server and its own stderr
    assert "Traceback (most recent call last)" in err
    assert err.count("first failure of its kind") == 1
    # no noise: not the loop's complaints, nor a dead server's transport finalized after the loop closed
    for noise in ("Future exception was never retrieved", "Task was destroyed", "Exception ignored",
                  "Event loop is closed"):
        assert noise not in err, err[-3000:]
    saved = [json.loads(x) for x in (out / "trajectories" / "rollout_00000.jsonl").read_text().splitlines()]
    # each attempt: a failed member with its traceback; a sibling still starting was cancelled (aborted)
    failed = [t for t in saved if t["status"] == "failed"]
    assert len(saved) >= 2 * 2 * 2 and len(failed) >= 2 * 2 and \
        all("ToolServerError" in t["metadata"]["traceback"] for t in failed)
    assert all(t["status"] == "aborted" and t["metadata"]["aborted"] == "sibling failed"
               for t in saved if t not in failed)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == [rows[0]] and rows[0]["partial"] is True and rows[0]["dropped_failed"] >= 2
    print(f"run with a dead tool server stopped after {took:.1f}s")


ROLLOUT_FNS = '''
def boom(args, rollout_id, data_source):
    data_source.get_samples(1)
    raise ValueError("router down")


def half_failed(args, rollout_id, data_source):
    """Two groups: the first always has a failed member, the second fails from the second batch on."""
    groups = data_source.get_samples(2)
    for g, group in enumerate(groups):
        for k, s in enumerate(group):
            s.tokens = s.tokens + [s.tokens[0]]
            s.response_length, s.loss_mask, s.rollout_log_probs, s.reward = 1, [1], [-1.0], 1.0
            if k == 0 and (g == 0 or rollout_id > 0):
                s.status = s.Status.FAILED
                s.metadata["error"] = "TimeoutError: tool server"
    return groups
'''


def test_a_rollout_function_is_under_the_failure_bound(tokenizer, tmp_path):
    from agentrl.rollout.agent_loop import Renderer
    from agentrl.rollout.slime import DataSource, RolloutHook, SlimeArgs

    fns = tmp_path / "fns.py"
    fns.write_text(ROLLOUT_FNS)
    renderer, reports = Renderer(tokenizer), []

    def hook(name, **kw):
        return RolloutHook(f"{fns}:{name}", args=SlimeArgs(n_samples_per_prompt=2, env="target-token"),
                           renderer=renderer, make_env=None, reward_fn=None, run_seed=0, report=reports.append,
                           data_source=DataSource(PromptSource([{"prompt": "Repeat: of"}]), renderer, 2), **kw)

    # the function itself raising: no batch to retry, the run stops naming it, with its traceback
    with pytest.raises(RolloutFailedError, match=rf"--rollout-function-path {fns}:boom raised ValueError: "
                                                 r"router down\nTraceback \(most recent call last\)") as err:
        asyncio.run(hook("boom").next_batch(0, 0))
    assert f'File "{fns}", line 4, in boom' in str(err.value)

    # failed groups count in a row across batches: 1 (a good group resets it), then 2, then 2 more
    bounded = hook("half_failed", max_failed_groups=3)
    assert len(asyncio.run(bounded.next_batch(0, 0))) == 4 and bounded.failed_in_row == 0
    assert len(reports) == 1 and "first failure of its kind" in reports[0] and "TimeoutError" in reports[0]
    assert len(asyncio.run(bounded.next_batch(1, 1))) == 4 and bounded.failed_in_row == 2
    with pytest.raises(RolloutFailedError, match=r"4 groups in a row from --rollout-function-path .*half_failed "
                                                 r"had failed samples \(5 x env 'target-token': TimeoutError\); "
                                                 r"stopping \(--max-failed-groups 3\)\. The first failure: "
                                                 r"trajectory g0-s0"):
        asyncio.run(bounded.next_batch(2, 2))
    assert len(bounded.last_batch) == 4 and len(reports) == 1  # kept for the trajectory files; reported once
    unbounded = hook("half_failed", max_failed_groups=None)
    for rollout_id in range(4):
        asyncio.run(unbounded.next_batch(rollout_id, rollout_id))


def test_a_rollout_where_nothing_finishes_still_prints_its_state_without_a_terminal(capsys):
    from agentrl.progress import Progress
    from agentrl.train import heartbeat

    progress = Progress(enabled=True)  # stderr is not a TTY under pytest
    progress.plain_every_s = 0.2
    progress.detail = lambda: "groups 0/8 ready; groups retried 3"

    async def stalled():
        with heartbeat(progress, every_s=0.05):
            await asyncio.sleep(1.0)  # no trajectory finishes: only the timer ticks

    asyncio.run(stalled())
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert 3 <= len(lines) <= 6, lines  # one per plain_every_s, not one per tick
    assert all(x.strip() == "rollout: 0 trajectories done; groups 0/8 ready; groups retried 3" for x in lines)


@pytest.mark.e2e
def test_agentrl_train_with_an_env_that_sometimes_raises_trains_on_and_keeps_the_failures(tmp_path):
    """A real env under `agentrl train` that raises in 15% of its resets (an infrastructure
    fault): the run finishes every iteration, the failed trajectories are saved with their
    tracebacks, and the metrics count them."""
    import subprocess
    import textwrap

    from spine_helpers import agentrl_cli, run_env

    (tmp_path / "flaky_env.py").write_text(textwrap.dedent('''
        import random

        import agentrl

        FAULTS = random.Random(7)  # not the episode's seed: a retried group may succeed

        @agentrl.register_env("flaky-cli")
        class FlakyCli(agentrl.Env):
            """Raises in 15% of its resets."""
            max_turns = 1

            @classmethod
            def dataset(cls, seed=0, **kwargs):
                while True:
                    yield {"prompt": "say x", "label": None}

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                if FAULTS.random() < 0.15:
                    raise ConnectionError("injected flaky fault")
                return options["prompt"], {}

            def step(self, action):
                return [], 1.0, True, False, {}
    '''))
    out = tmp_path / "run"
    proc = subprocess.run([agentrl_cli(), "train", "--env-module", str(tmp_path / "flaky_env.py"), "--env", "flaky-cli",
                           "--output-dir", str(out), "--num-rollout", "3", "--rollout-batch-size", "4",
                           "--n-samples-per-prompt", "4", "--global-batch-size", "16", "--no-progress"],
                          capture_output=True, text=True, timeout=600, env=run_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in metrics] == [0, 1, 2] and not any(m.get("partial") for m in metrics)
    saved = [json.loads(x) for i in range(3) for x in (out / "trajectories" / f"rollout_{i:05d}.jsonl").read_text()
             .splitlines()]
    failed = [t for t in saved if t["status"] == "failed"]
    trained = [t for t in saved if t["status"] == "completed"]
    # every batch full (16 trained, none failed); the saved file also holds the failed attempts'
    # other members (completed before the fault, or cancelled at it)
    assert all(m["num_samples"] == 16 and m["status_completed"] == 16 for m in metrics), metrics
    assert len(trained) >= 3 * 16 and all(t["reward"] == 1.0 for t in trained)
    assert failed and all("injected flaky fault" in t["metadata"]["traceback"] for t in failed)
    assert sum(m["groups_retried"] for m in metrics) >= 1
    assert "injected flaky fault" in proc.stderr and "first failure of its kind" in proc.stderr  # shown once, as it happened
