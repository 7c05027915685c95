"""The report page: templates/report.html rendered with Jinja2, static/report.css and
static/report.js inlined (the page is one file that opens from the file system).

Autoescaping is on for every template: run text (metric names, config values, error
messages) is escaped wherever it lands in the page. The trajectories reach the page's
script through `tojson`, which escapes <, > and & so no text can close the <script> block."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from markupsafe import Markup

from .charts import fmt, metric_charts
from .data import collect
from .run_folder import DEFAULT_MAX_PER_ITERATION, STATUSES, id_ranges

HERE = Path(__file__).parent
SUMMARY_KEYS = (("rollout", "rollout_batch_size"), ("rollout", "n_samples_per_prompt"),
                ("rollout", "rollout_max_response_len"), ("algo", "advantage_estimator"), ("train", "lr"))
TABLE_KEYS = ("reward_mean", "response_len_mean", "turns_mean", "rollout_s", "train_s", "tokens_per_s")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=jinja2.select_autoescape(["html"]), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    # tojson: the dict's own key order (a reward's parts show in the run's order), text as UTF-8
    env.policies["json.dumps_kwargs"] = {"ensure_ascii": False, "separators": (",", ":"), "default": str}
    return env


def _static(name: str) -> Markup:
    """Our own CSS or JS, inlined as it is (it is no template, and holds no run data)."""
    return Markup((HERE / "static" / name).read_text(encoding="utf-8"))


def iteration_rows(metrics: list[dict], its: list[dict], available: list[int]) -> list[dict]:
    """The iteration table: each iteration's numbers, status counts, and how many of its
    trajectories the report holds."""
    by_id = {r["rollout_id"]: r for r in metrics}
    shown = {i["it"]: i for i in its}
    rows = []
    for it in sorted(set(by_id) | set(available)):
        m = by_id.get(it, {})
        rows.append({
            "it": it,
            "cells": {k: fmt(m[k]) if isinstance(m.get(k), (int, float)) else "–" for k in TABLE_KEYS},
            "statuses": [(s, m[f"status_{s}"]) for s in STATUSES if m.get(f"status_{s}")],
            "info": shown.get(it),
            "in_run": it in available,
        })
    return rows


def _left_out_text(left_out: list[dict]) -> str:
    """'iterations 0, 5: 64 of 128 left out each; iteration 9: 3 of 67 left out'"""
    groups: dict[tuple[int, int], list[int]] = {}
    for i in left_out:
        groups.setdefault((i["total"] - i["shown"], i["total"]), []).append(i["it"])
    parts = []
    for (gone, total), its in groups.items():
        name = "iteration" if len(its) == 1 else "iterations"
        parts.append(f'{name} {id_ranges(its)}: {gone} of {total} left out{" each" if len(its) > 1 else ""}')
    return "; ".join(parts)


def _yaml(cfg: dict) -> str:
    try:
        import yaml

        return yaml.safe_dump(cfg, sort_keys=False)
    except Exception:
        return json.dumps(cfg, indent=2, default=str)


def render_html(data: dict) -> str:
    """The page for `collect()`'s dict."""
    its, evals = data["iterations"], data["evals"]
    cfg = data.get("config") or {}
    summary = [("run folder", data["run_dir"]), ("env", data.get("env") or "?"), ("model", data.get("model") or "?"),
               ("iterations", f'{len(data["metrics"])} logged'),
               ("tokenizer", data["tokenizer"]["source"] if data["tokenizer"]["ok"] else "none (token ids shown)")]
    summary += [(key, str(cfg[section][key])) for section, key in SUMMARY_KEYS
                if (cfg.get(section) or {}).get(key) is not None]
    left_out = [i for i in its if i["shown"] < i["total"]]
    main_charts, more_charts = metric_charts(data["metrics"])
    return _environment().get_template("report.html").render(
        css=_static("report.css"), js=_static("report.js"),
        statuses=STATUSES,
        name=data["name"], summary=summary, config_yaml=_yaml(cfg) if cfg else None,
        tokenizer=data["tokenizer"], max_per_iteration=data["max_per_iteration"],
        left_out=_left_out_text(left_out) if left_out else None,
        # only some iterations' trajectories are in the report: say which, and which the run has
        partial=(id_ranges([i["it"] for i in its]), id_ranges(data["available"]))
        if data["available"] and len(its) < len(data["available"]) else None,
        no_trajectories=not data["available"],
        evals=[f'{e["it"]} ({e["shown"]} of {e["total"]})' for e in evals],
        bad=[f'iteration {i["it"]}: {i["bad_lines"]}' for i in its + evals if i["bad_lines"]],
        has_metrics=bool(data["metrics"]), main_charts=main_charts, more_charts=more_charts,
        iterations=iteration_rows(data["metrics"], its, data["available"]),
        counts=f'{sum(i["shown"] for i in its + evals)} of {sum(i["total"] for i in its + evals)}',
        # what the page's script reads (the curves and the config are drawn here already)
        payload={k: v for k, v in data.items() if k not in ("metrics", "config")},
    )


def build_report(run_dir: str | Path, out: str | Path | None = None, *, iterations: str | None = None,
                 max_per_iteration: int = DEFAULT_MAX_PER_ITERATION, tokenizer: str | None = None) -> tuple[Path, dict]:
    """Write the report of `run_dir` (to RUN_DIR/report.html unless `out`); (its path, its data)."""
    run_dir = Path(run_dir)
    data = collect(run_dir, iterations=iterations, max_per_iteration=max_per_iteration, tokenizer=tokenizer)
    path = Path(out) if out else run_dir / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # a reader never sees half a page
    tmp.write_text(render_html(data), encoding="utf-8")
    tmp.replace(path)
    return path, data
