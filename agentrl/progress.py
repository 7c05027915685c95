"""Live progress: a bar with iteration, reward and throughput on a terminal; one summary
line per iteration otherwise (logs, CI)."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn


class Progress:
    #: without a terminal, a "rollout: N trajectories done" line at most this often (seconds)
    plain_every_s = 30.0

    def __init__(self, enabled: bool = True):
        self.console = Console(stderr=True)
        self.enabled = enabled
        self.live = enabled and sys.stderr.isatty()
        self._last_line = time.monotonic()
        self._bar: RichProgress | None = None
        self._task = None
        self._samples = 0
        self.detail = None  # () -> str: the rollout's state (groups ready / target, failures), set by the loop

    def note(self, text: str) -> None:
        self.console.print(f"[agentrl] {text}", highlight=False, markup=False, soft_wrap=True)

    def start(self, total: int, completed: int = 0) -> None:
        if self.live:
            self._bar = RichProgress(TextColumn("iteration"), MofNCompleteColumn(), BarColumn(),
                                     TextColumn("{task.description}"), TimeElapsedColumn(), console=self.console)
            self._bar.start()
            self._task = self._bar.add_task("starting", total=total, completed=completed)

    def advance_samples(self) -> None:
        self._samples += 1
        self.tick()

    def tick(self) -> None:
        """Refresh the rollout's line; the loop also calls it on a timer, so a stalled rollout
        still prints a line at least every `plain_every_s` without a terminal."""
        text = f"rollout: {self._samples} trajectories done" + (f"; {self.detail()}" if self.detail else "")
        if self._bar is not None:
            self._bar.update(self._task, description=text)
        elif self.enabled and time.monotonic() - self._last_line >= self.plain_every_s:  # logs, CI: still alive
            self._last_line = time.monotonic()
            self.console.print(f"  {text}", highlight=False, markup=False)

    def iteration_done(self, m: dict) -> None:
        self._samples, self._last_line = 0, time.monotonic()
        line = (f"iter {m['rollout_id']}: reward {m['reward_mean']:.3f}  len {m['response_len_mean']:.1f}  "
                f"turns {m['turns_mean']:.1f}  {m['tokens_per_s']:.0f} tok/s  "
                f"rollout {m['rollout_s']:.1f}s train {m.get('train_s', 0.0):.1f}s sync {m.get('weight_sync_s', 0.0):.2f}s")
        if m.get("status_truncated"):  # and why: "truncated 3 (no room for another turn 2, max_turns 1)"
            reasons = ", ".join(f"{k[10:]} {v}" for k, v in m.items() if k.startswith("truncated/") and v)
            line += f"  truncated {m['status_truncated']}" + (f" ({reasons})" if reasons else "")
        if m.get("status_failed"):
            line += f"  failed {m['status_failed']}"
        for key, value in m.items():  # eval/<name>/reward_mean, on the iterations that evaluated
            if key.startswith("eval/") and key.endswith("/reward_mean"):
                line += f"  eval {key[5:-12]} {value:.3f}"
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=f"reward {m['reward_mean']:.3f}, "
                                                                f"{m['tokens_per_s']:.0f} tok/s")
            self._bar.console.print(line, highlight=False, markup=False, soft_wrap=True)
        else:
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
