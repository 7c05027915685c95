"""The command line: `agentrl inspect RUN_DIR` (agentrl/cli.py delegates here) and
`python -m agentrl.inspect RUN_DIR`."""

from __future__ import annotations

import argparse
import sys

from agentrl.errors import AgentRLError

from .page import build_report
from .run_folder import DEFAULT_MAX_PER_ITERATION, DEFAULT_NUM_ITERATIONS, id_ranges


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentrl inspect",
        description="Write a self-contained HTML report of a run: curves, and the chosen iterations' trajectories "
                    "token by token (trained vs masked tokens, logprobs on hover, tool calls, rewards, timings), "
                    "with filters and search. Opens from the file system; nothing is fetched.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (agentrl train --output-dir)")
    parser.add_argument("--out", metavar="FILE", help="where to write the report (default: RUN_DIR/report.html)")
    parser.add_argument("--iterations", metavar="LIST",
                        help="iterations whose trajectories to include: 'all', or ids and ranges like 0,5,10 or 0-3 "
                             f"(default: up to {DEFAULT_NUM_ITERATIONS} spread over the run, first and last included)")
    parser.add_argument("--max-per-iteration", type=int, default=DEFAULT_MAX_PER_ITERATION, metavar="N",
                        help=f"trajectories per iteration at most; 0 for all (default: {DEFAULT_MAX_PER_ITERATION})")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="tokenizer folder (default: the run's checkpoint, else the model named in config.yaml)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_per_iteration < 0:
        parser.error("--max-per-iteration must be >= 0")
    try:
        path, data = build_report(args.run_dir, args.out, iterations=args.iterations,
                                  max_per_iteration=args.max_per_iteration, tokenizer=args.tokenizer)
    except AgentRLError as exc:
        print(f"agentrl inspect: error: {exc}", file=sys.stderr)
        return 2
    size = path.stat().st_size
    shown = sum(i["shown"] for i in data["iterations"])
    total = sum(i["total"] for i in data["iterations"])
    evals = sum(i["shown"] for i in data["evals"])
    print(f"wrote {path} ({size / 2**20:.1f} MiB): {len(data['metrics'])} iterations of metrics, "
          f"{shown} of {total} trajectories from iteration(s) {id_ranges([i['it'] for i in data['iterations']]) or '-'}"
          + (f", {evals} eval trajectories ({len(data['evals'])} evaluations)" if data["evals"] else ""))
    if not data["tokenizer"]["ok"]:
        print(f"note: no tokenizer ({data['tokenizer']['source']}): tokens are shown as ids", file=sys.stderr)
    print(f"open file://{path.resolve()}")
    return 0

