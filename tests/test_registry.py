import os
import subprocess
import sys
import textwrap

import pytest

import agentrl
from agentrl import registry
from agentrl.errors import EnvNotFoundError, EnvRegistrationError

from spine_helpers import agentrl_cli, run_env


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.delenv(registry.ENV_MODULES_VAR, raising=False)


def test_decorator_registers_and_make_builds():
    @agentrl.register_env("unit-echo")
    class Echo(agentrl.Env):
        """Echo env."""

        def __init__(self, word="hi"):
            self.word = word

        def reset(self, *, seed=None, options=None):
            return self.word, {}

    env = agentrl.make("unit-echo", word="yo")
    assert isinstance(env, Echo) and env.reset() == ("yo", {})
    agentrl.register_env("unit-echo")(Echo)  # the same object twice is fine


def test_taken_name_names_both_places():
    @agentrl.register_env("unit-dup")
    class A(agentrl.Env):
        pass

    with pytest.raises(EnvRegistrationError, match=r"unit-dup.*A \(registered at .*test_registry.py:\d+\).*B"):
        @agentrl.register_env("unit-dup")
        class B(agentrl.Env):
            pass


def test_unknown_env_lists_known_and_suggests():
    with pytest.raises(EnvNotFoundError, match=r"Did you mean target-token\?.*Known envs: .*target-token"):
        agentrl.make("target-tokn")


def test_factory_function_and_constructor_errors_name_the_env():
    @agentrl.register_env("unit-factory")
    def factory(n):
        if n < 0:
            raise ValueError("n must be >= 0")
        return agentrl.GymTextEnv.__new__(agentrl.GymTextEnv)

    assert isinstance(agentrl.make("unit-factory", n=1), agentrl.Env)
    with pytest.raises(ValueError) as info:
        agentrl.make("unit-factory", n=-1)
    assert "while building env 'unit-factory' with kwargs {'n': -1}" in "".join(info.value.__notes__)


@pytest.mark.e2e
def test_env_module_file_is_seen_by_a_subprocess(tmp_path):
    mod = tmp_path / "my_env.py"
    mod.write_text(textwrap.dedent('''
        import agentrl

        @agentrl.register_env("file-env")
        class FileEnv(agentrl.Env):
            description = "an env from a file"
    '''))
    registry.import_env_module(str(mod))
    registry.import_env_module(str(mod))  # importing twice does not register twice
    assert type(agentrl.make("file-env")).__name__ == "FileEnv"
    # A child process resolves the name from the recorded module, nothing pickled.
    code = "import agentrl; print(type(agentrl.make('file-env')).__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**run_env(), registry.ENV_MODULES_VAR: str(mod)})
    assert out.stdout.strip() == "FileEnv", out.stderr
    listing = subprocess.run([agentrl_cli(), "envs", "list", "--env-module", str(mod)], capture_output=True,
                             text=True, timeout=120, env=run_env())
    assert "file-env" in listing.stdout and "an env from a file" in listing.stdout
    assert "target-token" in listing.stdout and "entry point of agentrl" in listing.stdout


def test_env_modules_reach_children_through_the_environment_they_are_given(tmp_path, monkeypatch):
    mod = tmp_path / "kid_env.py"
    mod.write_text("import agentrl\n\n@agentrl.register_env('kid-env')\nclass KidEnv(agentrl.Env):\n    pass\n")
    registry.import_env_module(str(mod))
    assert registry.ENV_MODULES_VAR not in os.environ  # importing is no message to anyone
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(registry.ENV_MODULES_VAR, "given.module")  # what this process was started with
    assert registry.env_modules_environ(["kid_env.py", "json", "given.module"]) == {
        registry.ENV_MODULES_VAR: os.pathsep.join(["given.module", str(mod), "json"])}
    monkeypatch.delenv(registry.ENV_MODULES_VAR)
    assert registry.env_modules_environ([]) == {}


@pytest.mark.e2e
def test_envs_show_describes_an_env():
    out = subprocess.run([agentrl_cli(), "envs", "show", "target-token"], capture_output=True, text=True,
                         timeout=120, env=run_env())
    assert out.returncode == 0, out.stderr
    assert "agentrl.envs.target_token:TargetTokenEnv" in out.stdout
    assert "built-in task generator" in out.stdout


def test_gymnasium_text_env_is_wrapped():
    import gymnasium

    class Guess(gymnasium.Env):
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return "guess a number", {}

        def step(self, action):
            return "done", float(action.strip() == "4"), True, False, {}

    env = agentrl.GymTextEnv(Guess())
    assert env.reset(seed=0)[0] == "guess a number"
    assert env.step(" 4 ")[1] == 1.0
