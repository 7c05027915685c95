"""Shared helpers of the built-in env tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGENTRL = Path(sys.executable).parent / "agentrl"


def train_one_iteration(env: str, out: Path, *extra: str, timeout: float = 240) -> list[dict]:
    """`agentrl train --env ENV` for one small iteration; returns the rows of metrics.jsonl."""
    cmd = [str(AGENTRL), "train", "--env", env, "--num-rollout", "1", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--output-dir", str(out), "--no-progress",
           *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert rows, "metrics.jsonl has no row"
    return rows


def trajectories(out: Path) -> list[dict]:
    rows = []
    for f in sorted((out / "trajectories").glob("*")):
        if f.suffix == ".jsonl":
            rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return rows


def tool_call(name: str, **arguments) -> str:
    """A model's turn that calls tool `name` (the <tool_call> JSON the built-in envs parse)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


async def episode(env, actions, task) -> list[tuple]:
    """`env` reset on `task`, then stepped with each action in turn: [(obs, info), step results...];
    the env is closed whatever happens."""
    try:
        steps = [await env.areset(seed=0, options=task)]
        for action in actions:
            steps.append(await env.astep(action))
        return steps
    finally:
        await env.aclose()


def sandbox_backend_or_skip(backend: str = "auto") -> str:
    """The sandbox backend `backend` resolves to here, or skip the test saying why."""
    import pytest

    try:
        from agentrl.sandboxes import resolve_backend

        kind = resolve_backend(backend)
    except Exception as exc:
        pytest.skip(f"no {backend} sandbox here: {exc}")
    if kind == "docker":
        from agentrl.sandboxes import DEFAULT_IMAGE
        from agentrl.sandboxes.image import image_recipe

        if image_recipe(DEFAULT_IMAGE) is None:
            pytest.skip(f"docker sandbox image {DEFAULT_IMAGE} is not built (agentrl sandbox build)")
    return kind


def assert_iteration_ok(out: Path, rows: list[dict], n: int = 4) -> None:
    """One row, n samples, none failed (else the failed trajectories' errors are shown)."""
    row = rows[0]
    failed = [(t["trajectory_id"], t["metadata"].get("error"), t["metadata"].get("traceback", "")[-1500:])
              for t in trajectories(out) if t["status"] == "failed"]
    assert row["num_samples"] == n and row["status_failed"] == 0 and not failed, failed
