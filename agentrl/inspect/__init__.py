"""`agentrl inspect RUN_DIR`: one self-contained HTML report of a run.

    agentrl inspect runs/search-r1-20250101-120000            # -> RUN_DIR/report.html
    agentrl inspect RUN_DIR --out /tmp/r.html --iterations 0,5,10 --max-per-iteration 16
    python -m agentrl.inspect RUN_DIR --iterations all

The report opens from the file system (no server, nothing fetched): the curves of
metrics.jsonl as inline SVG, then the chosen iterations' trajectories turn by turn, each
token decoded with the run's tokenizer and coloured by its loss mask (trained policy
tokens vs masked prompt/env/tool/template tokens), its rollout logprob and policy version
on hover, tool calls and results, reward, status and per-stage timings, with filters
(status, reward range, iteration) and a search box. Evaluation trajectories
(trajectories/eval_<name>_NNNNN.jsonl) are listed next to the iterations.

Model and env text is untrusted. The page (templates/report.html) is rendered by Jinja2
with autoescaping; the run's data is embedded as JSON in a non-executed
<script type="application/json"> block (with <, > and & escaped), and the page's own
script (static/report.js) inserts every piece of it with textContent, never as markup:
a trajectory containing <script> shows it as text.

Modules: run_folder (reading the run, choosing iterations and trajectories), tokens (the
tokenizer), data (the report's data), charts (curve geometry), page (rendering), cli.
"""

from .cli import main
from .data import build_trajectory, collect
from .page import build_report, render_html
from .run_folder import (DEFAULT_MAX_PER_ITERATION, DEFAULT_NUM_ITERATIONS, InspectError, eval_trajectory_files,
                         pick_trajectories, select_iterations)
from .tokens import Decoder, load_decoder

__all__ = ["DEFAULT_MAX_PER_ITERATION", "DEFAULT_NUM_ITERATIONS", "Decoder", "InspectError", "build_report",
           "build_trajectory", "collect", "eval_trajectory_files", "load_decoder", "main", "pick_trajectories",
           "render_html", "select_iterations"]
