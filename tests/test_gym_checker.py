"""gymnasium's own `check_env` on every built-in env and on `GymTextEnv`; the sync API of
async envs; seeded resets; `agentrl.make` on a spec."""

import asyncio
import threading
import warnings

import gymnasium
import pytest
from gymnasium import spaces
from gymnasium.utils.env_checker import check_env

import agentrl
from agentrl.env import ChatObservation, Env, GymTextEnv, TextSpace

BUILTIN = ["target-token", "math", "search-r1", "math-python", "code"]
# The checker drives the API; where the tools run is not its subject (None: host processes, fast).
KWARGS = {"math-python": {"sandbox": None}, "code": {"sandbox": None, "grader_sandbox": "local"}}


def checked(env) -> list[str]:
    """check_env's warnings (it warns through warnings.warn) on `env`; raises on a failed check."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env, skip_render_check=True)
    return [str(w.message) for w in caught]


def test_every_builtin_env_is_registered_and_checked_here():
    assert sorted(s.name for s in agentrl.list_envs() if s.qualified_name.startswith("agentrl.envs")) == sorted(BUILTIN)


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.slow
def test_builtin_env_passes_gymnasiums_check_env(name):
    env = agentrl.make(name, **KWARGS.get(name, {}))
    try:
        assert isinstance(env.action_space, spaces.Text) and isinstance(env.observation_space, ChatObservation)
        assert checked(env) == []
        # seeded (the checker compares observations only for gymnasium-registered envs): the same
        # seed gives the same task, another seed another one (for these seeds)
        first = [env.reset(seed=s)[0] for s in (1, 1, 2)]
        assert first[0] == first[1] != first[2]
    finally:
        env.close()


class Echo(gymnasium.Env):
    """A plain gymnasium env with text spaces: observes the last action, ends on 'stop'."""

    observation_space = spaces.Text(32)
    action_space = spaces.Text(8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "abc"[: 1 + int(self.np_random.integers(3))], {}

    def step(self, action):
        return action, float(len(action)), action == "stop", False, {}


def test_gym_text_env_is_a_real_wrapper_and_passes_the_checker():
    inner = Echo()
    assert checked(inner) == []
    env = GymTextEnv(inner, max_turns=3)
    assert isinstance(env, gymnasium.Wrapper) and isinstance(env, Env)
    assert env.unwrapped is inner and env.action_space is inner.action_space
    assert env.observation_space is inner.observation_space
    env.reset(seed=7)
    assert env.np_random is inner.np_random and env.max_turns == 3
    # the one warning a wrapper always gets: check the raw env (done above)
    assert [w for w in checked(env) if "different from the unwrapped" not in w] == []
    with pytest.raises(TypeError, match="Box"):
        GymTextEnv(gymnasium.make("CartPole-v1"))


def test_make_accepts_the_specs_list_envs_returns():
    spec = next(s for s in agentrl.list_envs() if s.name == "target-token")
    env = agentrl.make(spec, targets=["of"])
    assert env.reset(seed=0)[0] == "Repeat the word: " + " ".join(["of"] * 8)


class AsyncCounter(Env):
    """An async-only env: counts steps on state that lives on the loop that reset it."""

    max_turns = 3

    async def areset(self, *, seed=None, options=None):
        gymnasium.Env.reset(self, seed=seed)
        self.loop, self.steps, self.closed = asyncio.get_running_loop(), 0, False
        return f"start {int(self.np_random.integers(100))}", {}

    async def astep(self, action):
        assert asyncio.get_running_loop() is self.loop, "step ran on another loop than reset"
        self.steps += 1
        return [], float(self.steps), self.steps >= 2, False, {}

    async def aclose(self):
        self.closed = True


def test_async_only_env_answers_the_sync_api_from_a_thread_without_a_loop():
    env = AsyncCounter()
    results = []

    def play():
        results.append(env.reset(seed=3))
        results.append(env.step("a"))
        results.append(env.step("b"))
        env.close()

    worker = threading.Thread(target=play)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert results[0] == AsyncCounter().reset(seed=3)  # seeded: reproducible
    assert results[1][1:3] == (1.0, False) and results[2][1:3] == (2.0, True) and env.closed


def test_sync_call_inside_a_running_loop_says_to_await_the_async_one():
    async def inside_a_loop():
        with pytest.raises(RuntimeError, match="await areset"):
            AsyncCounter().reset(seed=0)

    asyncio.run(inside_a_loop())


def test_text_space_holds_any_string_and_samples_short_ones():
    space = TextSpace(max_length=100)
    assert "ünïcode ✓" in space and "x" * 101 not in space and 3 not in space
    space.seed(0)
    assert all(len(space.sample()) <= space.sample_length for _ in range(20))
    obs = ChatObservation()
    assert "text" in obs and [{"role": "tool", "content": "4"}] in obs and [] in obs
    assert [{"role": "assistant", "content": "x"}] not in obs and [{"content": "x"}] not in obs
