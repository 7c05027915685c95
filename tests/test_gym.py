"""Issue-3 behaviour through `agentrl train`: a pip-installed third-party env found by its
entry point alone, --env-module, rows naming their env, and --custom-rm-path."""

import json
import subprocess
import sys
import textwrap

from spine_helpers import agentrl_cli, run_env

TINY = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
        "--no-progress"]


def train(*args):
    return subprocess.run([agentrl_cli(), "train", *args], capture_output=True, text=True, timeout=600, env=run_env())


def rows(folder):
    return [json.loads(x) for x in (folder / "trajectories" / "rollout_00000.jsonl").read_text().splitlines()]


def test_pip_installed_package_registers_through_its_entry_point(tmp_path):
    pkg = tmp_path / "thirdparty"
    (pkg / "thirdparty_env").mkdir(parents=True)
    (pkg / "thirdparty_env" / "__init__.py").write_text(textwrap.dedent('''
        import agentrl

        class CountLetters(agentrl.Env):
            """Reward: the share of letters 'e' in the answer."""
            max_turns = 1

            @classmethod
            def dataset(cls, seed=0, **kw):
                while True:
                    yield {"prompt": "write many e letters"}

            def reset(self, *, seed=None, options=None):
                return options["prompt"], {}

            def step(self, action):
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
        out = tmp_path / "run"
        proc = train("--env", "letters-e", "--output-dir", str(out), *TINY)
        assert proc.returncode == 0, proc.stderr[-3000:]
        traj = rows(out)
        assert len(traj) == 4 and all(t["env_name"] == "letters-e" and t["status"] != "failed" for t in traj)
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", "agentrl-thirdparty-test-env"],
                       timeout=300, capture_output=True)


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
