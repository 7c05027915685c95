"""Learning curves of the real-model GPU runs (tests/gpu/test_learning_gpu.py): train reward per
iteration and held-out reward at each evaluation, one panel per run, from the runs' metrics.jsonl,
over the held-out reward of a constant and of a random answer (bench/learning_baselines.py).

    python bench/learning_curves.py                       # bench/results/learning/*.metrics.jsonl
    python bench/learning_curves.py RUN.metrics.jsonl ... --out curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def baseline_env(run_name: str) -> str:
    """The env whose baselines go under a run's curves (math-python has math's problems)."""
    for prefix, env in (("search_r1", "search-r1"), ("math", "math"), ("code", "code"), ("smollm2_code", "code"),
                        ("smollm2_math", "math"), ("smollm2_search_r1", "search-r1")):
        if run_name.startswith(prefix):
            return env
    return ""


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, default=RESULTS / "learning.png")
    args = parser.parse_args()
    files = args.files or sorted((RESULTS / "learning").glob("*.metrics.jsonl"))
    base_file = RESULTS / "learning_baselines.json"  # python bench/learning_baselines.py
    baselines = json.loads(base_file.read_text()) if base_file.exists() else {}
    cols = min(5, len(files))
    grid = -(-len(files) // cols)
    fig, axes = plt.subplots(grid, cols, figsize=(4.2 * cols, 3.4 * grid), squeeze=False)
    for ax in axes.flat[len(files):]:
        ax.set_visible(False)
    for ax, path in zip(axes.flat, files):
        by_iteration = {}  # a run resumed across calls re-runs an iteration: its last whole row counts
        for line in filter(str.strip, path.read_text().splitlines()):
            row = json.loads(line)
            if not row.get("partial"):
                by_iteration[row["rollout_id"]] = row
        rows = [by_iteration[k] for k in sorted(by_iteration)]
        ax.plot([r["rollout_id"] for r in rows], [r["reward_mean"] for r in rows], label="train reward")
        evals = [(r["rollout_id"] if k.startswith("eval/") else -1, v) for r in rows for k, v in r.items()
                 if k.startswith("eval") and k.endswith("/reward_mean")]
        if evals:
            ax.plot(*zip(*sorted(evals)), "o-", label="held-out reward (-1: before RL)")
        if any(r.get("tool_calls_mean") for r in rows):
            ax.plot([r["rollout_id"] for r in rows], [r["tool_calls_mean"] / 10 for r in rows], "--",
                    label="tool calls / episode / 10")
        env = baseline_env(path.name)
        for kind, style in (("constant", ":"), ("random", "-.")):
            if env in baselines:
                ax.axhline(baselines[env][kind], color="grey", linestyle=style, linewidth=1,
                           label=f"{kind} answer (held-out)")
        ax.set_title(path.name.removesuffix(".metrics.jsonl"), fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylim(-0.02, 1.03)  # math-python after SFT sits at 0.98-1.0
        ax.legend(fontsize=7)
        for r in rows[:1]:
            print(f"{path.name}: {len(rows)} iterations, train reward {rows[0]['reward_mean']:.3f} -> "
                  f"{rows[-1]['reward_mean']:.3f}; held-out {[round(v, 3) for _, v in sorted(evals)]}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
