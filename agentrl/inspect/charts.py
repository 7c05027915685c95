"""The curves of metrics.jsonl as line charts: here the geometry (scales, ticks, paths), in
templates/chart.html the SVG markup. Drawn at build time: the page needs no script to show them."""

from __future__ import annotations

import math

from .data import finite_number
from .run_folder import STATUSES

PALETTE = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777"]
Series = list[tuple[int, float | None]]  # (iteration, value or None when not logged)


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


def fmt(v: float) -> str:
    """A metric value, short: 0.123, 45.6, 789, 1.2e+04."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 10000 or a < 0.01:
        return f"{v:.2g}"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def line_chart(title: str, series: list[tuple[str, Series]], *, key: str = "", width: int = 400, height: int = 210,
               band: list[tuple[int, float, float]] | None = None, xlim: tuple[int, int] | None = None) -> dict:
    """One chart for templates/chart.html: a path per series (iterations without a value are
    skipped, the line joins the ones around them), a dot per point, y ticks, the first and
    last iteration on x (`xlim`: the same x range for every chart), a legend for several series."""
    left, right, top, bottom = 46, 10, 26, 28
    chart = {"title": title, "key": key or title, "width": width, "height": height}
    pts = [(x, y) for _, s in series for x, y in s if y is not None]
    if not pts:
        return chart | {"empty": True}
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

    def sx(x) -> str:
        return f"{left + (x - x0) / (x1 - x0) * pw:.1f}"

    def sy(y, shift: float = 0) -> str:
        return f"{top + (1 - (y - y0) / (y1 - y0)) * ph + shift:.1f}"

    lines = []
    for i, (name, s) in enumerate(series):
        shown = [(x, y) for x, y in s if y is not None]
        lines.append({
            "name": name, "color": PALETTE[i % len(PALETTE)], "points": len(shown),
            "d": " ".join(f"{'L' if j else 'M'} {sx(x)} {sy(y)}" for j, (x, y) in enumerate(shown)),
            "dots": [(sx(x), sy(y), f"{name} · iteration {x}: {fmt(y) if abs(y) >= 0.01 else repr(y)}")
                     for x, y in shown],
        })
    legend, lx = [], left + 6
    for line in lines if len(lines) > 1 else []:
        label = line["name"] if len(line["name"]) <= 24 else line["name"][:23] + "…"
        legend.append({"x": lx, "color": line["color"], "label": label})
        lx += 18 + 6.2 * len(label)
    if band:
        upper = " L ".join(f"{sx(x)} {sy(hi)}" for x, _, hi in band)
        lower = " L ".join(f"{sx(x)} {sy(lo)}" for x, lo, _ in reversed(band))
        band_d = f"M {upper} L {lower} Z"
    return chart | {
        "empty": False, "left": left, "right": width - right, "top": top, "bottom": top + ph,
        "yticks": [(sy(t), sy(t, 3), fmt(t)) for t in _nice_ticks(y0, y1)],  # (line y, label y, label)
        "xticks": [(sx(x), x) for x in sorted({x0, x1, (x0 + x1) // 2} if x1 - x0 >= 2 and xlim else {min(xs), max(xs)})],
        "xlabel_x": f"{left + pw / 2:.1f}", "band": band_d if band else None, "lines": lines, "legend": legend,
    }


def metric_charts(metrics: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the main charts, the charts of every other numeric metric)."""
    if not metrics:
        return [], []

    def series(key):
        return [(r["rollout_id"], finite_number(r.get(key), 8)) for r in metrics]

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
        charts.append(line_chart(title, [((labels or {}).get(n, n), series(n)) for n in present], key=key or present[0],
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
    rest = [line_chart(k, [(k, series(k))], key=k, width=300, height=170, xlim=xlim) for k in keys if k not in used]
    return charts, rest
