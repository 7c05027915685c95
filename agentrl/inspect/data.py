"""Everything the report shows, gathered from the run folder as one JSON-able dict."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

from .run_folder import (DEFAULT_MAX_PER_ITERATION, MAX_MESSAGE_CHARS, STATUSES, InspectError, eval_trajectory_files,
                         pick_evals, pick_trajectories, read_config, read_metrics_rows, read_trajectories,
                         select_iterations, trajectory_files)
from .tokens import Decoder, load_decoder


def _rle(values: Iterable[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def finite_number(x: Any, digits: int = 4) -> float | None:
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
        parts = {str(k): finite_number(v) for k, v in reward.items()}
        value = finite_number(reward.get("score", 0.0))
    else:
        value = finite_number(reward)

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
            timings.append({str(k): finite_number(v) for k, v in t.items()})
    stage = {"generate_s": 0.0, "env_s": 0.0}
    for t in timings:
        for k, v in t.items():
            if v is not None:
                stage[k] = round(stage.get(k, 0.0) + v, 4)
    for key in ("reward_s", "rm_s", "reward_time_s"):
        if finite_number(metadata.get(key)) is not None:
            stage["reward_s"] = round(stage.get("reward_s", 0.0) + finite_number(metadata.pop(key)), 4)

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
        "lp": [finite_number(lp) for lp, m in zip(logprobs, mask) if m == 1],
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

