"""Issue-3 behaviour through `agentrl train`: a pip-installed third-party env found by its
entry point alone, --env-module, rows naming their env, and --custom-rm-path."""

import json
import subprocess
import sys
import textwrap

import pytest

from spine_helpers import agentrl_cli, run_env

TINY = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
        "--no-progress"]


def train(*args):
    return subprocess.run([agentrl_cli(), "train", *args], capture_output=True, text=True, timeout=600, env=run_env())


def rows(folder):
    return [json.loads(x) for x in (folder / "trajectories" / "rollout_00000.jsonl").read_text().splitlines()]


@pytest.mark.e2e
def test_pip_installed_package_registers_through_its_entry_point(tmp_path):
    pkg = tmp_path / "thirdparty"
    (pkg / "thirdparty_env").mkdir(parents=True)
    (pkg / "thirdparty_env" / "__init__.py").write_text(textwrap.dedent('''
        import agentrl

        class CountLetters(agentrl.Env):
            """Reward: the share of letters 'e' in the answer."""
            # no max_turns, as in gymnasium: the episode ends when step says terminated (turn 2)

            @classmethod
            def dataset(cls, seed=0, **kw):
                while True:
                    yield {"prompt": "write many e letters"}

            def reset(self, *, seed=None, options=None):
                self.turn = 0
                return options["prompt"], {}

            def step(self, action):
                self.turn += 1
                if self.turn == 1:
                    return "now more of them", 0.0, False, False, {}
                return [], action.count("e") / max(len(action), 1), True, False, {"from": "thirdparty"}
    '''))
    (pkg / "pyproject.toml").write_text(textwrap.dedent('''
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "agentrl-thirdparty-test-env"
        version = "0.0.1"
        [project.entry-points."agentrl.envs"]
        letters-e = "thirdparty_env:CountLetters"
        [tool.setuptools]
        packages = ["thirdparty_env"]
    '''))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(pkg)]
    subprocess.run(pip, check=True, timeout=300, capture_output=True)
    try:
        # `envs show` of an entry-point env: its docstring is its description
        show = subprocess.run([agentrl_cli(), "envs", "show", "letters-e"], env=run_env(),
                              capture_output=True, text=True, timeout=120)
        assert show.returncode == 0, show.stderr
        assert "description: Reward: the share of letters 'e' in the answer." in show.stdout, show.stdout
        assert "options:     (none)" in show.stdout and "entry point" in show.stdout.lower(), show.stdout
        assert "max turns:   until it terminates" in show.stdout, show.stdout
        out = tmp_path / "run"
        proc = train("--env", "letters-e", "--output-dir", str(out), "--rollout-max-tokens-per-turn", "8",
                     "--rollout-max-response-len", "64", *TINY)
        assert proc.returncode == 0, proc.stderr[-3000:]
        traj = rows(out)
        assert len(traj) == 4 and all(t["env_name"] == "letters-e" for t in traj)
        # both turns ran: the second, graded one too
        assert [(t["num_turns"], t["status"]) for t in traj] == [(2, "completed")] * 4, traj
        assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["turns_mean"] == 2.0
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", "agentrl-thirdparty-test-env"],
                       timeout=300, capture_output=True)


@pytest.mark.e2e
def test_env_module_rows_naming_envs_and_custom_reward(tmp_path):
    (tmp_path / "my_env.py").write_text(textwrap.dedent('''
        import agentrl

        @agentrl.register_env("always-half")
        class AlwaysHalf(agentrl.Env):
            max_turns = 1

            def reset(self, *, seed=None, options=None):
                return options["prompt"], {}

            def step(self, action):
                return [], 0.5, True, False, {}
    '''))
    (tmp_path / "rm.py").write_text(textwrap.dedent('''
        async def reward(args, sample):
            # slime's signature: args is the config, sample carries label and response
            return {"score": 1.0 if sample.label == "L2" else -1.0, "env": sample.metadata["env_reward"]}
    '''))
    data = tmp_path / "mixed.jsonl"
    data.write_text(json.dumps({"prompt": "Repeat the word: the", "label": "the", "env": "target-token"}) + "\n"
                    + json.dumps({"prompt": "anything", "label": "L2"}) + "\n")
    out = tmp_path / "run"
    proc = train("--env", "always-half", "--env-module", str(tmp_path / "my_env.py"), "--prompt-data", str(data),
                 "--output-dir", str(out), *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_env = {t["env_name"]: t for t in rows(out)}
    assert set(by_env) == {"target-token", "always-half"}
    assert by_env["always-half"]["reward"] == 0.5
    out2 = tmp_path / "run2"
    proc = train("--env", "always-half", "--env-module", str(tmp_path / "my_env.py"), "--prompt-data", str(data),
                 "--custom-rm-path", f"{tmp_path / 'rm.py'}:reward", "--output-dir", str(out2), *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = {t["metadata"]["label"]: t["reward"] for t in rows(out2)}
    assert rewards["L2"] == {"score": 1.0, "env": 0.5} and rewards["the"]["score"] == -1.0


@pytest.mark.e2e
def test_tool_env_runs_in_the_run_sandbox_pool_with_an_external_mcp_server(tmp_path):
    (tmp_path / "tool_env.py").write_text(textwrap.dedent('''
        import agentrl
        from agentrl.tools import ToolEnv

        @agentrl.register_env("py-tools")
        class PyTools(ToolEnv):
            builtin_tools = ("python",)
            max_turns = 2

            @classmethod
            def dataset(cls, seed=0, **kw):
                while True:
                    yield {"prompt": "compute 6*7 with python"}

            async def final_answer(self, action):
                return [], 1.0, True, False, {}
    '''))
    server = tmp_path / "ext_server.py"
    server.write_text(textwrap.dedent('''
        from mcp.server.mcpserver import MCPServer
        app = MCPServer("ext")

        @app.tool()
        def shout(text: str) -> str:
            """Upper-case the text."""
            return text.upper()

        app.run()
    '''))
    out = tmp_path / "run"
    proc = train("--env", "py-tools", "--env-module", str(tmp_path / "tool_env.py"), "--sandbox", "local",
                 "--mcp-server", f"ext={sys.executable} {server}", "--output-dir", str(out),
                 "--rollout-max-response-len", "24", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    traj = rows(out)
    assert all(t["status"] != "failed" for t in traj), [t["metadata"].get("error") for t in traj]
    # python's tool and the external server's tool both reached the model's template
    assert all("shout" in t["prompt_text"] and "python" in t["prompt_text"] for t in traj)
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert row["sandbox/acquired"] >= 1 and "sandbox/active" in row


# -- issue 21: every truncation says why; an env without a dataset trains from seeds ----------------
import asyncio  # noqa: E402

import agentrl  # noqa: E402
from agentrl.config import parse_config  # noqa: E402
from agentrl.progress import Progress  # noqa: E402
from agentrl.rollout.agent_loop import LoopSettings, Renderer, run_trajectory  # noqa: E402
from agentrl.rollout.manager import generate_rollout  # noqa: E402
from agentrl.build import build_prompt_source, turn_budget_warning  # noqa: E402
from agentrl.batches import rollout_metrics  # noqa: E402
from agentrl.types import SampleStatus  # noqa: E402
from test_agent_loop import ScriptedClient  # noqa: E402


class Talk(agentrl.Env):
    """Three turns; the env answers each with `reply`; truncates itself after turn `cut_at`."""

    max_turns = 3

    def __init__(self, reply="ok", cut_at=None):
        self.reply, self.cut_at = reply, cut_at

    def reset(self, *, seed=None, options=None):
        self.turn = 0
        return "talk", {}

    def step(self, action):
        self.turn += 1
        return self.reply, 0.0, False, self.turn == self.cut_at, {}


def truncation(tokenizer, env, replies, max_len, max_turns=3):
    settings = LoopSettings(max_response_len=max_len, max_turns=max_turns, sampling_params={"temperature": 1.0})
    s = asyncio.run(run_trajectory(env, {"prompt": "talk"}, renderer=Renderer(tokenizer, True),
                                   client=ScriptedClient(tokenizer, replies), settings=settings,
                                   trajectory_id="t", group_id=0, seed=0))
    assert s.status == SampleStatus.TRUNCATED, s.metadata.get("error")
    return s.metadata["truncation"], s.num_turns


def test_every_truncation_says_why(tokenizer):
    assert truncation(tokenizer, Talk(), ["a", "b", "c"], 500, max_turns=2) == ("max_turns", 2)
    assert truncation(tokenizer, Talk(cut_at=1), ["a", "b"], 500) == ("env", 1)
    assert truncation(tokenizer, Talk(), ["one two three four five six seven"], 4) == ("max_response_len", 1)
    # turn 1 fits; the env's long turn-2 message leaves the policy no room
    assert truncation(tokenizer, Talk(reply="word " * 40), ["a"], 30) == ("no room for another turn", 1)


class Endless(Talk):
    """Sets no max_turns and never terminates: the safety limit must end it, and say so."""

    max_turns = None


def test_an_env_without_max_turns_runs_to_the_safety_limit_and_it_is_loud(tokenizer, capsys):
    from agentrl.env import SAFETY_MAX_TURNS

    assert agentrl.Env.max_turns is None  # the default: until the env says terminated
    reason, turns = truncation(tokenizer, Endless(), ["a"] * SAFETY_MAX_TURNS, 10_000, max_turns=None)
    assert (reason, turns) == ("safety_max_turns", SAFETY_MAX_TURNS)
    # --max-turns (or the env's own) still wins, and is named as such
    assert truncation(tokenizer, Endless(), ["a"] * 5, 10_000, max_turns=2) == ("max_turns", 2)
    settings = LoopSettings(max_response_len=10_000, max_turns=None, sampling_params={"temperature": 1.0})
    sample = asyncio.run(run_trajectory(Endless(), {"prompt": "x"}, renderer=Renderer(tokenizer, True),
                                        client=ScriptedClient(tokenizer, ["a"] * SAFETY_MAX_TURNS),
                                        settings=settings, trajectory_id="t", group_id=0, seed=0))
    m = rollout_metrics(0, [sample], 1.0)
    assert m["truncated/safety_max_turns"] == 1
    Progress(enabled=False).iteration_done({**m, "tokens_per_s": 1.0})
    err = capsys.readouterr().err
    assert "truncated 1 (safety_max_turns 1)" in err
    assert f"warning: 1 episodes hit the safety limit of {SAFETY_MAX_TURNS} turns" in err and "--max-turns" in err


def test_truncation_reasons_are_counted_in_metrics_and_on_the_console(tokenizer, capsys):
    envs = [Talk(reply="word " * 40), Talk(reply="word " * 40), Talk()]
    samples = []
    for env, max_turns in zip(envs, (3, 3, 1)):
        settings = LoopSettings(max_response_len=30, max_turns=max_turns, sampling_params={"temperature": 1.0})
        samples.append(asyncio.run(run_trajectory(env, {"prompt": "x"}, renderer=Renderer(tokenizer, True),
                                                  client=ScriptedClient(tokenizer, ["a"]), settings=settings,
                                                  trajectory_id="t", group_id=0, seed=0)))
    m = rollout_metrics(0, samples, 1.0)
    assert m["status_truncated"] == 3
    assert m["truncated/no room for another turn"] == 2 and m["truncated/max_turns"] == 1
    Progress(enabled=False).iteration_done({**m, "tokens_per_s": 1.0})
    assert "truncated 3 (max_turns 1, no room for another turn 2)" in capsys.readouterr().err


class FromSeed(agentrl.Env):
    """No dataset: the episode is made from the seed alone, as gymnasium envs do."""

    max_turns = 1
    resets: list = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        FromSeed.resets.append((seed, options))
        return f"say {int(self.np_random.integers(1000))}", {}

    def step(self, action):
        return [], 1.0, True, False, {}


def test_an_env_without_a_dataset_trains_from_each_groups_seed(tokenizer):
    agentrl.register_env("from-seed-21")(FromSeed)
    cfg, _ = parse_config(["--env", "from-seed-21", "--seed", "5"])
    source = build_prompt_source(cfg, FromSeed)
    tasks = source.next_batch(3)
    assert tasks == [{}, {}, {}]
    FromSeed.resets.clear()
    samples = asyncio.run(generate_rollout(
        tasks, make_env=lambda name: (FromSeed(), "from-seed-21"), n_samples=2, renderer=Renderer(tokenizer, True),
        client=ScriptedClient(tokenizer, ["a"] * 6), run_seed=5, max_concurrency=4,
        settings_for=lambda env: LoopSettings(max_response_len=8, max_turns=1, sampling_params={})))
    assert all(s.status == SampleStatus.COMPLETED for s in samples)
    assert all(options is None for _, options in FromSeed.resets)
    by_group = {}
    for s in samples:
        by_group.setdefault(s.group_id, set()).add(tokenizer.decode(s.prompt_tokens))
    assert len(by_group) == 3 and all(len(prompts) == 1 for prompts in by_group.values())  # one seed per group
    assert len(set.union(*by_group.values())) == 3  # each group its own
    assert len({seed for seed, _ in FromSeed.resets}) == 3 and len(FromSeed.resets) == 6


@pytest.mark.e2e
def test_agentrl_train_runs_an_env_without_a_dataset_from_seeds(tmp_path):
    (tmp_path / "seed_env.py").write_text(textwrap.dedent('''
        import agentrl

        @agentrl.register_env("from-seed-cli")
        class FromSeedCli(agentrl.Env):
            """No dataset: the episode comes from the seed."""
            max_turns = 1

            def reset(self, *, seed=None, options=None):
                assert options is None, options
                super().reset(seed=seed)
                return f"say {int(self.np_random.integers(10**6))}", {}

            def step(self, action):
                return [], 1.0, True, False, {}
    '''))
    out = tmp_path / "run"
    proc = train("--env-module", str(tmp_path / "seed_env.py"), "--env", "from-seed-cli", "--output-dir", str(out),
                 *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    traj = rows(out)
    assert len(traj) == 4 and {t["status"] for t in traj} == {"completed"}
    prompts = {t["group_id"]: set() for t in traj}
    for t in traj:
        prompts[t["group_id"]].add(t["prompt_text"])
    # one seed per group: its members share the episode, the two groups differ
    assert len(prompts) == 2 and all(len(p) == 1 for p in prompts.values())
    assert len(set.union(*prompts.values())) == 2


def test_a_budget_that_cannot_fit_the_turns_is_warned_about():
    def warning(*flags):
        return turn_budget_warning(parse_config(["--env", "search-r1", *flags])[0],
                                   agentrl.registry.get_spec("search-r1").load())

    assert "--rollout-max-tokens-per-turn" in warning("--rollout-max-response-len", "48")
    assert "no room for a second one" in warning("--rollout-max-response-len", "300",
                                                 "--rollout-max-tokens-per-turn", "200")
    assert warning("--rollout-max-response-len", "1024", "--rollout-max-tokens-per-turn", "256") is None
    assert warning("--max-turns", "1", "--rollout-max-response-len", "48") is None


@pytest.mark.e2e
def test_envs_show_prints_the_docstring_and_real_options(tmp_path):
    (tmp_path / "doc_env.py").write_text(textwrap.dedent('''
        import agentrl

        @agentrl.register_env("doc-only")
        class DocOnly(agentrl.Env):
            """Described by its docstring alone.

            Details below the first line."""

        @agentrl.register_env("with-options")
        class WithOptions(agentrl.Env):
            def __init__(self, level: int = 2, name: str = "x"):
                pass
    '''))

    def show(name):
        proc = subprocess.run([agentrl_cli(), "envs", "show", name, "--env-module", str(tmp_path / "doc_env.py")],
                              capture_output=True, text=True, timeout=120, env=run_env())
        assert proc.returncode == 0, proc.stderr
        return dict(line.split(":", 1) for line in proc.stdout.splitlines()[:10] if ":" in line)

    doc_only = show("doc-only")
    assert doc_only["description"].strip() == "Described by its docstring alone."
    assert doc_only["options"].strip() == "(none)" and "from its seed" in doc_only["dataset"]
    assert show("with-options")["options"].strip() == "level: int = 2, name: str = 'x'"


def test_without_a_terminal_a_long_iteration_still_prints_progress(capsys):
    progress = Progress(enabled=True)  # stderr is not a TTY under pytest
    progress.plain_every_s = 0.0
    progress.advance_samples()
    progress.advance_samples()
    assert "rollout: 2 trajectories done" in capsys.readouterr().err
    # each phase names itself while it runs, with its progress: a long train step is not "rollout"
    progress.phase("train", "128 samples")
    progress.tick()
    err = capsys.readouterr().err
    assert "train: 0s (128 samples); rollout goes on: 2 trajectories done" in err and "  rollout:" not in err
    progress.phase("sync", "weights version 1")
    assert "sync: 0s (weights version 1)" in capsys.readouterr().err
    progress.phase("eval")
    progress.advance_eval_samples()
    assert "eval: 0s; 1 eval trajectories done" in capsys.readouterr().err
    progress.iteration_done({"rollout_id": 0, "reward_mean": 0.5, "response_len_mean": 3.0, "turns_mean": 1.0,
                             "tokens_per_s": 10.0, "rollout_s": 1.0})
    progress.phase("rollout")
    assert capsys.readouterr().err.splitlines()[-1] == "  rollout: 0 trajectories done"
    quiet = Progress(enabled=False)
    quiet.plain_every_s = 0.0
    quiet.advance_samples()
    assert capsys.readouterr().err == ""
