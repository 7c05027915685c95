"""A real pretrained model learning the built-in envs on a GPU: SmolLM2-135M-Instruct (built
by `agentrl model get` from the GGUF the kit carries: build_kit.sh m, then carry .gpukit/m1
and .gpukit/m2 one call each), `agentrl train` with SGLang, colocated, evaluated on held-out
data before training and every few iterations. Figures: bench/results/learning.md.
Iterations: AGENTRL_GPU_ITERS; trainer: AGENTRL_GPU_TRAINER (default megatron); the held-out gain
runs stop themselves AGENTRL_GPU_BUDGET_S (510) after the call started and go on from their last
checkpoint when the same command runs again on the machine."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from gpu_helpers import (COLOCATE, KIT, OUT, SGLANG, agentrl_train, iters, mean, needs_gpus, stream,
                         trajectories)

pytestmark = needs_gpus()

TRAINER = os.environ.get("AGENTRL_GPU_TRAINER", "megatron")
# the device call's clock: scripts/gpu/run.sh sets it before unpacking and installing; else collection's start
CALL_STARTED = float(os.environ.get("AGENTRL_CALL_STARTED") or time.time())


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from agentrl.model_get import get_model

    gguf = KIT / "smollm2.gguf"
    if not gguf.exists():
        pytest.skip("no SmolLM2 GGUF on this machine: build_kit.sh m, then carry .gpukit/m1 and .gpukit/m2")
    return get_model("smollm2-135m-instruct", KIT / "models" / "smollm2-135m-instruct", source=gguf)


def heldout_math(n: int = 200) -> Path:
    """Problems of the math env's generator under another seed, none of them in the training
    stream's first 50k (the run draws from seed 0)."""
    from agentrl.envs.math_env import generate

    seen = {t["prompt"] for t in generate(seed=0, n=50_000)}
    rows = [t for t in generate(seed=1, n=4 * n) if t["prompt"] not in seen][:n]
    path = OUT / "math_heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def real_model_run(name: str, model: Path, *args: str, n: int, timeout_s: float = 560):
    run, rows = agentrl_train(name, "--model", str(model), "--trainer", TRAINER, "--device", "cuda",
                              "--dtype", "bfloat16", *SGLANG, *COLOCATE, "--num-rollout", str(n), *args,
                              timeout_s=timeout_s)
    keys = ("reward_mean", "response_len_mean", "tool_calls_mean", "train_rollout_logprob_abs_diff", "rollout_s",
            "train_s", "iteration_s")
    for r in rows:
        evals = "  ".join(f"{k} {v:.3f}" for k, v in r.items() if k.startswith("eval") and k.endswith("reward_mean"))
        print(f"iter {r['rollout_id']}: " + "  ".join(f"{k} {r[k]:.3f}" for k in keys if k in r) + f"  {evals}")
    assert len(rows) == n
    assert_on_policy(rows)
    return run, rows


def assert_on_policy(rows: list[dict]) -> None:
    assert max(r["train_rollout_logprob_abs_diff"] for r in rows) < 0.05  # engine vs trainer, bf16


def resumable_run(name: str, model: Path, *args: str, n: int, save_interval: int = 2) -> tuple[Path, list[dict]]:
    """`real_model_run` over as many device calls as it takes: the run folder and its checkpoints stay
    on the machine's disk (KIT/runs/NAME); a call goes on from the last checkpoint and stops the run
    (SIGTERM) past AGENTRL_GPU_BUDGET_S; a call that finds the run finished only reads it. -> (run
    folder, its iterations' rows so far: a re-run iteration's last row, partial ones left out)."""
    run = KIT / "runs" / name
    checkpoints = run / "checkpoints"

    def prune() -> None:  # the latest whole checkpoint is all a later call needs (each ~2 GB at 135M)
        whole = sorted(c.parent for c in checkpoints.glob("iter_*/trainer_state.json"))
        for old in whole[:-1]:
            shutil.rmtree(old, ignore_errors=True)

    def rows_so_far() -> list[dict]:
        metrics = run / "metrics.jsonl"
        rows = {}
        for line in metrics.read_text().splitlines() if metrics.exists() else []:
            row = json.loads(line)
            if not row.get("partial"):
                rows[row["rollout_id"]] = row
        return [rows[k] for k in sorted(rows)]

    done = len(rows_so_far())
    if done < n:
        resume = ["--load", str(checkpoints)] if any(checkpoints.glob("iter_*/trainer_state.json")) else []
        print(f"{name}: {done} of {n} iterations on this machine" + (f"; going on from {checkpoints}" if resume else ""))
        cmd = [sys.executable, "-m", "agentrl.cli", "train", "--model", str(model), "--trainer", TRAINER, "--device",
               "cuda", "--dtype", "bfloat16", *SGLANG, *COLOCATE, "--num-rollout", str(n), *args, *resume,
               "--save", str(checkpoints), "--save-interval", str(save_interval), "--output-dir", str(run),
               "--no-progress"]
        # what is left of the call's budget (an SFT step before it took its share)
        budget = max(60.0, float(os.environ.get("AGENTRL_GPU_BUDGET_S", 510)) - (time.time() - CALL_STARTED))
        stop = threading.Event()
        pruner = threading.Thread(target=lambda: [prune() for _ in iter(lambda: stop.wait(20), True)], daemon=True)
        pruner.start()
        try:
            returncode = stream(cmd, OUT / f"{name}.log", budget, what=name)
            assert returncode == 0, f"{name}: agentrl train exited {returncode} (log: {OUT / (name + '.log')})"
        except TimeoutError:
            left = ("its iterations were done: the stop steps after them were cut" if len(rows_so_far()) >= n
                    else "the same command goes on from the last checkpoint")
            print(f"{name}: stopped after {budget:.0f} s of this call; {left}", flush=True)
        finally:
            stop.set()
            pruner.join()
    prune()
    rows = rows_so_far()
    if (run / "metrics.jsonl").exists():
        shutil.copy2(run / "metrics.jsonl", OUT / f"{name}.metrics.jsonl")
    return run, rows


def test_smollm2_math_heldout_reward_rises(smollm2):
    """GRPO on the math env's word problems: the held-out reward after training is clearly
    above the starting model's (evaluated before iteration 0, same data, same sampling)."""
    n = iters(60)
    _, rows = real_model_run(
        "smollm2_math", smollm2, "--env", "math", "--lr", "5e-6", "--rollout-batch-size", "32",
        "--n-samples-per-prompt", "8", "--global-batch-size", "256", "--micro-batch-size", "16",
        "--rollout-max-response-len", "384", "--eval-interval", "10", "--eval-prompt-data", "heldout",
        str(heldout_math()), "--n-samples-per-eval-prompt", "2", n=n)
    before = rows[0]["eval_before_train/heldout/reward_mean"]
    after = rows[-1]["eval/heldout/reward_mean"]
    print(f"held-out reward: before training {before:.3f}, after {n} iterations {after:.3f}")
    assert after >= before + 0.05, (before, after)


def test_smollm2_math_python_calls_tools(smollm2):
    """math-python in local (bubblewrap) sandboxes: the model's tool calls run in sandboxes
    during training (tool results per episode > 0), reward trend printed."""
    n = iters(10)
    run, rows = real_model_run(
        "smollm2_math_python", smollm2, "--env", "math-python", "--sandbox", "local", "--lr", "5e-6",
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "128",
        "--micro-batch-size", "8", n=n)
    calls = [r["tool_calls_mean"] for r in rows]
    print(f"tool results per episode: {calls}; reward first 3 {mean(r['reward_mean'] for r in rows[:3]):.3f}, "
          f"last 3 {mean(r['reward_mean'] for r in rows[-3:]):.3f}")
    assert all(r["status_failed"] == 0 for r in rows)
    assert max(calls) > 0, calls
    ran = [t for t in trajectories(run, n - 1) if t["metadata"].get("tool_calls")]
    assert ran, "no trajectory of the last iteration ran a tool"


# -- SFT on the envs' own demonstrations, then RL ----------------------------------------------------
# SmolLM2-135M-Instruct at temperature 1 writes no \boxed{} answer and calls no tool (held-out math
# reward 0.000 before and after 43 iterations; 0 tool calls in 8 math-python iterations): the issue's
# path is `agentrl sft` on demonstrations first (`agentrl demos`, each graded 1.0 by the env), then RL.
SFT_DEMOS = {"math": ["--n", "1024"], "search-r1": ["--n", "512"],
             # 1024, as math: 256 (16 SFT steps, loss 0.33) left the SFT model at 0.005 held-out, under the
             # constant answer's 0.020, still calling the tool at --max-turns (1x H200, 2026-12-03)
             "math-python": ["--n", "1024", "--concurrency", "16", "--env-kwargs", '{"sandbox": "local"}'],
             # the generator's train split (its test split is the held-out set below)
             "code": ["--n", "512", "--concurrency", "32", "--env-kwargs", '{"sandbox": "local"}']}


def agentrl_cmd(name: str, *args: str, timeout_s: float = 300) -> None:
    """`agentrl ARGS` (demos, sft) as a subprocess; its console goes to OUT/name.log."""
    import subprocess
    import sys

    with open(OUT / f"{name}.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "agentrl.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout_s)
    tail = (OUT / f"{name}.log").read_text()[-3000:]
    print(tail)
    assert proc.returncode == 0, f"{name}: agentrl {args[0]} exited {proc.returncode}"


def sft_model(base: Path, env: str) -> Path:
    """SmolLM2 after `agentrl sft` on `agentrl demos --env ENV` (cached on the machine's disk, so
    the RL step can run in the next device call)."""
    out = KIT / "models" / f"smollm2-sft-{env}"
    done = sorted((out / "checkpoints").glob("iter_*/model/config.json"))
    if done:
        return done[-1].parent
    demos = KIT / "demos" / f"demos_{env}.jsonl"  # carried (build_kit.sh d: tests/gpu/make_demos.py)
    if demos.exists():
        print(f"sft {env}: the carried demonstrations {demos} ({sum(1 for _ in demos.open())} rows)")
    else:
        demos = OUT / f"demos_{env}.jsonl"
        agentrl_cmd(f"demos_{env}", "demos", "--env", env, *SFT_DEMOS[env], "--out", str(demos), timeout_s=420)
    agentrl_cmd(f"sft_{env}", "sft", "--prompt-data", str(demos), "--model", str(base), "--trainer", TRAINER,
                "--device", "cuda", "--dtype", "bfloat16", "--num-epoch", "2", "--lr", "3e-5",
                "--global-batch-size", "32", "--micro-batch-size", "16", "--output-dir", str(out), "--no-progress",
                timeout_s=480)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    print(f"sft {env}: {len(rows)} steps, loss {rows[0]['loss']:.3f} -> {mean(r['loss'] for r in rows[-5:]):.3f}")
    assert mean(r["loss"] for r in rows[-5:]) < 0.5 * rows[0]["loss"]
    return sorted((out / "checkpoints").glob("iter_*/model/config.json"))[-1].parent


@pytest.mark.parametrize("env", list(SFT_DEMOS))
def test_smollm2_sft_on_demos(smollm2, env):
    """The SFT step alone (one device call): demos, then agentrl sft; loss at least halved."""
    assert (sft_model(smollm2, env) / "config.json").exists()


def heldout_search_r1() -> Path:
    """search-r1's test split (questions the demonstrations, drawn from train, never saw)."""
    from agentrl.envs.search_r1 import DATA_DIR, read_questions

    path = OUT / "search_r1_heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in read_questions(DATA_DIR / "test.jsonl")))
    return path


RL_AFTER_SFT = {
    "math": lambda: ["--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--global-batch-size", "256",
                     "--micro-batch-size", "16", "--rollout-max-response-len", "384", "--eval-interval", "10",
                     "--eval-prompt-data", "heldout", str(heldout_math(100)), "--n-samples-per-eval-prompt", "2"],
    "search-r1": lambda: ["--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "128",
                          "--micro-batch-size", "16", "--eval-interval", "10", "--eval-prompt-data", "heldout",
                          str(heldout_search_r1()), "--n-samples-per-eval-prompt", "4"],
    "math-python": lambda: ["--sandbox", "local", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
                            "--global-batch-size", "128", "--micro-batch-size", "8"],
}


@pytest.mark.parametrize("env", list(RL_AFTER_SFT))
def test_smollm2_rl_after_sft(smollm2, env):
    """RL from the SFT model: the held-out reward (math, search-r1: exact match) after training
    against the SFT model's own (evaluated before iteration 0), printed with the searches and
    tool calls per episode; math-python: its tool calls run in sandboxes."""
    n = iters(20)
    run, rows = real_model_run(f"smollm2_{env}_after_sft", sft_model(smollm2, env), "--env", env, "--lr", "1e-5",
                               *RL_AFTER_SFT[env](), n=n)
    first, last = mean(r["reward_mean"] for r in rows[:3]), mean(r["reward_mean"] for r in rows[-3:])
    print(f"{env} after SFT: train reward first 3 iterations {first:.3f}, last 3 {last:.3f}; tool calls per "
          f"episode first {rows[0]['tool_calls_mean']:.2f}, last {rows[-1]['tool_calls_mean']:.2f}")
    assert all(r["status_failed"] == 0 for r in rows)
    if env == "math-python":
        assert max(r["tool_calls_mean"] for r in rows) > 0
        return
    before, after = rows[0]["eval_before_train/heldout/reward_mean"], rows[-1]["eval/heldout/reward_mean"]
    print(f"{env} held-out reward: SFT model {before:.3f}, after {n} RL iterations {after:.3f}")
    assert after > before, (before, after)


# -- issue 36: a held-out gain per env, measured with its standard error, the same seed run twice --------
def heldout_code(n: int = 100) -> Path:
    """The code generator's test split (seed 1): statements the demonstrations and the training
    stream (train split) never contain, as env rows {prompt, label, metadata}."""
    from agentrl.envs.code_env.generator import generate

    path = OUT / "code_heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in generate(seed=1, split="test", n=n)))
    return path


def eval_rows(run: Path, after: bool) -> list[dict]:
    """The held-out set's trajectories: before training (the starting model) or after the last iteration."""
    if not after:
        return [json.loads(x) for x in (run / "trajectories" / "eval_heldout_before_train_00000.jsonl").read_text()
                .splitlines()]
    last = sorted((run / "trajectories").glob("eval_heldout_0*.jsonl"))[-1]
    return [json.loads(x) for x in last.read_text().splitlines()]


def reward_of(row: dict) -> float:
    r = row["reward"]
    return float(r.get("score", 0.0)) if isinstance(r, dict) else float(r)


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample std / sqrt(n))."""
    m = mean(xs)
    var = sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)
    return m, (var / len(xs)) ** 0.5


def paired_gain(before: list[dict], after: list[dict], score) -> tuple[float, float, int]:
    """The gain over the tasks evaluated both times, and its paired standard error: each task's mean
    score after minus before (a task is its prompt), the std of those differences / sqrt(tasks). The same
    held-out tasks are scored twice, so their spread in difficulty is no noise in the gain; and a task's
    samples count once, as one difference, where the unpaired se took them as independent."""
    def by_task(rows):
        out: dict[tuple, list[float]] = {}
        for r in rows:
            out.setdefault(tuple(r["prompt_tokens"]), []).append(score(r))
        return {k: mean(v) for k, v in out.items()}

    b, a = by_task(before), by_task(after)
    diffs = [a[k] - b[k] for k in b if k in a]
    if not diffs:
        raise AssertionError("no held-out task was evaluated both before and after training")
    return (*mean_se(diffs), len(diffs))


# per env: RL flags (search-r1's: lr 1e-5 unless `lr` says, 8 samples per prompt, --eval-interval 10), default
# iterations (each scenario one device call, about 8 minutes on one H100), held-out set
GAIN = {
    # 100 iterations (~3.5 s each): at 40 the gain was +0.085 and +0.102, at 70 +0.0975 (+- 0.034), the
    # held-out score rising about 0.05 every 35 iterations to the end (1x H200, 2026-12-02)
    "math": dict(iters=100, data=lambda: heldout_math(200), args=[
        "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--global-batch-size", "256",
        "--micro-batch-size", "16", "--rollout-max-response-len", "384", "--eval-interval", "50",
        "--n-samples-per-eval-prompt", "2"]),
    # math's 200 held-out problems (so the two compare), one sample each. After SFT on 1024 demonstrations
    # the model solves 0.990 of them with the tool (train reward 0.92-1.0: little left for RL to move), and
    # ~18 s an iteration fit 23 of 30 iterations in a device call (1x H200, 2026-12-03): 15 now
    "math-python": dict(iters=15, data=lambda: heldout_math(200), args=[
        "--sandbox", "local", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size",
        "128", "--micro-batch-size", "8", "--max-turns", "4", "--eval-interval", "30", "--n-samples-per-eval-prompt", "1"]),
    # 128 episodes an iteration ran as two waves (the pool's 62 sandboxes on a 128-GB machine) and a tool call
    # could hold an iteration 60 s: 12-27 s an iteration on 1x H200 (2026-12-03, two machines), 11 of 24 iterations
    # in a device call. Now one wave of 64 with 10-s tool calls (the hidden tests have 10 s a call too).
    # 20 iterations (11-22 s each) left the all-tests rate at 0.165 -> 0.160 and the share of tests
    # 0.230 -> 0.269 (+- 0.036), train reward flat (1x H200, 2026-12-03, fourth session); math needed 100
    # for +0.13: 60 now, three device calls. An endless loop the model wrote cost an iteration 20 s (its 10-s
    # tool call, then its 10-s hidden-test call: 2 of 6 iterations took 54 s, 2026-12-03, fifth session); the
    # generator's reference solutions run in milliseconds, so 5 s a tool call and 2 s a test call now.
    # A step moved the policy too little: at lr 1e-5, one Adam step an iteration (no clipping: clipfrac 0, grad
    # norm 0.16-0.27), 20 iterations left the train reward flat (0.236 -> 0.239); 60 of them were three device
    # calls and never finished. lr 2e-5 for 40 iterations moves it as far as 80 at 1e-5, in one or two calls
    "code": dict(iters=40, lr="2e-5", data=lambda: heldout_code(100), args=[
        "--sandbox", "local", "--sandbox-max-active", "64", "--env-kwargs", '{"tool_timeout": 5, "test_timeout": 2}',
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size",
        "64", "--micro-batch-size", "8", "--max-turns", "4", "--eval-interval", "20",
        "--n-samples-per-eval-prompt", "2"]),
}


# math without the tool on the same 200 held-out problems after its 100 RL iterations (0.435 +- 0.025,
# 1x H200, 2026-12-03, bench/results/learning.md): math-python's bar when math's scenario did not run
# on the machine
MATH_WITHOUT_TOOL = 0.435


def summary(env: str, run: Path, rows: list[dict]) -> dict:
    """Held-out before/after with standard errors, train reward trend, tool use; written to OUT."""
    before, after = eval_rows(run, after=False), eval_rows(run, after=True)
    (b, b_se), (a, a_se) = mean_se([reward_of(r) for r in before]), mean_se([reward_of(r) for r in after])
    (pb, pb_se), (pa, pa_se) = (mean_se([float(reward_of(r) >= 1.0) for r in rs]) for rs in (before, after))
    out = {"env": env, "iterations": len(rows), "heldout_episodes": len(after),
           "heldout_before": b, "heldout_before_se": b_se, "heldout_after": a, "heldout_after_se": a_se,
           "gain": a - b, "gain_se": (a_se ** 2 + b_se ** 2) ** 0.5,
           "pass_before": pb, "pass_after": pa, "pass_gain_se": (pb_se ** 2 + pa_se ** 2) ** 0.5,
           "train_first5": mean(r["reward_mean"] for r in rows[:5]), "train_last5": mean(r["reward_mean"] for r in rows[-5:]),
           "tool_use_after": mean((r.get("metadata") or {}).get("tool_calls", 0) > 0 for r in after),
           "tool_calls_mean_last": rows[-1].get("tool_calls_mean", 0.0)}
    for key, score in (("gain", reward_of), ("pass_gain", lambda r: float(reward_of(r) >= 1.0))):
        g, se, tasks = paired_gain(before, after, score)
        out.update({f"{key}_paired": g, f"{key}_paired_se": se, "heldout_tasks_paired": tasks})
    print(f"{env}: held-out {b:.3f} +- {b_se:.3f} -> {a:.3f} +- {a_se:.3f} (gain {a - b:+.3f} +- {out['gain_se']:.3f}, "
          f"{len(after)} episodes); all tests passed {out['pass_before']:.3f} -> {out['pass_after']:.3f}; train reward "
          f"first 5 {out['train_first5']:.3f}, last 5 {out['train_last5']:.3f}; episodes using a tool "
          f"{out['tool_use_after']:.2f}; paired over {out['heldout_tasks_paired']} tasks: gain "
          f"{out['gain_paired']:+.3f} +- {out['gain_paired_se']:.3f}, all tests passed {out['pass_gain_paired']:+.3f} +- "
          f"{out['pass_gain_paired_se']:.3f}", flush=True)
    return out


@pytest.mark.parametrize("attempt", ["first", "rerun"])
@pytest.mark.parametrize("env", list(GAIN))
def test_smollm2_heldout_gain(smollm2, env, attempt):
    """RL from the SFT model (test_smollm2_sft_on_demos[ENV] builds it, cached on the machine),
    the held-out set evaluated before training and after the last iteration; `rerun` is the same
    seed again (compared with the first run's summary when it is on this machine).
    math: gain >= 0.10 and the train reward rising; math-python: a tool in most episodes and the
    held-out reward above the SFT model's or above math's without the tool (math's summary when
    its scenario ran on this machine, else its recorded run), by two standard errors; code (local
    sandboxes): the all-tests pass rate rises by two paired standard errors (the same tasks before and after)."""
    cfg = GAIN[env]
    n = iters(cfg["iters"])
    name = f"smollm2_{env.replace('-', '_')}_gain_{attempt}"
    run, rows = resumable_run(name, sft_model(smollm2, env), "--env", env, "--lr", cfg.get("lr", "1e-5"),
                              "--seed", "0", *cfg["args"], "--eval-prompt-data", "heldout", str(cfg["data"]()), n=n)
    if len(rows) < n:
        pytest.skip(f"{name}: {len(rows)} of {n} iterations so far: run the same command again to go on")
    assert_on_policy(rows)
    assert all(r["status_failed"] == 0 for r in rows)
    out = summary(env, run, rows)
    (OUT / f"{name}.summary.json").write_text(json.dumps(out, indent=1))
    other = OUT / f"smollm2_{env.replace('-', '_')}_gain_{'first' if attempt == 'rerun' else 'rerun'}.summary.json"
    if other.exists():
        prev = json.loads(other.read_text())
        print(f"{env}: the other run of the same seed: held-out {prev['heldout_before']:.3f} -> "
              f"{prev['heldout_after']:.3f} (gain {prev['gain']:+.3f}); this run gain {out['gain']:+.3f}")
    if env == "math":
        assert out["gain"] >= 0.10, out
        assert out["train_last5"] > out["train_first5"], out
    elif env == "math-python":
        assert out["tool_use_after"] > 0.5, out
        math_run = OUT / f"smollm2_math_gain_{attempt}.summary.json"
        without_tool = json.loads(math_run.read_text())["heldout_after"] if math_run.exists() else MATH_WITHOUT_TOOL
        print(f"math-python held-out {out['heldout_after']:.3f}; SFT model {out['heldout_before']:.3f}; math without "
              f"the tool {without_tool:.3f}{'' if math_run.exists() else ' (its recorded run)'}")
        # by two standard errors: 0.005 -> 0.020 (+- 0.011) passed a bare `>` on 2026-12-03 while sitting
        # on the constant answer's floor
        assert out["gain"] > 2 * out["gain_se"] or out["heldout_after"] - without_tool > 2 * out["heldout_after_se"], out
    else:  # the same 100 tasks before and after: the paired test (paired_gain)
        assert out["pass_gain_paired"] > 2 * out["pass_gain_paired_se"], out
