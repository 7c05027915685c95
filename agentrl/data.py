"""Prompt sources and their position, so a resumed run continues where it stopped.

A task is a dict ``{"prompt": str | list[message], "label": ..., "metadata": {...},
"env": optional env name}``; it reaches the env as ``reset(options=task)``. An env without a
dataset gets empty tasks (`seed_tasks`): ``reset(seed=<the group's seed>, options=None)``.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any, Callable, Iterator

from agentrl.errors import ConfigError, DatasetError


def _check_prompt(prompt: Any, where: str) -> None:
    if isinstance(prompt, str) and prompt:
        return
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m and "content" in m
                                                   for m in prompt):
        return
    raise DatasetError(f"{where}: the prompt must be a non-empty string or a list of chat messages, got {prompt!r:.80}")


def iter_jsonl(path: str | Path, error: type[Exception] = DatasetError) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSONL file; a line that is not a
    JSON object raises `error` naming file and line."""
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path}:{lineno}: not valid JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(row, dict):
                raise error(f"{path}:{lineno}: a row must be a JSON object")
            yield lineno, row


def json_list_label(label: Any) -> Any:
    """A label stored as a JSON list in a string (a Parquet or CSV column cannot hold a list)
    as that list; any other label as it is."""
    if isinstance(label, str):
        try:
            parsed = json.loads(label)
        except ValueError:
            return label
        if isinstance(parsed, list):
            return parsed
    return label


def existing_data_file(path: str, flag: str = "--prompt-data") -> Path:
    """The data file's Path; DatasetError naming the flag when there is no such file."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{flag} {path}: no such file")
    return p


def numbered_rows(path: str, flag: str = "--prompt-data") -> list[tuple[str, dict[str, Any]]]:
    """(where, row) for each row of a JSONL or parquet file; `where` names file and line (or row),
    a missing file the flag that named it."""
    p = existing_data_file(path, flag)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            raw = pq.read_table(p).to_pylist()
        except Exception as exc:
            raise DatasetError(f"{path}: cannot read parquet: {exc}") from exc
        return [(f"{path}: row {i + 1}", row) for i, row in enumerate(raw)]
    return [(f"{path}:{lineno}", row) for lineno, row in iter_jsonl(p)]


def read_rows(path: str, *, input_key: str = "prompt", label_key: str = "label",
              metadata_key: str = "metadata", label_needed_by: str | None = None,
              flag: str = "--prompt-data", multimodal_keys: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Read a JSONL or parquet prompt file into tasks; a bad row names file and line.
    `label_needed_by`: the env that grades against the label (its rows must have one).
    `multimodal_keys` (--multimodal-keys, slime's ``{"image": "images"}``): the row's media, loaded
    and placed at the prompt's ``<image>`` placeholders as image parts (agentrl/vision.py)."""
    tasks, has_label, keys, unlabelled = [], False, set(), None
    for where, row in numbered_rows(path, flag):
        has_label, keys = has_label or label_key in row, keys | set(row)
        if input_key not in row:
            raise DatasetError(f"{where}: no {input_key!r} key (set --input-key); keys are {sorted(row)}")
        _check_prompt(row[input_key], where)
        if label_needed_by and row.get(label_key) is None and row.get("env") in (None, "", label_needed_by):
            unlabelled = unlabelled or (where, sorted(row))
        metadata = row.get(metadata_key) or {}
        if not isinstance(metadata, dict):
            raise DatasetError(f"{where}: {metadata_key!r} must be an object")
        prompt = row[input_key]
        if multimodal_keys:
            prompt = _with_media(prompt, row, multimodal_keys, where, Path(path).parent)
        task = {"prompt": prompt, "label": row.get(label_key), "metadata": metadata}
        if row.get("env"):
            task["env"] = row["env"]
        tasks.append(task)
    if not tasks:
        raise DatasetError(f"{path}: no rows")
    if (label_key != "label" or label_needed_by) and not has_label:  # "label" may be absent (envs without labels)
        needs = f", which env {label_needed_by!r} grades against" if label_needed_by else ""
        raise DatasetError(f"{path}: no row has the label key {label_key!r} (--label-key){needs}; the rows' keys are "
                           f"{sorted(keys)}")
    if unlabelled:
        raise DatasetError(f"{unlabelled[0]}: no label under {label_key!r} (--label-key), which env "
                           f"{label_needed_by!r} grades against; keys are {unlabelled[1]}")
    return tasks


def _with_media(prompt: Any, row: dict, multimodal_keys: dict[str, str], where: str, base_dir: Path) -> Any:
    """The row's prompt with its images in (vision.prompt_with_images); a row without the field has none."""
    from agentrl.vision import prompt_with_images, to_data_url

    media = {}
    for kind, field in multimodal_keys.items():
        items = row.get(field)
        if items is None:
            continue
        if isinstance(items, (str, bytes, dict)):
            raise DatasetError(f"{where}: {field!r} (--multimodal-keys {kind}) must be a list of images, got "
                               f"{type(items).__name__}")
        media[field] = [to_data_url(item, where=f"{where}: {field}[{i}]", base_dir=base_dir)
                        for i, item in enumerate(items)]
    return prompt_with_images(prompt, media, where)


def shuffled_epochs(rows: list[dict], seed: int = 0) -> Iterator[dict]:
    """`rows` endlessly, reshuffled every epoch with a seeded RNG: an env's task generator."""
    epoch = 0
    while True:
        order = list(range(len(rows)))
        random.Random(f"{seed}-{epoch}").shuffle(order)
        for i in order:
            yield rows[i]
        epoch += 1


def seed_tasks() -> Iterator[dict]:
    """The tasks of an env without a dataset: empty, endlessly. Each group's env makes its
    episode from the group's own seed alone: ``reset(seed=..., options=None)``."""
    while True:
        yield {}


class PromptSource:
    """Hands out batches of tasks; `state_dict()` is the data position for resume.

    A finite list is shuffled per epoch with a seeded RNG; a generator factory (an env's
    task generator, possibly infinite) is re-created and fast-forwarded on resume.
    """

    def __init__(self, tasks: list[dict] | None = None, *, generator: Callable[[], Iterator[dict]] | None = None,
                 shuffle: bool = True, seed: int = 0, difficulty_window: int | None = None,
                 revisit_prob: float = 0.1):
        if (tasks is None) == (generator is None):
            raise ValueError("give exactly one of tasks or generator")
        if difficulty_window is not None and tasks is None:
            raise ConfigError("--difficulty-window keeps each prompt's recent results, so it needs a finite dataset "
                              "(--prompt-data); this env generates its tasks")
        self.tasks, self.generator, self.shuffle, self.seed = tasks, generator, shuffle, seed
        self.epoch, self.offset, self.consumed = 0, 0, 0
        self._order: list[int] = []
        self._iter: Iterator[dict] | None = None
        # difficulty-aware sampling: per task index, whether each of its last groups had one reward for all
        self.difficulty_window, self.revisit_prob = difficulty_window, revisit_prob
        self._settled: dict[int, list[bool]] = {}
        self._index = {id(t): i for i, t in enumerate(tasks)} if tasks is not None else {}
        self.skipped = 0
        if tasks is not None:
            self._reshuffle()

    def _reshuffle(self) -> None:
        self._order = list(range(len(self.tasks)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(self._order)

    def next_batch(self, n: int) -> list[dict]:
        batch = []
        for _ in range(n):
            if self.tasks is not None:
                for passed in range(max(1, len(self.tasks))):  # bounded: when every task is settled, the next one is taken
                    if self.offset >= len(self._order):
                        self.epoch, self.offset = self.epoch + 1, 0
                        self._reshuffle()
                    index = self._order[self.offset]
                    self.offset += 1
                    if passed + 1 >= len(self.tasks) or not self._skip(index):
                        break
                    self.skipped += 1
                batch.append(self.tasks[index])
            else:
                if self._iter is None:
                    self._iter = itertools.islice(iter(self.generator()), self.consumed, None)
                try:
                    batch.append(next(self._iter))
                except StopIteration:
                    self._iter = iter(self.generator())  # a finite generator starts over
                    self.epoch += 1
                    batch.append(next(self._iter))
            self.consumed += 1
        for i, task in enumerate(batch):
            if task:  # {}: a seed-only task (seed_tasks)
                _check_prompt(task.get("prompt"), f"task {self.consumed - len(batch) + i}")
        return batch

    def _skip(self, index: int) -> bool:
        """Difficulty-aware sampling: a task whose last --difficulty-window groups each gave every sample
        the same reward (always or never solved: no GRPO signal) is skipped, but revisited with
        probability --difficulty-revisit-prob (the policy may have changed). Seeded by position,
        so a resumed run makes the same choices."""
        recent = self._settled.get(index, [])
        if self.difficulty_window is None or len(recent) < self.difficulty_window or not all(recent):
            return False
        return random.Random(f"{self.seed}:{self.epoch}:{self.offset}").random() >= self.revisit_prob

    def observe(self, task: dict, rewards: list[float]) -> None:
        """A finished group of `task` (from next_batch): remember whether its rewards were all equal."""
        index = self._index.get(id(task))
        if self.difficulty_window is None or index is None or not rewards:
            return
        recent = self._settled.setdefault(index, [])
        recent.append(max(rewards) - min(rewards) < 1e-9)
        del recent[:-self.difficulty_window]

    def metrics(self) -> dict:
        if self.difficulty_window is None:
            return {}
        settled = sum(len(r) >= self.difficulty_window and all(r) for r in self._settled.values())
        return {"difficulty/skipped": self.skipped, "difficulty/settled_tasks": settled}

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "offset": self.offset, "consumed": self.consumed}
        if self.difficulty_window is not None:
            state |= {"settled": {str(i): r for i, r in self._settled.items()}, "skipped": self.skipped}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset, self.consumed = state["epoch"], state["offset"], state["consumed"]
        self._settled = {int(i): list(r) for i, r in state.get("settled", {}).items()}
        self.skipped = state.get("skipped", 0)
        if self.tasks is not None:
            self._reshuffle()
        self._iter = None
