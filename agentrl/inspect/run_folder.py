"""Reading a run folder: metrics.jsonl, trajectories/*.jsonl and config.yaml, and choosing
which iterations and trajectories the report shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

from agentrl.errors import AgentRLError

DEFAULT_MAX_PER_ITERATION = 64
DEFAULT_NUM_ITERATIONS = 5  # without --iterations: the first, the last and some in between
MAX_MESSAGE_CHARS = 20_000  # longer messages are cut in the report (tokens are never cut)
STATUSES = ("completed", "truncated", "aborted", "failed")


class InspectError(AgentRLError):
    """The run folder cannot be read or the options are wrong."""


def read_metrics_rows(path: Path) -> list[dict]:
    """metrics.jsonl, one row per iteration (the last one wins for a repeated rollout_id);
    malformed lines are skipped, not fatal: a run still being written may end mid-line."""
    rows: dict[int, dict] = {}
    if not path.exists():
        return []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("rollout_id"), int):
            rows[row["rollout_id"]] = row
    return [rows[k] for k in sorted(rows)]


def trajectory_files(run_dir: Path) -> dict[int, Path]:
    out = {}
    for p in sorted((run_dir / "trajectories").glob("rollout_*.jsonl")):
        try:
            out[int(p.stem.split("_", 1)[1])] = p
        except ValueError:
            continue
    return out


def eval_trajectory_files(run_dir: Path) -> list[tuple[str, int, Path]]:
    """(eval set, iteration, file) of trajectories/eval_<name>_NNNNN.jsonl, by iteration then name."""
    out = []
    for p in (run_dir / "trajectories").glob("eval_*.jsonl"):
        name, _, it = p.stem[len("eval_"):].rpartition("_")
        if name and it.isdigit():
            out.append((name, int(it), p))
    return sorted(out, key=lambda e: (e[1], e[0]))


def pick_evals(evals: list[tuple[str, int, Path]], chosen: list[int]) -> list[tuple[str, int, Path]]:
    """The evaluations after the chosen iterations, and the last evaluation."""
    last = max((it for _, it, _ in evals), default=None)
    return [e for e in evals if e[1] in chosen or e[1] == last]


def read_trajectories(path: Path) -> tuple[list[dict], int]:
    """Rows of one trajectories file, and how many lines could not be parsed."""
    rows, bad = [], 0
    with open(path, errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    return rows, bad


def read_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    if not path.exists():
        return {}
    try:
        import yaml

        data = yaml.safe_load(path.read_text())
        return data if isinstance(data, dict) else {}
    except Exception:
        return {}


def select_iterations(available: list[int], spec: str | None) -> list[int]:
    """`all`, a comma list of ids and ranges (0,5,10 or 0-3,8), or None: up to
    DEFAULT_NUM_ITERATIONS spread over the run, the first and the last included."""
    if not available:
        return []
    if spec is None or not spec.strip():
        if len(available) <= DEFAULT_NUM_ITERATIONS:
            return list(available)
        n = DEFAULT_NUM_ITERATIONS
        picks = {available[round(i * (len(available) - 1) / (n - 1))] for i in range(n)}
        return sorted(picks)
    if spec.strip().lower() == "all":
        return list(available)
    wanted: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        span = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
        try:
            if span:
                lo, hi = int(span.group(1)), int(span.group(2))
                wanted += [i for i in available if lo <= i <= hi] or [lo]
            else:
                value = int(part)  # negative: from the end (-1 is the last iteration)
                wanted.append(available[value] if value < 0 else value)
        except (ValueError, IndexError):
            raise InspectError(f"--iterations {spec!r}: expected 'all' or iteration ids like 0,5,10 or 0-3") from None
    missing = sorted(set(wanted) - set(available))
    if missing:
        raise InspectError(
            f"--iterations: no trajectories for iteration(s) {', '.join(map(str, missing))}; "
            f"the run has {id_ranges(available)}"
        )
    return sorted(set(wanted))


def id_ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'"""
    parts, start, prev = [], None, None
    for i in sorted(ids):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


def pick_trajectories(rows: list[dict], limit: int) -> list[int]:
    """Indexes of the rows to show, in file order: all when `limit` is 0 or enough; else the
    unusual ones first (failed, then aborted, then truncated: up to half the limit, at least
    one), then the rest in order."""
    if limit <= 0 or len(rows) <= limit:
        return list(range(len(rows)))
    rank = {"failed": 0, "aborted": 1, "truncated": 2}
    unusual = sorted((i for i, r in enumerate(rows) if r.get("status") in rank), key=lambda i: rank[rows[i]["status"]])
    chosen = set(unusual[: max(1, limit // 2)])
    for i in range(len(rows)):
        if len(chosen) >= limit:
            break
        chosen.add(i)
    return sorted(chosen)

