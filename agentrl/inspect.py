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

The run's data is embedded as JSON in a non-executed <script type="application/json">
block (with <, > and & escaped) and the page's own script inserts every piece of model
or env text with textContent, never as markup: a trajectory containing <script> shows it
as text.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterable

from agentrl.errors import AgentRLError

DEFAULT_MAX_PER_ITERATION = 64
DEFAULT_NUM_ITERATIONS = 5  # without --iterations: the first, the last and some in between
MAX_MESSAGE_CHARS = 20_000  # longer messages are cut in the report (tokens are never cut)
STATUSES = ("completed", "truncated", "aborted", "failed")


class InspectError(AgentRLError):
    """The run folder cannot be read or the options are wrong."""


# -- reading the run ---------------------------------------------------------------------------
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
            f"the run has {_ranges(available)}"
        )
    return sorted(set(wanted))


def _ranges(ids: list[int]) -> str:
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


# -- tokenizer ---------------------------------------------------------------------------------
class Decoder:
    """Token id -> text with the run's tokenizer (the fast `tokenizers` library when the folder
    has tokenizer.json, transformers' AutoTokenizer otherwise)."""

    def __init__(self, path: Path):
        self.path = path
        self._tok = None
        self._hf = None
        if (path / "tokenizer.json").exists():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(path))

    def decode(self, ids: list[int]) -> str:
        if self._tok is not None:
            return self._tok.decode(list(ids), skip_special_tokens=False)
        return self._hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def piece(self, token_id: int) -> str | None:
        """The vocabulary entry itself (e.g. byte-level 'Ã'), for tokens that decode to no whole character."""
        try:
            if self._tok is not None:
                return self._tok.id_to_token(int(token_id))
            return self._hf.convert_ids_to_tokens(int(token_id))
        except Exception:
            return None


def tokenizer_candidates(run_dir: Path, config: dict, explicit: str | None) -> list[tuple[Path, str]]:
    out: list[tuple[Path, str]] = []
    if explicit:
        out.append((Path(explicit), "--tokenizer"))
    ckpt_roots = [run_dir / "checkpoints"]
    save = (config.get("run") or {}).get("save")
    if save:
        ckpt_roots.append(Path(save))
    for root in ckpt_roots:
        for model_dir in sorted(root.glob("*/model"), reverse=True):  # the latest checkpoint first
            out.append((model_dir, f"checkpoint {model_dir}"))
    model = (config.get("model") or {}).get("model")
    if model:
        out.append((Path(model), f"the run's model (config.yaml model: {model})"))
    elif config:
        try:
            from agentrl.models import tiny_model_dir

            out.append((tiny_model_dir(), "the built-in tiny model (config.yaml model: null)"))
        except Exception:
            pass
    return out


def load_decoder(run_dir: Path, config: dict, explicit: str | None) -> tuple[Decoder | None, str]:
    """(decoder, where it came from) or (None, why none could be loaded)."""
    tried = []
    for path, source in tokenizer_candidates(run_dir, config, explicit):
        if not path.is_dir():
            tried.append(f"{source}: no such folder")
            continue
        files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
        if not any((path / f).exists() for f in files):
            tried.append(f"{source}: no tokenizer files")
            continue
        try:
            return Decoder(path), source if str(path) in source else f"{source} ({path})"
        except Exception as exc:
            tried.append(f"{source}: {type(exc).__name__}: {exc}")
    if explicit:
        raise InspectError(f"--tokenizer {explicit}: cannot load a tokenizer ({'; '.join(tried)})")
    return None, "; ".join(tried) or "no config.yaml and no checkpoint with a tokenizer in the run folder"


# -- building the report's data ----------------------------------------------------------------
def _rle(values: Iterable[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def _num(x: Any, digits: int = 4) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return round(x, digits) if math.isfinite(x) else None


def _text(value: Any, limit: int = MAX_MESSAGE_CHARS) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        try:
            value = json.dumps(value, ensure_ascii=False, default=str)
        except Exception:
            value = str(value)
    if len(value) > limit:
        value = value[:limit] + f"\n… [{len(value) - limit} more characters not shown]"
    return value


def _tool_calls(message: dict) -> list[dict]:
    """The tool calls in an assistant message: OpenAI-style `tool_calls`, or parsed from its text
    (Hermes/Qwen `<tool_call>` JSON, Qwen3-Coder XML) with agentrl's own parsers."""
    calls = []
    for call in message.get("tool_calls") or []:
        if not isinstance(call, dict):
            continue
        fn = call.get("function") if isinstance(call.get("function"), dict) else call
        calls.append({"name": _text(fn.get("name")), "arguments": _text(fn.get("arguments")), "id": _text(call.get("id"))})
    content = message.get("content")
    if calls or not isinstance(content, str) or "<tool_call>" not in content:
        return calls
    try:
        from agentrl.tools.parsers import ToolCall, parse_tool_calls

        parser = "qwen3_coder" if "<function=" in content else "hermes"
        for item in parse_tool_calls(content, parser):
            if isinstance(item, ToolCall):
                calls.append({"name": item.name, "arguments": _text(item.arguments), "id": item.id})
            else:
                calls.append({"name": _text(item.name), "error": _text(item.error), "raw": _text(item.raw), "id": item.id})
    except Exception:  # no parser available: show the raw blocks
        for i, block in enumerate(content.split("<tool_call>")[1:]):
            calls.append({"name": "", "raw": _text(block.split("</tool_call>")[0]), "id": f"call_{i}"})
    return calls


def _message(m: Any) -> dict:
    if not isinstance(m, dict):
        return {"role": "?", "content": _text(m)}
    out = {"role": _text(m.get("role", "?")), "content": _text(m.get("content"))}
    for key in ("name", "tool_call_id"):
        if m.get(key):
            out[key] = _text(m[key])
    return out


def build_trajectory(row: dict, iteration: int, decoder: Decoder | None, vocab: dict[int, str],
                     pieces: dict[int, str]) -> dict:
    prompt = [int(t) for t in row.get("prompt_tokens") or []]
    resp = [int(t) for t in row.get("response_tokens") or []]
    mask = [int(m) for m in row.get("loss_mask") or []]
    problems = []
    if len(mask) != len(resp):
        problems.append(f"loss_mask has {len(mask)} entries for {len(resp)} response tokens")
        mask = (mask + [0] * len(resp))[: len(resp)]
    logprobs = list(row.get("rollout_logprobs") or [])
    logprobs = (logprobs + [None] * len(resp))[: len(resp)]
    versions = [int(v) if isinstance(v, (int, float)) else -1 for v in row.get("policy_versions") or []]
    versions = (versions + [-1] * len(resp))[: len(resp)]

    reward = row.get("reward", 0.0)
    parts = None
    if isinstance(reward, dict):
        parts = {str(k): _num(v) for k, v in reward.items()}
        value = _num(reward.get("score", 0.0))
    else:
        value = _num(reward)

    metadata = dict(row.get("metadata") or {})
    label = metadata.pop("label", None)
    error = metadata.pop("error", None)
    tb = metadata.pop("traceback", None)

    messages = [m for m in row.get("messages") or []]
    first_assistant = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                           len(messages))
    turns: list[dict] = []
    for m in messages[first_assistant:]:
        if isinstance(m, dict) and m.get("role") == "assistant":
            turns.append({"assistant": _text(m.get("content")), "calls": _tool_calls(m), "obs": []})
        elif turns:
            turns[-1]["obs"].append(_message(m))

    timings = []
    for t in row.get("turn_timings") or []:
        if isinstance(t, dict):
            timings.append({str(k): _num(v) for k, v in t.items()})
    stage = {"generate_s": 0.0, "env_s": 0.0}
    for t in timings:
        for k, v in t.items():
            if v is not None:
                stage[k] = round(stage.get(k, 0.0) + v, 4)
    for key in ("reward_s", "rm_s", "reward_time_s"):
        if _num(metadata.get(key)) is not None:
            stage["reward_s"] = round(stage.get("reward_s", 0.0) + _num(metadata.pop(key)), 4)

    merges = {"p": [], "r": []}
    if decoder is not None:
        for ids in (prompt, resp):
            for t in ids:
                if t not in vocab:
                    try:
                        vocab[t] = decoder.decode([t])
                    except Exception:
                        vocab[t] = f"[{t}]"
                    if "\ufffd" in vocab[t]:
                        piece = decoder.piece(t)
                        if piece is not None:
                            pieces[t] = piece
        merges["p"] = _merges(prompt, [0] * len(prompt), decoder, vocab)
        merges["r"] = _merges(resp, mask, decoder, vocab)

    return {
        "it": iteration,
        "id": _text(row.get("trajectory_id") or ""),
        "env": _text(row.get("env_name") or ""),
        "group": row.get("group_id"),
        "status": str(row.get("status") or "completed"),
        "reward": value,
        "parts": parts,
        "turns": row.get("num_turns", len(turns)),
        "prompt": prompt,
        "resp": resp,
        "mask": _rle(mask),
        "lp": [_num(lp) for lp, m in zip(logprobs, mask) if m == 1],
        "ver": _rle(versions),
        "trained": sum(mask),
        "timings": timings,
        "stage": stage,
        "prompt_msgs": [_message(m) for m in messages[:first_assistant]],
        "turn_msgs": turns,
        "label": None if label is None else _text(label),
        "error": None if error is None else _text(error),
        "traceback": None if tb is None else _text(tb),
        "meta": {str(k): v for k, v in metadata.items()} if metadata else {},
        "merges": merges,
        "problems": problems,
    }


def _merges(ids: list[int], mask: list[int], decoder: Decoder, vocab: dict[int, str]) -> list[list]:
    """Runs of tokens that only decode to whole characters together (byte-level BPE splits a
    multi-byte character over several tokens): [start, length, text], shown as one span."""
    out, i, n = [], 0, len(ids)
    while i < n:
        step = 1
        if "\ufffd" in vocab.get(ids[i], ""):
            for k in range(2, 5):
                if i + k > n or mask[i + k - 1] != mask[i]:
                    break
                try:
                    text = decoder.decode(ids[i:i + k])
                except Exception:
                    break
                if "\ufffd" not in text:
                    out.append([i, k, text])
                    step = k
                    break
        i += step
    return out


def collect(run_dir: Path, *, iterations: str | None = None, max_per_iteration: int = DEFAULT_MAX_PER_ITERATION,
            tokenizer: str | None = None) -> dict:
    """Everything the report shows, as one JSON-able dict."""
    if not run_dir.is_dir():
        raise InspectError(f"{run_dir}: no such run folder")
    metrics = read_metrics_rows(run_dir / "metrics.jsonl")
    files = trajectory_files(run_dir)
    eval_files = eval_trajectory_files(run_dir)
    if not metrics and not files and not eval_files:
        raise InspectError(f"{run_dir}: no metrics.jsonl and no trajectories/rollout_*.jsonl: not a run folder "
                           "(agentrl train --output-dir writes one)")
    config = read_config(run_dir)
    chosen = select_iterations(sorted(files), iterations)
    decoder, tok_source = load_decoder(run_dir, config, tokenizer)

    vocab: dict[int, str] = {}
    pieces: dict[int, str] = {}
    trajs: list[dict] = []
    its: list[dict] = []

    def take(it, path: Path) -> dict:
        """One file's trajectories into `trajs`; its entry for the iteration menu."""
        rows, bad = read_trajectories(path)
        keep = pick_trajectories(rows, max_per_iteration)
        counts = {s: 0 for s in STATUSES}
        for r in rows:
            counts[str(r.get("status", "completed"))] = counts.get(str(r.get("status", "completed")), 0) + 1
        kept_counts = {s: 0 for s in STATUSES}
        for i in keep:
            try:
                t = build_trajectory(rows[i], it, decoder, vocab, pieces)
            except Exception as exc:  # one odd row must not sink the report
                t = {"it": it, "id": _text(rows[i].get("trajectory_id", f"row {i}")), "status": "failed",
                     "reward": None, "prompt": [], "resp": [], "mask": [], "lp": [], "ver": [], "trained": 0,
                     "timings": [], "stage": {}, "prompt_msgs": [], "turn_msgs": [], "meta": {},
                     "merges": {"p": [], "r": []}, "problems": [f"cannot show this row: {type(exc).__name__}: {exc}"]}
            kept_counts[t["status"]] = kept_counts.get(t["status"], 0) + 1
            trajs.append(t)
        return {"it": it, "total": len(rows), "shown": len(keep), "bad_lines": bad, "counts": counts,
                "shown_counts": kept_counts}

    for it in chosen:
        its.append(take(it, files[it]))
    # evaluations: trajectories/eval_<name>_NNNNN.jsonl, listed in the menu as "eval NAME @NNNNN"
    evals = [take(f"eval {name} @{at}", path) | {"eval": name, "at": at}
             for name, at, path in pick_evals(eval_files, chosen)]

    run = (config.get("run") or {})
    model = (config.get("model") or {}).get("model")
    return {
        "run_dir": str(run_dir.resolve()),
        "name": run_dir.resolve().name,
        "env": run.get("env"),
        "model": model if model else ("built-in tiny model" if config else None),
        "config": config,
        "metrics": metrics,
        "available": sorted(files),
        "iterations": its,
        "evals": evals,
        "max_per_iteration": max_per_iteration,
        "tokenizer": {"ok": decoder is not None, "source": tok_source},
        "vocab": {str(k): v for k, v in vocab.items()},
        "pieces": {str(k): v for k, v in pieces.items()},
        "trajs": trajs,
    }


# -- charts (inline SVG, drawn here: the page needs no script to show them) ---------------------
PALETTE = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777"]


def _nice_ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    ticks, v = [], start
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 10))
        v += step
    return ticks


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 10000 or a < 0.01:
        return f"{v:.2g}"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def svg_chart(title: str, series: list[tuple[str, list[tuple[int, float | None]]]], *, key: str = "",
              width: int = 400, height: int = 210, band: list[tuple[int, float, float]] | None = None,
              xlim: tuple[int, int] | None = None) -> str:
    """A line chart: one <path class="series" data-points=N> per series (iterations without a
    value are skipped, the line joins the ones around them), a dot with a <title> per point,
    y ticks, the first and last iteration on x (`xlim`: the same x range for every chart)."""
    left, right, top, bottom = 46, 10, 26, 28
    pts = [(x, y) for _, s in series for x, y in s if y is not None]
    esc = html.escape
    head = f'<figure class="chart" data-key="{esc(key or title)}"><figcaption>{esc(title)}</figcaption>'
    if not pts:
        return head + '<div class="chart-empty">no data</div></figure>'
    xs = [x for x, _ in pts]
    ys = [y for _, y in pts] + ([lo for _, lo, _ in band] + [hi for _, _, hi in band] if band else [])
    x0, x1 = (min(xs), max(xs)) if xlim is None else (min(xlim[0], min(xs)), max(xlim[1], max(xs)))
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = min(ys), max(ys)
    if y0 == y1:
        y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)
    else:
        pad = (y1 - y0) * 0.06
        y0, y1 = y0 - pad, y1 + pad
    pw, ph = width - left - right, height - top - bottom

    def sx(x):
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y):
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    out = [head, f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                 f'viewBox="0 0 {width} {height}" role="img" aria-label="{esc(title)}">']
    for t in _nice_ticks(y0, y1):
        y = sy(t)
        out.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
                   f'<text class="tick" x="{left - 4}" y="{y + 3:.1f}" text-anchor="end">{esc(_fmt(t))}</text>')
    out.append(f'<line class="axis" x1="{left}" x2="{left}" y1="{top}" y2="{top + ph}"/>'
               f'<line class="axis" x1="{left}" x2="{width - right}" y1="{top + ph}" y2="{top + ph}"/>')
    xt = sorted({x0, x1, (x0 + x1) // 2} if x1 - x0 >= 2 and xlim else {min(xs), max(xs)})
    for x in xt:
        out.append(f'<text class="tick" x="{sx(x):.1f}" y="{height - bottom + 14}" text-anchor="middle">{x}</text>')
    out.append(f'<text class="tick" x="{left + pw / 2:.1f}" y="{height - 3}" text-anchor="middle">iteration</text>')
    if band:
        upper = " L ".join(f"{sx(x):.1f} {sy(hi):.1f}" for x, _, hi in band)
        lower = " L ".join(f"{sx(x):.1f} {sy(lo):.1f}" for x, lo, _ in reversed(band))
        out.append(f'<path class="band" d="M {upper} L {lower} Z"/>')
    for i, (name, s) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        d = []
        for x, y in s:
            if y is not None:
                d.append(f"{'L' if d else 'M'} {sx(x):.1f} {sy(y):.1f}")
        n = len(d)
        out.append(f'<path class="series" data-name="{esc(name)}" data-points="{n}" d="{" ".join(d)}" '
                   f'stroke="{color}" fill="none" stroke-width="2"/>')
        for x, y in s:
            if y is not None:
                out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.6" fill="{color}">'
                           f'<title>{esc(name)} · iteration {x}: {esc(_fmt(y) if abs(y) >= 0.01 else repr(y))}</title></circle>')
    if len(series) > 1:
        lx = left + 6
        for i, (name, _) in enumerate(series):
            label = name if len(name) <= 24 else name[:23] + "…"
            out.append(f'<rect x="{lx}" y="{top - 16}" width="9" height="9" fill="{PALETTE[i % len(PALETTE)]}"/>'
                       f'<text class="legend" x="{lx + 12}" y="{top - 8}">{esc(label)}</text>')
            lx += 18 + 6.2 * len(label)
    out.append("</svg></figure>")
    return "".join(out)


def charts_html(metrics: list[dict]) -> tuple[str, str]:
    """(the main charts, the charts of every other numeric metric)."""
    if not metrics:
        return '<p class="note">No metrics.jsonl in the run folder: no curves.</p>', ""

    def series(key):
        return [(r["rollout_id"], _num(r.get(key), 8)) for r in metrics]

    keys = []
    for r in metrics:
        for k, v in r.items():
            if k not in keys and k != "rollout_id" and isinstance(v, (int, float)) and not isinstance(v, bool):
                keys.append(k)
    used: set[str] = {"rollout_id"}
    charts = []
    xlim = (metrics[0]["rollout_id"], metrics[-1]["rollout_id"])

    def chart(title, names, key=None, labels=None, band=None):
        present = [n for n in names if n in keys]
        if not present:
            return
        used.update(present)
        charts.append(svg_chart(title, [((labels or {}).get(n, n), series(n)) for n in present], key=key or present[0],
                                band=band, xlim=xlim))

    band = None
    if "reward_mean" in keys and "reward_std" in keys:
        band = [(r["rollout_id"], r["reward_mean"] - r["reward_std"], r["reward_mean"] + r["reward_std"])
                for r in metrics if isinstance(r.get("reward_mean"), (int, float)) and isinstance(r.get("reward_std"), (int, float))]
        used.add("reward_std")
    chart("reward (mean, ± std shaded)" if band else "reward (mean)", ["reward_mean"], key="reward", band=band)
    evals = [k for k in keys if k.startswith("eval/") and k.endswith("/reward_mean")]
    chart("eval reward (mean)", evals, key="eval", labels={k: k.split("/")[1] for k in evals})
    chart("response length (tokens, mean)", ["response_len_mean"], key="length")
    chart("turns per trajectory (mean)", ["turns_mean"], key="turns")
    chart("trajectories by status", [f"status_{s}" for s in STATUSES], key="status",
          labels={f"status_{s}": s for s in STATUSES})
    chart("seconds per iteration", ["rollout_s", "train_s", "weight_sync_s"], key="time",
          labels={"rollout_s": "rollout", "train_s": "train", "weight_sync_s": "weight sync"})
    chart("seconds per turn (mean)", ["generate_s_mean", "env_s_mean"], key="stage",
          labels={"generate_s_mean": "generation", "env_s_mean": "env/tool"})
    chart("generated tokens per second", ["tokens_per_s"], key="throughput")
    rest = [svg_chart(k, [(k, series(k))], key=k, width=300, height=170, xlim=xlim) for k in keys if k not in used]
    return "".join(charts), "".join(rest)


def iteration_table(metrics: list[dict], its: list[dict], available: list[int]) -> str:
    by_id = {r["rollout_id"]: r for r in metrics}
    shown = {i["it"]: i for i in its}
    ids = sorted(set(by_id) | set(available))
    esc = html.escape
    if not ids:
        return ""
    rows = []
    for it in ids:
        m = by_id.get(it, {})
        info = shown.get(it)

        def cell(key, digits=3):
            v = m.get(key)
            return f"<td>{esc(_fmt(v)) if isinstance(v, (int, float)) else '–'}</td>"

        status = " ".join(f'<span class="badge st-{s}">{s} {m.get(f"status_{s}")}</span>'
                          for s in STATUSES if m.get(f"status_{s}"))
        if info:
            link = (f'<button class="it-link" data-it="{it}">show {info["shown"]}'
                    f'{" of " + str(info["total"]) if info["shown"] < info["total"] else ""}</button>')
        elif it in available:
            link = '<span class="muted">not in report</span>'
        else:
            link = '<span class="muted">no trajectories</span>'
        rows.append(f"<tr><td>{it}</td>{cell('reward_mean')}{cell('response_len_mean')}{cell('turns_mean')}"
                    f"<td>{status}</td>{cell('rollout_s')}{cell('train_s')}{cell('tokens_per_s')}<td>{link}</td></tr>")
    return ('<table class="its"><thead><tr><th>iteration</th><th>reward</th><th>length</th><th>turns</th>'
            '<th>status</th><th>rollout s</th><th>train s</th><th>tokens/s</th><th>trajectories</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


# -- the page ----------------------------------------------------------------------------------
def _json_for_script(data: Any) -> str:
    """JSON safe inside <script type="application/json">: no '<', '>' or '&' can end the block."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=str)
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def render_html(data: dict) -> str:
    esc = html.escape
    main_charts, more_charts = charts_html(data["metrics"])
    its = data["iterations"]
    total = sum(i["total"] for i in its + data["evals"])
    shown = sum(i["shown"] for i in its + data["evals"])
    notes = []
    if not data["tokenizer"]["ok"]:
        notes.append(f'<p class="warn" id="tokenizer-note">No tokenizer could be loaded ({esc(data["tokenizer"]["source"])}): '
                     'tokens are shown as their ids, like [123]. Give one with <code>--tokenizer PATH</code>.</p>')
    left_out = [i for i in its if i["shown"] < i["total"]]
    if left_out:
        notes.append('<p class="note" id="limit-note">Trajectories per iteration are limited to '
                     f'{data["max_per_iteration"]} (failed, aborted and truncated ones first, up to half of them): '
                     + _left_out_text(left_out)
                     + '. Use <code>--max-per-iteration 0</code> to include all.</p>')
    if data["available"] and len(its) < len(data["available"]):
        notes.append(f'<p class="note">Trajectories of iterations {esc(_ranges([i["it"] for i in its]))} are in this '
                     f'report (the run has {esc(_ranges(data["available"]))}); choose others with '
                     '<code>--iterations 0,5,10</code> or <code>--iterations all</code>.</p>')
    if not data["available"]:
        notes.append('<p class="note">No trajectories/rollout_*.jsonl in the run folder.</p>')
    if data["evals"]:
        notes.append('<p class="note" id="eval-note">Evaluation trajectories (pick them in the iteration menu): '
                     + ", ".join(esc(f'{e["it"]} ({e["shown"]} of {e["total"]})') for e in data["evals"]) + ".</p>")
    bad = [i for i in its + data["evals"] if i["bad_lines"]]
    if bad:
        notes.append('<p class="warn">Unreadable lines skipped: ' + ", ".join(
            f'iteration {i["it"]}: {i["bad_lines"]}' for i in bad) + "</p>")
    summary = [("run folder", data["run_dir"]), ("env", data.get("env") or "?"), ("model", data.get("model") or "?"),
               ("iterations", f'{len(data["metrics"])} logged'),
               ("tokenizer", data["tokenizer"]["source"] if data["tokenizer"]["ok"] else "none (token ids shown)")]
    cfg = data.get("config") or {}
    for section, key in (("rollout", "rollout_batch_size"), ("rollout", "n_samples_per_prompt"),
                         ("rollout", "rollout_max_response_len"), ("algo", "advantage_estimator"), ("train", "lr")):
        value = (cfg.get(section) or {}).get(key)
        if value is not None:
            summary.append((key, str(value)))
    summary_html = "".join(f"<div><dt>{esc(k)}</dt><dd>{esc(str(v))}</dd></div>" for k, v in summary)
    config_html = (f'<details class="config"><summary>config.yaml</summary><pre>{esc(_yaml(cfg))}</pre></details>'
                   if cfg else "")
    more = (f'<details class="more-charts"><summary>all other metrics</summary><div class="charts">{more_charts}</div>'
            "</details>" if more_charts else "")
    page = (PAGE.replace("%TITLE%", esc(f"agentrl run report: {data['name']}"))
            .replace("%CSS%", CSS)
            .replace("%NAME%", esc(data["name"]))
            .replace("%SUMMARY%", summary_html + config_html)
            .replace("%NOTES%", "".join(notes))
            .replace("%CHARTS%", main_charts)
            .replace("%MORE_CHARTS%", more)
            .replace("%ITERATIONS%", iteration_table(data["metrics"], its, data["available"]))
            .replace("%COUNTS%", esc(f"{shown} of {total}"))
            .replace("%JS%", JS))
    payload = {k: v for k, v in data.items() if k not in ("metrics", "config")}
    return page.replace("%DATA%", _json_for_script(payload))


def _left_out_text(left_out: list[dict]) -> str:
    """'iterations 0, 5: 64 of 128 left out each; iteration 9: 3 of 67 left out'"""
    groups: dict[tuple[int, int], list[int]] = {}
    for i in left_out:
        groups.setdefault((i["total"] - i["shown"], i["total"]), []).append(i["it"])
    parts = []
    for (gone, total), its in groups.items():
        name = "iteration" if len(its) == 1 else "iterations"
        parts.append(f'{name} {_ranges(its)}: {gone} of {total} left out{" each" if len(its) > 1 else ""}')
    return "; ".join(parts)


def _yaml(cfg: dict) -> str:
    try:
        import yaml

        return yaml.safe_dump(cfg, sort_keys=False)
    except Exception:
        return json.dumps(cfg, indent=2, default=str)


def build_report(run_dir: str | Path, out: str | Path | None = None, *, iterations: str | None = None,
                 max_per_iteration: int = DEFAULT_MAX_PER_ITERATION, tokenizer: str | None = None) -> tuple[Path, dict]:
    run_dir = Path(run_dir)
    data = collect(run_dir, iterations=iterations, max_per_iteration=max_per_iteration, tokenizer=tokenizer)
    path = Path(out) if out else run_dir / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_html(data), encoding="utf-8")
    tmp.replace(path)
    return path, data


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
          f"{shown} of {total} trajectories from iteration(s) {_ranges([i['it'] for i in data['iterations']]) or '-'}"
          + (f", {evals} eval trajectories ({len(data['evals'])} evaluations)" if data["evals"] else ""))
    if not data["tokenizer"]["ok"]:
        print(f"note: no tokenizer ({data['tokenizer']['source']}): tokens are shown as ids", file=sys.stderr)
    print(f"open file://{path.resolve()}")
    return 0


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>%TITLE%</title>
<style>%CSS%</style>
</head>
<body>
<header><h1>agentrl run: %NAME%</h1><dl class="summary">%SUMMARY%</dl></header>
<main>
%NOTES%
<section id="curves"><h2>Curves</h2><div class="charts">%CHARTS%</div>%MORE_CHARTS%</section>
<section id="iterations"><h2>Iterations</h2>%ITERATIONS%</section>
<section id="trajectories"><h2>Trajectories <span class="muted" id="count">%COUNTS%</span></h2>
<div class="legend-box" id="legend">
  <span class="tok tok-prompt">prompt</span> prompt tokens (masked)
  <span class="tok m1">trained</span> policy-sampled tokens (loss mask 1, trained)
  <span class="tok m0">masked</span> env / tool / template tokens (loss mask 0, not trained)
  <span class="muted">· hover a token for its id, rollout logprob and policy version</span>
  <span id="shade-key" hidden> · shaded: <span class="tok" style="background: hsl(220, 90%, 88%)">p≈1</span>
    <span class="tok" style="background: hsl(275, 90%, 79%)">p≈0.5</span> <span class="tok" style="background: hsl(330, 90%, 70%)">p≈0</span></span>
</div>
<div class="filters" id="filters">
  <label>search <input type="search" id="search" placeholder="text, id, label, error…" size="28"></label>
  <span class="group" id="status-filters">
    <label><input type="checkbox" class="status-cb" value="completed" checked> completed</label>
    <label><input type="checkbox" class="status-cb" value="truncated" checked> truncated</label>
    <label><input type="checkbox" class="status-cb" value="aborted" checked> aborted</label>
    <label><input type="checkbox" class="status-cb" value="failed" checked> failed</label>
  </span>
  <button id="failed-only" type="button">failed only</button>
  <button id="truncated-only" type="button">truncated only</button>
  <label>reward ≥ <input type="number" id="reward-min" step="any" size="6"></label>
  <label>≤ <input type="number" id="reward-max" step="any" size="6"></label>
  <label>iteration <select id="iteration"><option value="">all</option></select></label>
  <label title="colour trained tokens by their rollout probability"><input type="checkbox" id="shade"> shade by logprob</label>
  <button id="reset" type="button">reset filters</button>
  <button id="expand-all" type="button" title="the first 50 shown">expand shown</button>
  <button id="collapse-all" type="button">collapse all</button>
</div>
<div id="list"></div>
</section>
</main>
<script id="agentrl-data" type="application/json">%DATA%</script>
<script>%JS%</script>
</body>
</html>
"""

CSS = r"""
:root { --trained: #c7ddff; --masked: #ffe2a8; --prompt: #e4e4e7; --fg: #18181b; --muted: #71717a; --line: #e4e4e7; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg); margin: 0; background: #fafafa; }
header { background: #fff; border-bottom: 1px solid var(--line); padding: 12px 20px; }
h1 { font-size: 19px; margin: 0 0 6px; }
h2 { font-size: 16px; margin: 22px 0 8px; }
main { padding: 0 20px 40px; }
.summary { display: flex; flex-wrap: wrap; gap: 4px 22px; margin: 0; }
.summary div { display: flex; gap: 6px; }
.summary dt { color: var(--muted); }
.summary dd { margin: 0; word-break: break-all; }
details.config pre { max-height: 320px; overflow: auto; background: #f4f4f5; padding: 8px; }
.note, .warn { padding: 6px 10px; border-radius: 6px; margin: 10px 0; }
.note { background: #eef2ff; }
.warn { background: #fef3c7; border: 1px solid #f59e0b; }
.muted { color: var(--muted); font-weight: normal; }
.charts { display: flex; flex-wrap: wrap; gap: 10px; }
figure.chart { margin: 0; background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 4px 6px; }
figure.chart figcaption { font-weight: 600; font-size: 13px; }
.chart-empty { color: var(--muted); padding: 20px; }
svg .grid { stroke: #eee; } svg .axis { stroke: #999; }
svg .tick, svg .legend { font-size: 10px; fill: #555; }
svg .band { fill: #2563eb; opacity: .12; }
table.its { border-collapse: collapse; background: #fff; }
table.its th, table.its td { border: 1px solid var(--line); padding: 3px 8px; text-align: right; }
table.its th { background: #f4f4f5; }
.badge { display: inline-block; border-radius: 9px; padding: 0 7px; font-size: 12px; background: #e4e4e7; }
.st-completed { background: #dcfce7; } .st-truncated { background: #fef9c3; } .st-aborted { background: #e0e7ff; } .st-failed { background: #fecaca; }
.legend-box { margin: 6px 0; }
.filters { position: sticky; top: 0; z-index: 2; background: #fafafa; padding: 8px 0; border-bottom: 1px solid var(--line);
           display: flex; flex-wrap: wrap; gap: 6px 14px; align-items: center; }
.filters .group { display: inline-flex; gap: 8px; }
.filters input[type=number] { width: 6em; }
.traj { background: #fff; border: 1px solid var(--line); border-radius: 6px; margin: 6px 0; }
.traj.hidden { display: none; }
.traj-head { padding: 6px 10px; cursor: pointer; display: flex; flex-wrap: wrap; gap: 4px 14px; align-items: baseline; }
.traj-head:hover { background: #f4f4f5; }
.traj-head .tid { font-family: ui-monospace, monospace; font-weight: 600; }
.traj-head .caret { width: 1em; color: var(--muted); }
.traj-body { padding: 4px 12px 12px; border-top: 1px solid var(--line); }
.kv { display: grid; grid-template-columns: max-content 1fr; gap: 2px 12px; margin: 6px 0; }
.kv dt { color: var(--muted); } .kv dd { margin: 0; word-break: break-word; }
.turn { border-left: 3px solid #93c5fd; padding: 2px 0 6px 10px; margin: 12px 0; }
.turn h4 { margin: 0 0 4px; font-size: 13px; }
.block-label { font-size: 12px; color: var(--muted); margin: 6px 0 2px; }
.tokens { font: 12.5px/1.7 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; white-space: pre-wrap; word-break: break-all;
          background: #fcfcfc; border: 1px solid #f0f0f0; padding: 4px 6px; border-radius: 4px; }
.tok { border-radius: 2px; box-shadow: inset -1px 0 0 rgba(0,0,0,.14); }
.tok:hover { outline: 1px solid #111; }
.tok.m1 { background: var(--trained); }
.tok.m0 { background: var(--masked); }
.tok.tok-prompt { background: var(--prompt); }
.tok.special { font-weight: 600; color: #7c3aed; }
.tok .esc { color: #a1a1aa; }
.legend-box .tok { padding: 0 4px; margin-left: 10px; }
pre.msg, pre.err, pre.meta { white-space: pre-wrap; word-break: break-word; background: #f4f4f5; padding: 6px 8px; margin: 2px 0;
          border-radius: 4px; max-height: 400px; overflow: auto; font-size: 12.5px; }
pre.err { background: #fee2e2; }
.call { border: 1px solid #c4b5fd; background: #f5f3ff; border-radius: 4px; padding: 4px 8px; margin: 4px 0; }
.call.bad { border-color: #f87171; background: #fef2f2; }
.call .name { font-family: ui-monospace, monospace; font-weight: 600; }
.role { font-weight: 600; font-size: 12px; }
.timing { color: var(--muted); font-size: 12px; }
.problems { color: #b91c1c; }
"""

JS = r"""
(function () {
"use strict";
var D = JSON.parse(document.getElementById("agentrl-data").textContent);
var T = D.trajs, VOCAB = D.vocab || {}, PIECES = D.pieces || {}, TOK_OK = D.tokenizer && D.tokenizer.ok;
var STATUSES = ["completed", "truncated", "aborted", "failed"];

function el(tag, cls, text) {
  var e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function num(x, d) {
  if (x === null || x === undefined || typeof x !== "number" || !isFinite(x)) return "–";
  if (d === undefined) d = 3;
  return Math.abs(x) >= 1000 ? x.toFixed(0) : String(Number(x.toFixed(d)));
}
function secs(x) { return (x === null || x === undefined) ? "–" : num(x, x < 1 ? 3 : 2) + " s"; }
function expand(rle) { var out = []; for (var i = 0; i < rle.length; i++) for (var k = 0; k < rle[i][1]; k++) out.push(rle[i][0]); return out; }
function tokText(id) { if (!TOK_OK) return "[" + id + "]"; var t = VOCAB[id]; return t === undefined ? "[" + id + "]" : t; }

// Text into a span: control characters shown as \xNN and newlines as ↵ (dimmed, the line
// still breaks), so that every token, whitespace included, has something to see and hover.
function fillText(span, text) {
  var re = /[\u0000-\u0009\u000b-\u001f\u007f]|\n/g, last = 0, m;
  while ((m = re.exec(text)) !== null) {
    if (m.index > last) span.appendChild(document.createTextNode(text.slice(last, m.index)));
    if (m[0] === "\n") { span.appendChild(el("span", "esc", "↵")); span.appendChild(document.createTextNode("\n")); }
    else if (m[0] === "\t") { span.appendChild(el("span", "esc", "→")); span.appendChild(document.createTextNode("\t")); }
    else span.appendChild(el("span", "esc", "\\x" + m[0].charCodeAt(0).toString(16).padStart(2, "0")));
    last = m.index + 1;
  }
  if (last < text.length) span.appendChild(document.createTextNode(text.slice(last)));
  if (text.length === 0) span.appendChild(el("span", "esc", "∅"));
}

// Token spans for ids[start:end]. kind: "prompt" or "resp".
function renderTokens(t, kind, start, end) {
  var box = el("div", "tokens");
  var ids = kind === "prompt" ? t.prompt : t.resp;
  var merges = {};
  (t.merges && t.merges[kind === "prompt" ? "p" : "r"] || []).forEach(function (m) { merges[m[0]] = m; });
  var d = kind === "resp" ? derived(t) : null;
  var i = start;
  while (i < end) {
    var m = merges[i], n = m ? Math.min(m[1], end - i) : 1;
    var text = m ? m[2] : tokText(ids[i]);
    var span = el("span", "tok " + (kind === "prompt" ? "tok-prompt" : (d.mask[i] ? "m1" : "m0")));
    span.dataset.pos = String(i);
    if (n > 1) span.dataset.n = String(n);
    if (kind === "resp" && d.mask[i] && typeof d.lp[i] === "number") span.dataset.lp = String(d.lp[i]);
    if (/^<\|.*\|>$/.test(text) || /^<\/?s>$/.test(text)) span.classList.add("special");
    fillText(span, text);
    box.appendChild(span);
    i += n;
  }
  if (start === end) box.appendChild(el("span", "muted", "(no tokens)"));
  BOXES.set(box, {t: t, kind: kind});
  return box;
}

// A token's tooltip, made when the pointer first reaches it (cheap pages for long trajectories).
var BOXES = new WeakMap();
function tokenTitle(span) {
  var info = BOXES.get(span.parentNode);
  if (!info) return;
  var t = info.t, kind = info.kind, ids = kind === "prompt" ? t.prompt : t.resp, d = kind === "resp" ? derived(t) : null;
  var i = +span.dataset.pos, n = +(span.dataset.n || 1), lines = [];
  for (var k = i; k < i + n; k++) {
    var id = ids[k], line = "token " + k + " · id " + id + " " + JSON.stringify(tokText(id));
    if (PIECES[id] !== undefined) line += " (piece " + JSON.stringify(PIECES[id]) + ")";
    if (kind === "resp" && d.mask[k]) {
      var lp = d.lp[k];
      line += "\nlogprob " + num(lp, 4) + (typeof lp === "number" ? " (p = " + num(Math.exp(lp), 4) + ")" : "") +
              " · policy version " + d.ver[k] + " · loss mask 1 (trained)";
    } else if (kind === "resp") {
      line += "\nloss mask 0 (env/tool/template, not trained)";
    } else {
      line += "\nprompt (not trained)";
    }
    lines.push(line);
  }
  span.title = lines.join("\n");
}
document.addEventListener("mouseover", function (e) {
  var span = e.target && e.target.closest ? e.target.closest(".tokens .tok") : null;
  if (span && !span.title) tokenTitle(span);
});
document.addEventListener("focusin", function (e) {
  if (e.target && e.target.matches && e.target.matches(".tokens .tok") && !e.target.title) tokenTitle(e.target);
});

function derived(t) {
  if (t._d) return t._d;
  var mask = expand(t.mask), ver = expand(t.ver), lp = new Array(mask.length), j = 0;
  for (var i = 0; i < mask.length; i++) lp[i] = mask[i] ? t.lp[j++] : null;
  // segments: runs of equal mask; a run of 1s opens a turn, the 0s after it are its observation
  var segs = [], s = 0;
  for (i = 1; i <= mask.length; i++) if (i === mask.length || mask[i] !== mask[s]) { segs.push([mask[s], s, i]); s = i; }
  t._d = {mask: mask, ver: ver, lp: lp, segs: segs};
  return t._d;
}

function kv(pairs) {
  var dl = el("dl", "kv");
  pairs.forEach(function (p) { if (p[1] === null || p[1] === undefined || p[1] === "") return;
    dl.appendChild(el("dt", null, p[0])); var dd = el("dd"); if (p[1] instanceof Node) dd.appendChild(p[1]); else dd.textContent = String(p[1]); dl.appendChild(dd); });
  return dl;
}
function messageBox(m) {
  var wrap = el("div");
  var head = el("div", "role", m.role + (m.name ? " · " + m.name : "") + (m.tool_call_id ? " · " + m.tool_call_id : ""));
  wrap.appendChild(head);
  wrap.appendChild(el("pre", "msg", m.content));
  return wrap;
}
function callBox(c) {
  var box = el("div", "call" + (c.error ? " bad" : ""));
  var head = el("div");
  head.appendChild(el("span", null, "tool call "));
  head.appendChild(el("span", "name", c.name || "?"));
  if (c.id) head.appendChild(el("span", "muted", " · " + c.id));
  box.appendChild(head);
  if (c.arguments !== undefined) box.appendChild(el("pre", "msg", c.arguments));
  if (c.error) box.appendChild(el("pre", "err", "malformed call: " + c.error));
  if (c.raw && c.arguments === undefined) box.appendChild(el("pre", "msg", c.raw));
  return box;
}

function renderBody(t, body) {
  var d = derived(t);
  var stage = t.stage || {};
  var reward = t.parts ? Object.keys(t.parts).map(function (k) { return k + " = " + num(t.parts[k], 4); }).join(", ") : num(t.reward, 4);
  var versions = d.ver.filter(function (v) { return v >= 0; });
  body.appendChild(kv([
    ["trajectory", t.id + " (iteration " + t.it + ", group " + t.group + ")"],
    ["env", t.env],
    ["status", t.status],
    ["reward", reward],
    ["label", t.label],
    ["tokens", t.prompt.length + " prompt · " + t.resp.length + " response (" + t.trained + " trained, " + (t.resp.length - t.trained) + " masked)"],
    ["policy versions", versions.length ? Math.min.apply(null, versions) + (Math.max.apply(null, versions) !== Math.min.apply(null, versions) ? "–" + Math.max.apply(null, versions) : "") : null],
    ["timings", "generation " + secs(stage.generate_s) + " · env/tool " + secs(stage.env_s) +
                " · reward " + (stage.reward_s !== undefined ? secs(stage.reward_s) : "not recorded separately (computed in the env step: part of env/tool time)")],
  ]));
  if (t.error) body.appendChild(el("pre", "err", t.error));
  if (t.traceback) { var tb = el("details"); tb.appendChild(el("summary", null, "traceback")); tb.appendChild(el("pre", "err", t.traceback)); body.appendChild(tb); }
  if (t.problems && t.problems.length) body.appendChild(el("div", "problems", "problems: " + t.problems.join("; ")));
  if (t.meta && Object.keys(t.meta).length) { var md = el("details"); md.appendChild(el("summary", null, "metadata")); md.appendChild(el("pre", "meta", JSON.stringify(t.meta, null, 1))); body.appendChild(md); }

  var pd = el("details", "prompt");
  pd.appendChild(el("summary", null, "prompt (" + t.prompt.length + " tokens, " + t.prompt_msgs.length + " messages)"));
  t.prompt_msgs.forEach(function (m) { pd.appendChild(messageBox(m)); });
  pd.appendChild(el("div", "block-label", "prompt tokens"));
  pd.appendChild(renderTokens(t, "prompt", 0, t.prompt.length));
  body.appendChild(pd);

  var turn = -1, box = null, segs = d.segs;
  if (!segs.length) body.appendChild(el("p", "muted", "no response tokens"));
  segs.forEach(function (seg) {
    if (seg[0] === 1 || box === null) {
      turn += 1;
      box = el("div", "turn");
      box.dataset.turn = String(turn);
      var tm = (t.timings || [])[turn] || {};
      var extra = Object.keys(tm).filter(function (k) { return k !== "generate_s" && k !== "env_s"; })
        .map(function (k) { return k.replace(/_s$/, "") + " " + secs(tm[k]); }).join(" · ");
      var h = el("h4", null, "turn " + (turn + 1));
      h.appendChild(el("span", "timing", "  generation " + secs(tm.generate_s) + " · env/tool " + secs(tm.env_s) + (extra ? " · " + extra : "")));
      box.appendChild(h);
      body.appendChild(box);
    }
    var msgs = (t.turn_msgs || [])[turn];
    if (seg[0] === 1) {
      box.appendChild(el("div", "block-label", "assistant · " + (seg[2] - seg[1]) + " trained tokens"));
      box.appendChild(renderTokens(t, "resp", seg[1], seg[2]));
      if (msgs) msgs.calls.forEach(function (c) { box.appendChild(callBox(c)); });
    } else {
      box.appendChild(el("div", "block-label", "env / tool / template · " + (seg[2] - seg[1]) + " masked tokens"));
      if (msgs) msgs.obs.forEach(function (m) { box.appendChild(messageBox(m)); });
      box.appendChild(renderTokens(t, "resp", seg[1], seg[2]));
    }
  });
  var end = el("div", "timing", "end: " + t.status + " · reward " + reward + " after " + t.turns + " turn(s)");
  body.appendChild(end);
  if (document.getElementById("shade").checked) shade(body, true);
}

// -- list ---------------------------------------------------------------------------------
var list = document.getElementById("list");
var cards = [];
T.forEach(function (t, idx) {
  var card = el("div", "traj");
  card.dataset.idx = String(idx); card.dataset.status = t.status; card.dataset.it = String(t.it);
  var head = el("div", "traj-head");
  head.setAttribute("role", "button"); head.tabIndex = 0;
  var caret = el("span", "caret", "▸");
  head.appendChild(caret);
  head.appendChild(el("span", "tid", t.id));
  head.appendChild(el("span", "muted", "it " + t.it + (t.env ? " · " + t.env : "")));
  head.appendChild(el("span", "badge st-" + t.status, t.status));
  head.appendChild(el("span", null, t.status === "failed" ? "reward – (failed: not scored)" : "reward " + num(t.reward, 4)));
  head.appendChild(el("span", null, t.turns + " turn" + (t.turns === 1 ? "" : "s")));
  head.appendChild(el("span", null, t.resp.length + " tok (" + t.trained + " trained)"));
  var st = t.stage || {};
  head.appendChild(el("span", "timing", "gen " + secs(st.generate_s) + " · env " + secs(st.env_s) + (st.reward_s !== undefined ? " · reward " + secs(st.reward_s) : "")));
  if (t.error) head.appendChild(el("span", "problems", t.error.length > 80 ? t.error.slice(0, 80) + "…" : t.error));
  var body = el("div", "traj-body"); body.hidden = true;
  function toggle(open) {
    if (open === undefined) open = body.hidden;
    if (open && !body.dataset.rendered) { renderBody(t, body); body.dataset.rendered = "1"; }
    body.hidden = !open; caret.textContent = open ? "▾" : "▸";
  }
  card._toggle = toggle;
  head.addEventListener("click", function () { toggle(); });
  head.addEventListener("keydown", function (e) { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); toggle(); } });
  card.appendChild(head); card.appendChild(body);
  list.appendChild(card); cards.push(card);
});
if (!T.length) list.appendChild(el("p", "muted", "No trajectories in this report."));

var itSel = document.getElementById("iteration");
(D.iterations || []).concat(D.evals || []).forEach(function (i) { var o = el("option", null, i.it + " (" + i.shown + (i.shown < i.total ? " of " + i.total : "") + ")"); o.value = String(i.it); itSel.appendChild(o); });

function searchText(t) {
  if (t._text !== undefined) return t._text;
  var parts = [t.id, t.env, t.status, t.label || "", t.error || "", t.traceback || ""];
  t.prompt_msgs.forEach(function (m) { parts.push(m.content); });
  (t.turn_msgs || []).forEach(function (tm) { parts.push(tm.assistant); tm.calls.forEach(function (c) { parts.push(c.name || "", c.arguments || "", c.raw || ""); }); tm.obs.forEach(function (m) { parts.push(m.content); }); });
  var toks = []; for (var i = 0; i < t.resp.length; i++) toks.push(tokText(t.resp[i]));
  parts.push(toks.join(""));
  t._text = parts.join("\n").toLowerCase();
  return t._text;
}

function applyFilters() {
  var want = {};
  document.querySelectorAll(".status-cb").forEach(function (cb) { want[cb.value] = cb.checked; });
  var q = document.getElementById("search").value.trim().toLowerCase();
  var lo = parseFloat(document.getElementById("reward-min").value), hi = parseFloat(document.getElementById("reward-max").value);
  var it = itSel.value, shown = 0;
  cards.forEach(function (card) {
    var t = T[+card.dataset.idx];
    var ok = (want[t.status] !== false) && (it === "" || String(t.it) === it);
    if (ok && !isNaN(lo)) ok = typeof t.reward === "number" && t.reward >= lo;
    if (ok && !isNaN(hi)) ok = typeof t.reward === "number" && t.reward <= hi;
    if (ok && q) ok = searchText(t).indexOf(q) >= 0;
    card.classList.toggle("hidden", !ok);
    if (ok) shown++;
  });
  document.getElementById("count").textContent = shown + " of " + T.length + " shown";
}
function only(status) { document.querySelectorAll(".status-cb").forEach(function (cb) { cb.checked = cb.value === status; }); applyFilters(); }

var timer = null;
document.getElementById("search").addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(applyFilters, 150); });
["reward-min", "reward-max"].forEach(function (id) { document.getElementById(id).addEventListener("input", applyFilters); });
itSel.addEventListener("change", applyFilters);
document.querySelectorAll(".status-cb").forEach(function (cb) { cb.addEventListener("change", applyFilters); });
document.getElementById("failed-only").addEventListener("click", function () { only("failed"); });
document.getElementById("truncated-only").addEventListener("click", function () { only("truncated"); });
document.getElementById("reset").addEventListener("click", function () {
  document.querySelectorAll(".status-cb").forEach(function (cb) { cb.checked = true; });
  ["search", "reward-min", "reward-max"].forEach(function (id) { document.getElementById(id).value = ""; });
  itSel.value = ""; applyFilters();
});
document.getElementById("expand-all").addEventListener("click", function () {
  cards.filter(function (c) { return !c.classList.contains("hidden"); }).slice(0, 50).forEach(function (c) { c._toggle(true); });
});
document.getElementById("collapse-all").addEventListener("click", function () { cards.forEach(function (c) { c._toggle(false); }); });
document.querySelectorAll(".it-link").forEach(function (b) {
  b.addEventListener("click", function () { itSel.value = b.dataset.it; applyFilters(); document.getElementById("trajectories").scrollIntoView(); });
});

// Shade trained tokens by probability: likely = light blue, unlikely = deep pink (never the
// amber of masked tokens).
function shade(root, on) {
  root.querySelectorAll(".tok.m1").forEach(function (s) {
    if (!on || s.dataset.lp === undefined) { s.style.background = ""; return; }
    var p = Math.exp(parseFloat(s.dataset.lp));
    s.style.background = "hsl(" + Math.round(330 - 110 * p) + ", 90%, " + Math.round(88 - 18 * (1 - p)) + "%)";
  });
}
document.getElementById("shade").addEventListener("change", function (e) {
  shade(document, e.target.checked);
  document.getElementById("shade-key").hidden = !e.target.checked;
});

applyFilters();
if (cards.length) cards[0]._toggle(true);  // one trajectory open, so the page shows what a trajectory looks like
document.body.dataset.ready = "1";
})();
"""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
