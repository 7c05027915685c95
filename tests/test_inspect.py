"""`agentrl inspect`: the HTML report of a run.

A run folder is built here the way a real run leaves one (config.yaml, metrics.jsonl,
trajectories/rollout_NNNNN.jsonl of `Sample.to_dict()` rows), with multi-turn tool
trajectories tokenized turn by turn by the tiny model's chat template, a truncated and a
failed trajectory, and model output that tries to inject markup.

The browser test opens the report in headless Chromium (Debian: `apt-get install -y
chromium`), driven by Playwright, and checks what a person sees:
curves drawn, trained and masked tokens in different colours, logprobs on hover, the
"failed only" filter and the search box working, injected markup inert. Set
AGENTRL_INSPECT_SCREENSHOT_DIR to keep its screenshots.
"""

from __future__ import annotations

import html.parser
import io
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from agentrl import inspect as report
from agentrl.types import Sample, SampleStatus, TurnTiming

INJECTION = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
NUM_ITERATIONS = 6
EVAL_EVERY = 2


# -- a run folder -----------------------------------------------------------------------------
def _tool_sample(tok, traj_id: str, group: int, *, turns: int, reward, status=SampleStatus.COMPLETED,
                 inject: bool = False) -> Sample:
    """A python-tool trajectory built the agent loop's way: the policy's tokens appended as
    sampled (mask 1), each tool result's rendered suffix appended as context (mask 0)."""
    tools = [{"type": "function", "function": {"name": "python", "description": "run python",
                                               "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": "You solve arithmetic with a python tool."},
                {"role": "user", "content": "What is 17 * 23?" + (" " + INJECTION if inject else "")}]
    seen = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    sample = Sample(prompt_tokens=tok.encode(seen, add_special_tokens=False), trajectory_id=traj_id, group_id=group,
                    env_name="math-python", metadata={"label": "391", "cached_tokens": []})
    for turn in range(turns):
        last = turn == turns - 1
        if last:
            text = "The answer is \\boxed{391}." + (" " + INJECTION if inject else "")
        else:
            text = 'Let me compute it. <tool_call>{"name": "python", "arguments": {"code": "print(17 * %d)"}}</tool_call>' % (23 + turn)
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        logprobs = [-0.05 - 0.4 * ((i * 7) % 5) for i in range(len(ids))]
        sample.append_generated(ids, logprobs, policy_version=max(0, group - 1))
        sample.turn_timings.append(TurnTiming(generate_s=0.25 + 0.1 * turn, env_s=0.0 if last else 0.04))
        seen += tok.decode(ids, skip_special_tokens=False)
        messages.append({"role": "assistant", "content": text})
        sample.num_turns = turn + 1
        if last:
            break
        messages.append({"role": "tool", "name": "python", "content": str(17 * (23 + turn)) + (INJECTION if inject else ""),
                         "tool_call_id": "call_0"})
        rendered = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert rendered.startswith(seen)
        sample.append_observation(tok.encode(rendered[len(seen):], add_special_tokens=False))
        seen = rendered
    sample.messages = messages
    sample.reward = reward
    sample.status = status
    sample.validate()
    return sample


def _rows_for(tok, it: int) -> list[dict]:
    samples = [
        _tool_sample(tok, f"r{it}-g0-s0", 0, turns=3, reward={"score": 1.0, "format": 0.5}),
        _tool_sample(tok, f"r{it}-g0-s1", 0, turns=2, reward={"score": 0.0, "format": 0.5}, inject=True),
        _tool_sample(tok, f"r{it}-g1-s0", 1, turns=2, reward=0.0, status=SampleStatus.TRUNCATED),
        _tool_sample(tok, f"r{it}-g1-s1", 1, turns=1, reward=0.25 * it),
    ]
    failed = Sample(prompt_tokens=[], trajectory_id=f"r{it}-g2-s0", group_id=2, status=SampleStatus.FAILED,
                    env_name="math-python",
                    metadata={"error": "SandboxError: container exited with 137 <b>oom</b>",
                              "traceback": "Traceback (most recent call last):\n  File \"x.py\", line 1\nSandboxError"})
    rows = []
    for s in samples + [failed]:
        row = s.to_dict()
        row["prompt_text"] = tok.decode(s.prompt_tokens)
        row["response_text"] = tok.decode(s.response_tokens)
        rows.append(row)
    return rows


def make_run(root: Path, tok, tokenizer_dir: Path | None, iterations: int = NUM_ITERATIONS) -> Path:
    run = root / "run"
    (run / "trajectories").mkdir(parents=True)
    config = {"model": {"model": str(tokenizer_dir) if tokenizer_dir else "/nonexistent/model"},
              "rollout": {"rollout_batch_size": 3, "n_samples_per_prompt": 2}, "run": {"env": "math-python"}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    with open(run / "metrics.jsonl", "w") as f:
        for it in range(iterations):
            row = {"rollout_id": it, "reward_mean": 0.1 * it, "reward_std": 0.05, "response_len_mean": 40 + 3 * it,
                   "turns_mean": 2.0, "status_completed": 3, "status_truncated": 1, "status_aborted": 0,
                   "status_failed": 1, "rollout_s": 1.5, "train_s": 0.7, "generate_s_mean": 0.3, "env_s_mean": 0.04,
                   "tokens_per_s": 120.0 + it, "loss": 0.01 * it}
            if it % EVAL_EVERY == 0:
                row["eval/gsm8k/reward_mean"] = 0.2 + 0.05 * it
            f.write(json.dumps(row) + "\n")
    for it in range(iterations):
        with open(run / "trajectories" / f"rollout_{it:05d}.jsonl", "w") as f:
            for row in _rows_for(tok, it):
                f.write(json.dumps(row) + "\n")
    return run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tokenizer, tiny_model) -> Path:
    return make_run(tmp_path_factory.mktemp("inspect"), tokenizer, tiny_model)


class _Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _embedded(page: str) -> dict:
    start = page.index('<script id="agentrl-data" type="application/json">') + len('<script id="agentrl-data" type="application/json">')
    return json.loads(page[start:page.index("</script>", start)])


# -- the report, without a browser ------------------------------------------------------------
def test_report_content(run_dir, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert report.main([str(run_dir), "--out", str(out), "--iterations", "0,2-3"]) == 0
    assert "wrote" in capsys.readouterr().out
    page = out.read_text()
    tags = _Tags()
    tags.feed(page)
    # injected markup is text: the page's only elements are its own (two scripts, no img)
    assert [t for t, _ in tags.tags if t == "script"] == ["script", "script"]
    assert not [t for t, _ in tags.tags if t in ("img", "iframe", "link")]
    assert "<script>window.__pwned" not in page and "<b>oom</b>" not in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # nothing to fetch
    data = _embedded(page)
    assert [i["it"] for i in data["iterations"]] == [0, 2, 3]
    assert data["tokenizer"]["ok"] and str(run_dir) not in data["tokenizer"]["source"]
    t = next(t for t in data["trajs"] if t["id"] == "r2-g0-s0")
    assert t["status"] == "completed" and t["reward"] == 1.0 and t["parts"] == {"score": 1.0, "format": 0.5}
    assert [m for m, _ in t["mask"]] == [1, 0, 1, 0, 1]  # three assistant turns, two tool results between them
    assert len(t["lp"]) == t["trained"] == sum(n for m, n in t["mask"] if m == 1)
    assert [c["name"] for tm in t["turn_msgs"] for c in tm["calls"]] == ["python", "python"]
    assert t["turn_msgs"][0]["obs"][0]["content"] == "391"
    assert [tm["generate_s"] for tm in t["timings"]] == [0.25, 0.35, 0.45]
    assert t["stage"]["generate_s"] == pytest.approx(1.05)
    # every token of the response decodes to the response text
    text = "".join(data["vocab"][str(i)] for i in t["resp"])
    assert "<tool_call>" in text and "\\boxed{391}" in text
    failed = next(t for t in data["trajs"] if t["status"] == "failed")
    assert failed["error"].startswith("SandboxError") and "Traceback" in failed["traceback"]
    # curves: one point per iteration, eval only where logged
    assert 'data-key="reward"' in page and f'data-points="{NUM_ITERATIONS}"' in page
    assert 'data-name="gsm8k" data-points="3"' in page


def test_limits_and_defaults(run_dir, tmp_path):
    data = report.collect(run_dir, iterations=None, max_per_iteration=2)
    assert len(data["iterations"]) == report.DEFAULT_NUM_ITERATIONS
    assert data["iterations"][0]["it"] == 0 and data["iterations"][-1]["it"] == NUM_ITERATIONS - 1
    for info in data["iterations"]:
        assert info["total"] == 5 and info["shown"] == 2
    # the unusual ones come first when trajectories are left out
    assert [t["status"] for t in data["trajs"][:2]] == ["completed", "failed"]
    rows = [{"status": s} for s in ("completed", "truncated", "completed", "failed", "aborted", "completed")]
    assert report.pick_trajectories(rows, 4) == [0, 1, 3, 4]  # failed and aborted first, then in order
    assert report.pick_trajectories(rows, 3) == [0, 1, 3]
    assert report.pick_trajectories(rows, 0) == list(range(6))
    page = report.render_html(data)
    assert 'id="limit-note"' in page and "3 of 5 left out" in page
    assert len(report.collect(run_dir, iterations="all", max_per_iteration=0)["trajs"]) == 5 * NUM_ITERATIONS
    with pytest.raises(report.InspectError, match="no trajectories for iteration"):
        report.collect(run_dir, iterations="0,99")
    with pytest.raises(report.InspectError, match="expected 'all'"):
        report.collect(run_dir, iterations="last")
    assert report.select_iterations([0, 1, 2, 3], "-1") == [3]
    assert report.main([str(tmp_path / "missing")]) == 2


def test_eval_trajectories_are_shown(tmp_path, tokenizer, tiny_model, capsys):
    run = make_run(tmp_path, tokenizer, tiny_model)
    for it in range(EVAL_EVERY - 1, NUM_ITERATIONS, EVAL_EVERY):  # as train writes them after iteration `it`
        for name in ("gsm8k", "math_500"):
            with open(run / "trajectories" / f"eval_{name}_{it:05d}.jsonl", "w") as f:
                for row in _rows_for(tokenizer, it)[:3]:
                    f.write(json.dumps(row) + "\n")
    assert [(n, i) for n, i, _ in report.eval_trajectory_files(run)] == [
        ("gsm8k", 1), ("math_500", 1), ("gsm8k", 3), ("math_500", 3), ("gsm8k", 5), ("math_500", 5)]
    data = report.collect(run, iterations="0-1")  # the evaluations after the chosen iterations, and the last
    assert [e["it"] for e in data["evals"]] == ["eval gsm8k @1", "eval math_500 @1", "eval gsm8k @5",
                                                "eval math_500 @5"]
    assert [e["total"] for e in data["evals"]] == [3] * 4
    shown = [t for t in data["trajs"] if t["it"] == "eval math_500 @5"]
    assert len(shown) == 3 and shown[0]["id"] == "r5-g0-s0" and shown[0]["resp"]
    assert report.main([str(run), "--iterations", "0-1"]) == 0
    assert "12 eval trajectories (4 evaluations)" in capsys.readouterr().out
    page = (run / "report.html").read_text()
    assert 'id="eval-note"' in page and "eval gsm8k @5 (3 of 3)" in page
    assert [e["it"] for e in _embedded(page)["evals"]] == [e["it"] for e in data["evals"]]
    # a folder of `agentrl eval`: eval trajectories only
    only = tmp_path / "eval-only"
    (only / "trajectories").mkdir(parents=True)
    shutil.copy(run / "trajectories" / "eval_gsm8k_00001.jsonl", only / "trajectories" / "eval_gsm8k_00000.jsonl")
    data = report.collect(only)
    assert [e["it"] for e in data["evals"]] == ["eval gsm8k @0"] and len(data["trajs"]) == 3


def test_no_tokenizer_falls_back_to_ids(tmp_path, tokenizer):
    run = make_run(tmp_path, tokenizer, None, iterations=1)
    path, data = report.build_report(run)
    assert path == run / "report.html"
    assert not data["tokenizer"]["ok"] and data["vocab"] == {}
    page = path.read_text()
    assert 'id="tokenizer-note"' in page and "shown as their ids" in page


def test_partial_and_odd_rows(tmp_path):
    """A run still being written: a cut-off last line, a row with mismatched arrays; no config."""
    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"rollout_id": 0, "reward_mean": 0.5}\n{"rollout_id": 1, "rew')
    good = Sample(prompt_tokens=[1, 2], trajectory_id="a")
    good.append_generated([3, 4], [-0.1, -0.2], 0)
    odd = good.to_dict() | {"trajectory_id": "b", "loss_mask": [1]}
    (run / "trajectories" / "rollout_00000.jsonl").write_text(
        json.dumps(good.to_dict()) + "\n" + json.dumps(odd) + "\n{\"prompt_tok")
    path, data = report.build_report(run)
    assert data["iterations"][0]["bad_lines"] == 1 and len(data["trajs"]) == 2
    assert data["trajs"][1]["problems"] and not data["trajs"][0]["problems"]
    assert data["tokenizer"]["ok"] is False and len(data["metrics"]) == 1


def test_run_text_is_escaped_in_the_page(tmp_path):
    """Markup from the run (trajectory text and ids, an error, a metric name, a config value, an
    eval set's file name) lands in the page as text: the templates autoescape it, and the JSON
    block escapes < and > so nothing can close its <script>."""
    evil = "<script>alert(1)</script>"
    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"run": {"env": evil}, "model": {"model": "/nonexistent"}}))
    (run / "metrics.jsonl").write_text(json.dumps({"rollout_id": 0, "reward_mean": 0.5, evil: 1.0}) + "\n")
    sample = Sample(prompt_tokens=[1, 2], trajectory_id=evil, env_name=evil, messages=[
        {"role": "user", "content": evil}, {"role": "assistant", "content": evil}])
    sample.append_generated([3, 4], [-0.1, -0.2], 0)
    failed = Sample(prompt_tokens=[], trajectory_id="f", status=SampleStatus.FAILED, metadata={"error": evil})
    lines = "".join(json.dumps(s.to_dict()) + "\n" for s in (sample, failed))
    (run / "trajectories" / "rollout_00000.jsonl").write_text(lines)
    (run / "trajectories" / "eval_<img src=x onerror=alert(2)>_00000.jsonl").write_text(lines)
    path, _ = report.build_report(run)
    page = path.read_text()
    tags = _Tags()
    tags.feed(page)
    assert [t for t, _ in tags.tags if t in ("script", "img")] == ["script", "script"]  # the page's own two
    assert evil not in page and "<img" not in page and page.count("</script>") == 2
    # escaped where the templates put run text: the summary (env), the curves (metric name), the notes (eval name)
    assert "<dd>&lt;script&gt;alert(1)&lt;/script&gt;</dd>" in page
    assert 'data-key="&lt;script&gt;alert(1)&lt;/script&gt;"' in page
    assert "eval &lt;img src=x onerror=alert(2)&gt; @0 (2 of 2)" in page
    # and intact in the data the page's script shows (with textContent)
    data = _embedded(page)
    assert "\\u003cscript\\u003e" in page and data["trajs"][0]["id"] == evil
    assert data["trajs"][0]["prompt_msgs"][0]["content"] == evil and data["trajs"][1]["error"] == evil


# -- in a real browser ------------------------------------------------------------------------
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.e2e
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian/Ubuntu: apt-get install -y chromium)")
@pytest.mark.timeout(120)
def test_report_in_browser(run_dir, tmp_path):
    from PIL import Image
    from playwright.sync_api import sync_playwright

    out = tmp_path / "report.html"
    assert report.main([str(run_dir), "--out", str(out), "--iterations", "all"]) == 0
    keep = os.environ.get("AGENTRL_INSPECT_SCREENSHOT_DIR")
    with sync_playwright() as pw:  # the system chromium, driven by Playwright (no browser download)
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            b = browser.new_page(viewport={"width": 1400, "height": 1800})
            b.set_default_timeout(30_000)
            b.goto(out.as_uri())
            b.wait_for_function("() => document.body && document.body.dataset.ready === '1'")  # its script ran
            # curves: the reward line has one point per iteration, and pixels of its colour are on screen
            reward_line = b.locator("figure[data-key=reward] path.series")
            assert int(reward_line.get_attribute("data-points")) == NUM_ITERATIONS
            d = reward_line.get_attribute("d")
            assert d.count("M") + d.count("L") == NUM_ITERATIONS
            eval_points = b.locator("figure[data-key=eval] path.series").get_attribute("data-points")
            assert int(eval_points) == len(range(0, NUM_ITERATIONS, EVAL_EVERY))
            chart = b.locator("figure[data-key=reward] svg").screenshot()
            if keep:
                Path(keep).mkdir(parents=True, exist_ok=True)
                b.screenshot(path=str(Path(keep) / "report-top.png"))
            px = np.asarray(Image.open(io.BytesIO(chart)).convert("RGB")).astype(int)
            r, g, bl = px[..., 0], px[..., 1], px[..., 2]
            blue = int(((bl > 180) & (r < 90) & (g > 60) & (g < 140)).sum())  # the line's colour, #2563eb
            assert blue > 100, f"the reward line is not drawn ({blue} pixels of its colour)"

            # the first trajectory is open: trained and masked tokens look different
            m1, m0 = ".traj-body .tokens .tok.m1", ".traj-body .tokens .tok.m0"
            b.hover(m1)  # the tooltip (title) of a token is made when the pointer reaches it
            b.hover(m0)
            styles = b.evaluate(f"""() => {{
                const m1 = document.querySelector('{m1}'), m0 = document.querySelector('{m0}');
                return [getComputedStyle(m1).backgroundColor, getComputedStyle(m0).backgroundColor, m1.title, m0.title,
                        m1.getBoundingClientRect().width > 0, m0.getBoundingClientRect().width > 0,
                        document.querySelectorAll('#legend .tok.m1, #legend .tok.m0').length];
            }}""")
            bg1, bg0, title1, title0, seen1, seen0, legend = styles
            assert bg1 != bg0 and "rgba(0, 0, 0, 0)" not in (bg1, bg0), styles
            assert seen1 and seen0 and legend == 2
            assert "logprob" in title1 and "policy version" in title1 and "loss mask 1" in title1
            assert "loss mask 0" in title0
            assert b.locator(".traj-body .call .name").first.text_content() == "python"

            total = b.locator(".traj").count()
            assert total == 5 * NUM_ITERATIONS
            visible = "[...document.querySelectorAll('.traj')].filter(e => e.offsetParent !== null)"

            def visible_statuses():
                return b.evaluate(f"{visible}.map(e => e.dataset.status)")

            assert len(visible_statuses()) == total
            b.click("#failed-only")  # a real mouse click
            statuses = visible_statuses()
            assert statuses == ["failed"] * NUM_ITERATIONS, statuses
            b.click("#reset")
            assert len(visible_statuses()) == total

            # reward range
            b.fill("#reward-min", "0.9")
            rewards = b.evaluate(f"{visible}.map(e => e.querySelector('.traj-head').textContent)")
            assert rewards and all("reward 1" in r for r in rewards), rewards
            b.click("#reset")

            # search: typed text, trajectories holding it stay (the box filters as it is typed, debounced)
            b.click("#search")
            b.keyboard.type("onerror")
            b.wait_for_function(f"n => {visible}.length === n", arg=NUM_ITERATIONS)
            ids = b.evaluate(f"{visible}.map(e => e.querySelector('.tid').textContent)")
            assert sorted(ids) == sorted(f"r{i}-g0-s1" for i in range(NUM_ITERATIONS)), ids

            # the injected markup is shown as text and never ran
            b.click(".traj:not(.hidden) .traj-head")
            shown = b.locator(".traj:not(.hidden) .traj-body").first.text_content()
            assert "<script>window.__pwned = 1</script>" in shown
            assert b.evaluate("typeof window.__pwned") == "undefined"
            assert b.locator("script").count() == 2
            assert b.locator("img").count() == 0
            if keep:
                b.click("#reset")
                b.evaluate("window.scrollTo(0, document.getElementById('trajectories').offsetTop)")
                b.screenshot(path=str(Path(keep) / "report-trajectory.png"))
        finally:
            browser.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
