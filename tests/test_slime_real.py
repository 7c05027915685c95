"""slime's own rollout code (THUDM/slime at 624b824), unchanged, through `agentrl train` for 2
iterations on the tiny model and the embedded engine: its default `generate`, its
`generate_rollout` with an rm_hub math reward, and the search-r1 example's `generate` and
`reward_func` (the pairing of its run_qwen2.5_3B.sh); masks and logprobs are checked in the
saved trajectories, and slime's search observation is compared with agentrl's search-r1.

Where slime comes from, first found: AGENTRL_SLIME_SRC (a folder holding slime's `slime/` and
`examples/search-r1/`); the fetched git mirror (AGENTRL_SLIME_GIT, by default
/work/.mirror/THUDM+slime/repo), whose commit 624b824 is extracted into a temp folder; an
installed slime. Skipped when there is none (a machine without the mirror). slime is never
copied into the project. Its modules import with agentrl's own dependencies plus pylatexenc
(the test extra): no stub modules."""

import ast
import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from spine_helpers import agentrl_cli, run_env

SLIME_COMMIT = "624b824"
SLIME_GIT = os.environ.get("AGENTRL_SLIME_GIT", "/work/.mirror/THUDM+slime/repo")
MODULES = ("slime.rollout.sglang_rollout", "slime.rollout.rm_hub", "generate_with_search", "generate_with_retool")

# An env that scores every response 0.5 (a reward of 0 or 1 in the trajectories was set by
# slime's code), and whose stop string, slime's args.rollout_stop, ends most of the tiny
# random model's turns within a few tokens (so slime's search-r1 loop gets to its observations).
HALF_ENV = '''
import agentrl

@agentrl.register_env("half")
class Half(agentrl.Env):
    max_turns = 1
    stop = ["e"]

    def reset(self, *, seed=None, options=None):  # no dataset: a seed-only task, the prompt made here
        super().reset(seed=seed)
        return (options or {}).get("prompt") or f"Tell me about the number {seed}.", {}

    def step(self, action):
        return [], 0.5, True, False, {}
'''


def slime_source(tmp: Path) -> Path | None:
    """A folder holding slime's source at SLIME_COMMIT, or None (slime installed, or absent)."""
    if os.environ.get("AGENTRL_SLIME_SRC"):
        return Path(os.environ["AGENTRL_SLIME_SRC"])
    if not Path(SLIME_GIT).is_dir():
        return None
    found = subprocess.run(["git", "--git-dir", SLIME_GIT, "cat-file", "-e", f"{SLIME_COMMIT}^{{commit}}"],
                           capture_output=True, timeout=60)
    if found.returncode != 0:
        pytest.fail(f"{SLIME_GIT} does not hold slime's commit {SLIME_COMMIT}")
    archive = subprocess.run(["git", "--git-dir", SLIME_GIT, "archive", SLIME_COMMIT, "slime", "examples/search-r1",
                              "examples/retool"],
                             capture_output=True, check=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True, timeout=120)
    return tmp


def installed_slime(env: dict) -> Path | None:
    """slime's __init__.py as a fresh interpreter with `env` finds it, or None. Not this process's
    find_spec: other tests' stand-in `slime` hook packages may be on its sys.path (xdist workers share one)."""
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; s = u.find_spec('slime'); "
                            "print(s.origin if s and s.origin else '')"], env=env, capture_output=True, text=True,
                           timeout=60)
    return Path(probe.stdout.strip()) if probe.returncode == 0 and probe.stdout.strip() else None


@pytest.fixture(scope="module")
def slime_env(tmp_path_factory):
    """The environment of `agentrl train` with slime and its search-r1 example importable."""
    tmp = tmp_path_factory.mktemp("slime")
    src = slime_source(tmp)
    env = run_env()
    installed = None if src is not None else installed_slime(env)
    if src is None and installed is None:
        pytest.skip(f"no slime source: set AGENTRL_SLIME_SRC, or fetch THUDM/slime into {SLIME_GIT}")
    example = (src or installed.parents[1]) / "examples" / "search-r1"
    (tmp / "half_env.py").write_text(HALF_ENV)
    # slime's search-r1 README: point SEARCH_R1_CONFIGS' local search_url at the retrieval server
    (tmp / "search_r1_config.py").write_text(textwrap.dedent('''
        import os
        import generate_with_search
        from generate_with_search import execute_predictions, generate, reward_func

        generate_with_search.SEARCH_R1_CONFIGS["local"]["search_url"] = os.environ["SEARCH_URL"]
    '''))
    paths = [str(p) for p in (src, example, example.parent / "retool", tmp) if p is not None]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    probe = subprocess.run([sys.executable, "-c", "; ".join(f"import {m}" for m in MODULES)],
                           env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, f"slime's modules do not import (run scripts/setup.sh):\n{probe.stderr[-3000:]}"
    env["HALF_ENV"] = str(tmp / "half_env.py")
    return env


@pytest.fixture(scope="module")
def retrieval():
    """Search-R1's POST /retrieve (search_r1/search/retrieval_server.py): passages {id, contents},
    wrapped as {"document", "score"} when return_scores is true. Yields its URL and the requests."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            docs = [[{"id": f"{q}-{i}", "contents": f'"Title {i}"\nAbout {q}: passage {i}.'}
                     for i in range(body["topk"])] for q in body["queries"]]
            result = [[{"document": d, "score": 9.0 - i} for i, d in enumerate(ds)] if body.get("return_scores")
                      else ds for ds in docs]
            data = json.dumps({"result": result}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/retrieve", seen
    server.shutdown()
    thread.join(timeout=10)


def train(env, out, *flags):
    proc = subprocess.run([agentrl_cli(), "train", "--env", "half", "--env-module", env["HALF_ENV"], *flags,
                           "--num-rollout", "2", "--output-dir", str(out),
                           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
                           "--rollout-max-response-len", "12", "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def trajectories(out, logprob_diff: float = 1e-3, on_policy: bool = True) -> list[list[dict]]:
    """Each iteration's saved trajectories, after checking the run: two iterations, the trainer's
    logprobs within `logprob_diff` of the engine's; every trajectory's mask and logprobs cover its
    response; the policy's tokens carry the engine's logprobs and that iteration's weights, the
    context tokens logprob 0 and no version (with `on_policy` False: that iteration's or an older one)."""
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in metrics] == [0, 1]
    assert metrics[0]["train_rollout_logprob_abs_diff"] < logprob_diff
    runs = []
    for it in (0, 1):
        rows = [json.loads(line) for line in (out / "trajectories" / f"rollout_{it:05d}.jsonl").read_text().splitlines()]
        assert len(rows) == 4
        for t in rows:
            n = len(t["response_tokens"])
            assert t["status"] in ("completed", "truncated"), t["metadata"].get("error")
            assert n > 0 and len(t["loss_mask"]) == n == len(t["rollout_logprobs"]) == len(t["policy_versions"])
            for m, lp, v in zip(t["loss_mask"], t["rollout_logprobs"], t["policy_versions"]):
                assert (lp < 0 and (v == it if on_policy else 0 <= v <= it)) if m else (lp == 0.0 and v == -1)
        runs.append(rows)
    return runs


@pytest.mark.e2e
def test_slimes_default_generate_trains(slime_env, tmp_path):
    """slime's generate (sglang_rollout.py): one /generate call, every token the policy's; the
    env has no dataset, so it makes each prompt from the group's seed; no reward set by slime,
    so agentrl's env scores (0.5)."""
    out = tmp_path / "run"
    train(slime_env, out, "--custom-generate-function-path", "slime.rollout.sglang_rollout.generate")
    for rows in trajectories(out):
        assert all(t["loss_mask"] == [1] * len(t["loss_mask"]) and t["reward"] == 0.5 for t in rows)


# A generate function as slime's sglang-config docs write one: the model's URL from slime's
# get_model_url (args.sglang_model_routers), the request through slime's http_utils.post.
MODEL_URL_GENERATE = '''
from slime.rollout.sglang_rollout import get_model_url
from slime.utils.http_utils import post


async def generate(args, sample, sampling_params):
    routers = args.sglang_model_routers
    assert routers == {"default": (args.sglang_router_ip, args.sglang_router_port)}, routers
    url = get_model_url(args, "default", "/generate")
    out = await post(url, {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True})
    pairs = out["meta_info"]["output_token_logprobs"]
    sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                  meta_info=out["meta_info"], text=out["text"])
    sample.metadata["url"] = url
    return sample
'''


@pytest.mark.e2e
def test_a_hook_finds_the_engines_with_slimes_get_model_url(slime_env, tmp_path):
    """args.sglang_model_routers as slime fills it (model name -> the router agentrl runs, here
    the one engine): slime's get_model_url gives the URL the run generates at."""
    fn = tmp_path / "by_name.py"
    fn.write_text(MODEL_URL_GENERATE)
    out = tmp_path / "run"
    train(slime_env, out, "--custom-generate-function-path", f"{fn}:generate")
    for rows in trajectories(out):
        assert all(t["metadata"]["url"].startswith("http://127.0.0.1:") and t["metadata"]["url"].endswith("/generate")
                   and t["reward"] == 0.5 for t in rows)


@pytest.mark.e2e
def test_slimes_generate_rollout_with_an_rm_hub_math_reward(slime_env, tmp_path):
    """slime's own generate_rollout: its GenerateState, semaphore (concurrency x engines),
    async_rm with the row's rm_type "math" (rm_hub's grade_answer_verl: 0 or 1, never the
    env's 0.5), and its abort against the engine's /workers and /v1/loads."""
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a}+{b}? Answer in \\boxed{{}}.", "label": str(a + b),
                                        "metadata": {"rm_type": "math"}}) + "\n" for a, b in [(2, 3), (4, 4), (1, 6)]))
    out = tmp_path / "run"
    proc = train(slime_env, out, "--prompt-data", str(data),
                 "--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout")
    assert "404" not in proc.stderr  # slime's abort found /workers and /v1/loads
    for rows in trajectories(out):
        assert all(t["loss_mask"] == [1] * len(t["loss_mask"]) and t["reward"] in (0.0, 1.0) for t in rows)


@pytest.mark.e2e
def test_slimes_search_r1_example_trains(slime_env, retrieval, tmp_path):
    """examples/search-r1: generate_with_search.generate with reward_func as --custom-rm-path
    (reward 0 for the tiny model's text, never the env's 0.5), on Search-R1-shaped rows (the
    chat prompt, the label under reward_model). The policy's turns are trained on; slime's
    observations (its invalid-action reply or an <information> block) are context."""
    from agentrl.envs.search_r1 import TEMPLATE
    from agentrl.models import build_tiny_model, load_tokenizer

    url, _ = retrieval
    data = tmp_path / "nq.jsonl"
    data.write_text("".join(json.dumps({
        "prompt": [{"role": "user", "content": TEMPLATE.format(question=q)}],
        "reward_model": {"style": "rule", "ground_truth": {"target": [a]}}}) + "\n"
        for q, a in [("Who founded Vrokath Works?", "Lomaerk Deloth"), ("Where is Quenmoor?", "Ostrava")]))
    out = tmp_path / "run"
    train({**slime_env, "SEARCH_URL": url}, out, "--prompt-data", str(data), "--label-key", "reward_model",
          "--custom-generate-function-path", "search_r1_config.generate",
          "--custom-rm-path", "search_r1_config.reward_func")
    tok = load_tokenizer(build_tiny_model())
    contexts = 0
    # slime's example sends text ("text": prompt_text + response), not token ids: the engine
    # re-tokenizes each turn, and the tiny model's stray byte tokens do not survive the text
    # round trip, so a second turn's logprobs were taken on a slightly different context.
    for rows in trajectories(out, logprob_diff=0.05):
        for t in rows:
            assert t["reward"] == 0.0 and t["loss_mask"][0] == 1
            mask, ids = t["loss_mask"], t["response_tokens"]
            cuts = [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]] + [len(mask)]
            start = 0
            for end in cuts:
                text = tok.decode(ids[start:end])
                if not mask[start]:  # slime's observation, as execute_predictions makes it
                    contexts += 1
                    assert (text.startswith("\n\n<information>") and text.endswith("</information>\n\n")) or \
                        text.startswith("\nMy previous action is invalid."), text
                start = end
    assert contexts > 0  # 12 random tokens hold no answer: a second turn followed an observation


@pytest.mark.slow
def test_slimes_retool_example_trains(slime_env, tmp_path):
    """examples/retool (its retool_qwen3_4b_rl.sh pairing): generate_with_retool.generate with
    its reward_func (math_dapo, strict \\boxed{}, a dict with the parsed answer as text) and
    --reward-key score, as the script passes them. The tiny model calls no tool, so every
    reward is the script's wrong-answer score (at most -0.6); the dict's text is dropped."""
    data = tmp_path / "dapo.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {n} + {n}?"}],
                                        "label": str(2 * n)}) + "\n" for n in range(4)))
    out = tmp_path / "run"
    train(slime_env, out, "--prompt-data", str(data), "--custom-generate-function-path", "generate_with_retool.generate",
          "--custom-rm-path", "generate_with_retool.reward_func", "--reward-key", "score",
          "--max-tokens-per-gpu", "4096")
    for rows in trajectories(out):
        for t in rows:
            assert set(t["reward"]) == {"score", "acc"} and t["reward"]["score"] <= -0.6, t["reward"]


@pytest.mark.slow
def test_slimes_fully_async_example_runs_with_async(slime_env, tmp_path):
    """examples/fully_async (train_async.py there, --async here): slime's
    generate_rollout_fully_async, whose own worker thread keeps generating between calls, with
    its script's --rm-type deepscaler (slime's generate_and_rm_group scores through the
    derived --custom-rm-path, agentrl's rm_hub)."""
    data = tmp_path / "dapo.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {n} + 1?"}],
                                        "label": str(n + 1)}) + "\n" for n in range(16)))
    out = tmp_path / "run"
    train(slime_env, out, "--prompt-data", str(data), "--async", "--rm-type", "deepscaler",
          "--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async")
    for rows in trajectories(out, logprob_diff=0.05, on_policy=False):  # generated ahead, under older weights
        assert all(t["reward"] == 0 for t in rows)  # no </think> in 12 random tokens: deepscaler's 0


@pytest.mark.slow
def test_slimes_search_observation_is_agentrl_search_r1s(slime_env, retrieval):
    """The same search, slime's execute_predictions against agentrl's search-r1 with
    observation="append", over one Search-R1 retrieval service: the same text, byte for byte."""
    from agentrl.envs.search_r1 import SearchR1Env

    url, seen = retrieval
    action = "<think>hm</think>\n<search> gamma ray </search>"
    script = f"import asyncio, search_r1_config as c; print(repr(asyncio.run(c.execute_predictions({action!r}))))"
    proc = subprocess.run([sys.executable, "-c", script], env={**slime_env, "SEARCH_URL": url},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    slime_obs, done = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert not done and seen[-1] == {"queries": ["gamma ray"], "topk": 3, "return_scores": False}

    async def ours():
        env = SearchR1Env(retriever_url=url, topk=3, observation="append")
        await env.areset(options={"prompt": "q", "label": ["x"]})
        try:
            return await env.astep(action)
        finally:
            await env.aclose()

    obs, *_ = asyncio.run(ours())
    assert obs[0]["content"] == slime_obs and obs[0]["continuation"]
    assert slime_obs.startswith('\n\n<information>Doc 1(Title: "Title 0") About gamma ray: passage 0.\n')
