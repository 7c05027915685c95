"""Live progress: a bar with iteration, reward and throughput on a terminal; one summary
line per iteration otherwise (logs, CI). Between them the line names the phase the loop is
in (rollout, train, sync, eval) with its progress, so a long train step never reads as a
rollout."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

from agentrl.env import SAFETY_MAX_TURNS

PHASES = ("rollout", "train", "sync", "eval")
# an env's per-episode "above_chance" (info["metrics"]): a figure a prompt-ignoring policy cannot raise
# (target-token's), shown beside the reward
ABOVE_CHANCE = "env/above_chance_mean"


class Progress:
    #: without a terminal, a line with the current phase at most this often (seconds)
    plain_every_s = 30.0

    def __init__(self, enabled: bool = True):
        self.console = Console(stderr=True)
        self.enabled = enabled
        self.live = enabled and sys.stderr.isatty()
        self._last_line = time.monotonic()
        self._bar: RichProgress | None = None
        self._task = None
        self._samples = 0  # trajectories finished this iteration (rollout and, --async, during training)
        self._phase, self._phase_note, self._phase_t0 = "rollout", "", time.monotonic()
        self._eval_samples = 0
        self.detail = None  # () -> str: the rollout's state (groups ready / target, failures), set by the loop
        self.chance_reward: float | None = None  # the best prompt-ignoring policy's reward, shown beside the reward
        self._rewards: list[float] = []
        self._above_chance: list[float] = []

    def note(self, text: str) -> None:
        self.console.print(f"[agentrl] {text}", highlight=False, markup=False, soft_wrap=True)

    def start(self, total: int, completed: int = 0) -> None:
        if self.live:
            self._bar = RichProgress(TextColumn("iteration"), MofNCompleteColumn(), BarColumn(),
                                     TextColumn("{task.description}"), TimeElapsedColumn(), console=self.console)
            self._bar.start()
            self._task = self._bar.add_task("starting", total=total, completed=completed)

    def phase(self, name: str, note: str = "") -> None:
        """The loop entered phase `name` (one of PHASES); `note` says what it works on ("128 samples")."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        self._phase, self._phase_note, self._phase_t0 = name, note, time.monotonic()
        if name == "eval":
            self._eval_samples = 0
        self.tick()

    def advance_samples(self) -> None:
        self._samples += 1
        self.tick()

    def advance_eval_samples(self) -> None:
        self._eval_samples += 1
        self.tick()

    def status(self) -> str:
        """The current phase and its progress: what the live line (or a plain line) says."""
        rollout = f"{self._samples} trajectories done" + (f"; {self.detail()}" if self.detail else "")
        if self._phase == "rollout":
            return f"rollout: {rollout}"
        elapsed = f"{self._phase}: {time.monotonic() - self._phase_t0:.0f}s"
        if self._phase_note:
            elapsed += f" ({self._phase_note})"
        if self._phase == "eval":
            return f"{elapsed}; {self._eval_samples} eval trajectories done"
        return f"{elapsed}; rollout goes on: {rollout}" if self._samples else elapsed

    def tick(self) -> None:
        """Refresh the status line; the loop also calls it on a timer, so a long phase still
        prints a line at least every `plain_every_s` without a terminal."""
        if self._bar is not None:
            self._bar.update(self._task, description=self.status())
        elif self.enabled and time.monotonic() - self._last_line >= self.plain_every_s:  # logs, CI: still alive
            self._last_line = time.monotonic()
            self.console.print(f"  {self.status()}", highlight=False, markup=False)

    def iteration_done(self, m: dict) -> None:
        self._samples, self._last_line = 0, time.monotonic()
        self._rewards.append(m["reward_mean"])
        above = m.get(ABOVE_CHANCE)
        if above is not None:
            self._above_chance.append(above)
        self._phase, self._phase_note, self._phase_t0 = "rollout", "", time.monotonic()
        reward = f"reward {m['reward_mean']:.3f}"
        if self.chance_reward is not None:
            reward += f" (prompt-ignoring best {self.chance_reward:.3f})"
        if above is not None:
            reward += f"  above chance {above:.3f}"
        line = (f"iter {m['rollout_id']}: {reward}  len {m['response_len_mean']:.1f}  "
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
            self._bar.update(self._task, advance=1, description=f"{reward}, {m['tokens_per_s']:.0f} tok/s")
            self._bar.console.print(line, highlight=False, markup=False, soft_wrap=True)
        else:
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)
        if m.get("truncated/safety_max_turns"):  # an env that sets no max_turns never terminated these
            self.note(f"warning: {m['truncated/safety_max_turns']} episodes hit the safety limit of "
                      f"{SAFETY_MAX_TURNS} turns (the env sets no max_turns and did not terminate them): "
                      "set the env's max_turns or --max-turns")

    def summary(self, last: int = 10) -> str | None:
        """The run's reward at its start and end, beside what a prompt-ignoring policy scores."""
        if len(self._rewards) < 2:
            return None
        n = min(last, len(self._rewards) // 2)

        def first_last(values):
            return sum(values[:n]) / n, sum(values[-n:]) / n

        first, final = first_last(self._rewards)
        line = f"reward: first {n} iterations {first:.3f}, last {n} {final:.3f}"
        if self.chance_reward is not None:
            line += f"; the best policy that ignores the prompt scores {self.chance_reward:.3f}"
            if self.chance_reward > 0:
                line += f" ({final / self.chance_reward:.1f}x that)"
        if len(self._above_chance) == len(self._rewards):
            first, final = first_last(self._above_chance)
            line += f". Above chance: first {n} {first:.3f}, last {n} {final:.3f} (any prompt-ignoring policy: 0)"
        return line

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
