"""Where a train step's time goes: slime's ``--use-pytorch-profiler`` in the training loop.

``--use-pytorch-profiler --profile-step-start S --profile-step-end E --profile-target T...``
profiles the train steps S..E-1 of this run (counted from 0: the trainer's first
`train_iteration` in this process, as slime's profiler schedule counts) with torch.profiler,
on every trainer rank. Targets, as slime names them:

- ``train_overall``: the whole iteration (old/reference/teacher logprob passes, values,
  advantages, the optimizer steps), each phase a labelled range in the trace;
- ``train_log_probs``: the logprob passes alone; ``train_actor``: the optimizer steps alone.

One profiler runs at a time, so with ``train_overall`` the other two are its labelled ranges
rather than traces of their own. Each profiled section writes, in ``--profile-dir`` (default
``<output-dir>/profile``), ``TARGET_rankR_stepS.json.gz`` (a Chrome trace: Perfetto or
chrome://tracing) and ``TARGET_rankR_stepS.txt`` (torch's table of operators by self time),
and its first line, which the driver prints, names the heaviest operators.
"""

from __future__ import annotations

import contextlib
import gzip
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

TARGETS = ("train_overall", "train_actor", "train_log_probs")


class TrainProfiler:
    """The profiler of one trainer rank; inert unless --use-pytorch-profiler."""

    def __init__(self, train=None):
        self.on = bool(train is not None and getattr(train, "use_pytorch_profiler", False))
        self.targets = set(train.profile_target) if self.on else set()
        self.start, self.end = (train.profile_step_start, train.profile_step_end) if self.on else (0, 0)
        self.folder = Path(train.profile_dir or "profile") if self.on else None
        self.step = -1  # train iterations begun in this process
        self._active = False  # a profiler is recording now: inner sections are labels in it
        self._ranges: set[str] = set()  # our own labelled ranges: not kernels, left out of the ranking
        self._summaries: list[str] = []  # written since the last take_summaries()

    def begin_step(self) -> None:
        self.step += 1

    def _profiling_now(self) -> bool:
        return self.on and self.start <= self.step < self.end

    @contextlib.contextmanager
    def section(self, target: str) -> Iterator[None]:
        """Profile this block as `target` when this step and target are asked for; inside another
        section's recording it is a labelled range of that trace."""
        if not self._profiling_now():
            yield
            return
        import torch

        if self._active:
            self._ranges.add(target)
            with torch.profiler.record_function(target):
                yield
            return
        if target not in self.targets:
            yield
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._active = True
        try:
            with torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True,
                                        with_flops=True, acc_events=True) as prof:
                yield
        finally:
            self._active = False
        self._write(prof, target, cuda=len(activities) > 1)

    def label(self, name: str):
        """A named range in the trace being recorded (a no-op otherwise)."""
        if not self._active:
            return contextlib.nullcontext()
        import torch

        self._ranges.add(name)
        return torch.profiler.record_function(name)

    def take_summaries(self) -> list[str]:
        """The one-line summaries of the tables written since the last call: they travel back with
        the step's metrics, so the driver prints them wherever this rank runs (another node too)."""
        out, self._summaries = self._summaries, []
        return out

    def _write(self, prof, target: str, *, cuda: bool) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self.folder / f"{target}_rank{rank}_step{self.step}"
        sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
        averages = prof.key_averages()
        self_time = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
        # a labelled range's GPU "self time" spans the kernels inside it: counted, it would rank first
        work = [e for e in averages if e.key not in self._ranges]
        total = sum(self_time(e) for e in work) or 1
        top = sorted(work, key=self_time, reverse=True)[:5]
        summary = (f"profile of train step {self.step} ({target}, rank {rank}): {stem}.json.gz; most self "
                   f"{'GPU' if cuda else 'CPU'} time: " + ", ".join(f"{e.key} {100 * self_time(e) / total:.0f}%"
                                                                  for e in top))
        table = averages.table(sort_by=sort_by, row_limit=40)
        stem.with_suffix(".txt").write_text(summary + "\n\n" + table + "\n")
        self._summaries.append(summary)
        with tempfile.NamedTemporaryFile(suffix=".json", dir=self.folder, delete=False) as tmp:
            raw = Path(tmp.name)
        try:
            prof.export_chrome_trace(str(raw))
            trace = Path(f"{stem}.json.gz")
            with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
        finally:
            raw.unlink(missing_ok=True)
