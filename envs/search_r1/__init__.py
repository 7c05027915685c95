"""search-r1: question answering with a search engine, the Search-R1 protocol.

The model reasons in ``<think>``, asks ``<search> query </search>``, gets the top-k passages
back as the next user message ``<information> ... </information>`` (or, with
``observation="append"``, appended to its own reply as Search-R1 does; passages rendered as
Search-R1 renders them, prompt byte-identical to its make_prefix), and ends with
``<answer> ... </answer>``. Reward: exact match after Search-R1's normalization (lowercase,
no punctuation, no articles, single spaces) against any of the gold answers, or token F1
(``reward="f1"``).

Retrieval goes through the `search` MCP tool server (agentrl.tools.search_server): by default
an in-process server over a BM25 index of the corpus; ``search_server="stdio"`` runs it as a
subprocess per trajectory; ``search_server="http://host:port/mcp"`` uses one already running.
``retriever_url`` points the server at a Search-R1 ``/retrieve`` service instead of BM25.

Data: the built-in set (envs/search_r1/data/, invented entities, see make_data.py) or any
NQ/HotpotQA-shaped JSONL: ``--prompt-data nq.jsonl --input-key question --label-key golden_answers``.
"""

from __future__ import annotations

import asyncio
import json
import re
import string
import sys
import tempfile
import threading
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Iterator

from agentrl.env import Env
from agentrl.data import json_list_label, shuffled_epochs
from agentrl.registry import register_env
from agentrl.tools.parsers import valid_unicode

DATA_DIR = Path(__file__).with_name("data")
DEFAULT_CORPUS = DATA_DIR / "corpus.jsonl"

# Search-R1's instruction (scripts/data_process/nq_search.py, make_prefix).
TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge needed, "
    "you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: {question}\n"
)
# Search-R1's reply to output with neither a search nor an answer.
INVALID = ("My previous action is invalid. If I want to search, I should put the query between <search> and "
           "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
           "Let me try again.")
ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


# -- scoring (Search-R1's qa_em.py) ----------------------------------------------------------------
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    s = str(s).lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def gold_answers(label: Any) -> list[str]:
    """The gold answers of a label: a string, a list, or Search-R1's ``{"target": [...]}``."""
    if isinstance(label, dict):
        label = label.get("target", label.get("golden_answers", label.get("answer", [])))
    label = json_list_label(label)
    if isinstance(label, (str, int, float)):
        return [str(label)]
    return [str(x) for x in (label or [])]


def exact_match(prediction: str, golds: list[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def f1_score(prediction: str, golds: list[str]) -> float:
    best = 0.0
    pred_tokens = normalize_answer(prediction).split()
    for gold in golds:
        gold_tokens = normalize_answer(gold).split()
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if not pred_tokens or not gold_tokens or common == 0:
            continue
        precision, recall = common / len(pred_tokens), common / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def parse_action(text: str) -> tuple[str | None, str]:
    """("search" | "answer", content) of the first complete tag, or (None, ""): what
    ``ACTION_RE.search`` finds (Search-R1's regex), in linear time. The regex retries its lazy
    scan at every unclosed opening tag: 160 KB of ``<search>`` took 24 s."""
    found = []
    for kind in ("search", "answer"):
        at = text.find(f"<{kind}>")
        start = at + len(kind) + 2
        close = text.find(f"</{kind}>", start) if at >= 0 else -1
        if close >= 0:  # a later opening of this kind has a closing after it only if this one does
            found.append((at, kind, text[start:close].strip()))
    if not found:
        return None, ""
    _, kind, content = min(found)
    return kind, content


def read_questions(path: str | Path) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [{"prompt": r["question"], "label": r["golden_answers"],
             "metadata": {k: v for k, v in r.items() if k not in ("question", "golden_answers")}} for r in rows]


# -- the search connection -------------------------------------------------------------------------
_IN_PROCESS: dict[tuple, Any] = {}
_IN_PROCESS_LOCK = threading.Lock()


def _in_process_server(corpus: str | None, retriever_url: str | None, topk: int):
    """One in-process MCP search server per (corpus, url, topk) per process: the index loads once."""
    from agentrl.tools.search_server import build_server

    key = (corpus, retriever_url, topk)
    with _IN_PROCESS_LOCK:
        if key not in _IN_PROCESS:
            _IN_PROCESS[key] = build_server(corpus=corpus, retriever_url=retriever_url, default_topk=topk)
        return _IN_PROCESS[key]


class SearchError(RuntimeError):
    """The search tool failed for reasons that are not the model's: the trajectory fails."""


@register_env("search-r1")
class SearchR1Env(Env):
    """Search-R1: reason in <think>, <search> query </search> -> <information>top-k passages</information>,
    end with <answer>; reward exact match (or F1) against the gold answers.

    kwargs: ``topk`` (passages per search, 3), ``reward`` ("em" | "f1"), ``corpus`` (JSONL
    {id, contents}; default the built-in synthetic corpus), ``retriever_url`` (a Search-R1
    /retrieve service instead of BM25), ``search_server`` (None: in-process MCP server;
    "stdio": a server subprocess per trajectory; "http://host:port/mcp": a running server),
    ``max_turns`` (4), ``obs_role`` ("user"), ``observation`` ("chat": the passages as the next
    message ``<information>...</information>``; "append": Search-R1's own text as generation.py
    appends it to the model's continuation, ``\n\n<information>...</information>\n\n`` and its
    ``\n``-wrapped invalid-action reply, in ``"continuation"`` messages: no new chat turn, the
    assistant's turn goes on -- byte for byte Search-R1's text with the chat template (its prompt
    rendered with the generation prompt, then the turns concatenated) or without it), ``data`` /
    ``split`` (questions of the built-in
    dataset: a JSONL with question + golden_answers, or split "train" | "test")."""

    description = "Search-R1: <search> a BM25/remote retriever over MCP, <answer> scored by exact match."
    max_turns = 4
    needs_label = True  # graded against the task's label: data without one fails at start
    stop = ["</search>", "</answer>"]  # as Search-R1: the env answers right after the tag
    default_config = {"rollout_max_response_len": 1024, "rollout_max_tokens_per_turn": 256}

    def __init__(self, topk: int = 3, reward: str = "em", corpus: str | None = None, retriever_url: str | None = None,
                 search_server: str | None = None, max_turns: int | None = None, obs_role: str = "user",
                 observation: str = "chat",
                 format_score: float = 0.0, data: str | None = None, split: str = "train"):
        if reward not in ("em", "f1"):
            raise ValueError(f"search-r1: reward must be 'em' or 'f1', got {reward!r}")
        if corpus and retriever_url:
            raise ValueError("search-r1: give corpus or retriever_url, not both")
        if observation not in ("chat", "append"):
            raise ValueError(f"search-r1: observation must be 'chat' or 'append', got {observation!r}")
        self.topk, self.reward_kind, self.obs_role, self.observation = int(topk), reward, obs_role, observation
        self.format_score = float(format_score)
        self.retriever_url = retriever_url
        self.corpus = None if retriever_url else str(corpus or DEFAULT_CORPUS)
        if self.corpus and not Path(self.corpus).is_file():
            raise FileNotFoundError(f"search-r1: corpus {self.corpus} does not exist")
        self.search_server = search_server
        self.dataset_kwargs = {"data": data, "split": split}  # reset() without a task draws a question from them
        if max_turns is not None:
            self.max_turns = int(max_turns)
        self.golds: list[str] = []
        self.searches: list[str] = []
        self._stack: AsyncExitStack | None = None
        self._client = None

    # -- data ------------------------------------------------------------------------------------
    @classmethod
    def dataset(cls, seed: int = 0, data: str | None = None, split: str = "train", **_) -> Iterator[dict]:
        """The questions, reshuffled every epoch (seeded), endlessly."""
        return shuffled_epochs(read_questions(data or DATA_DIR / f"{split}.jsonl"), seed)

    # -- episode ---------------------------------------------------------------------------------
    def _start(self, seed: int | None, options: dict | None) -> tuple[Any, dict]:
        Env.reset(self, seed=seed)  # seeds np_random (gymnasium's super().reset; areset shares this)
        options = options or {}
        if options.get("prompt") is None:  # no task given: a question drawn with the seeded np_random
            options = self.seeded_task()
        prompt = options.get("prompt")
        if prompt is None:
            raise ValueError("search-r1: the task has no prompt (the question)")
        self.golds = gold_answers(options.get("label"))
        if not self.golds:
            raise ValueError("search-r1: the task has no gold answers (set --label-key, e.g. golden_answers)")
        self.searches = []
        if isinstance(prompt, list):  # already formatted chat messages
            return prompt, {}
        question = str(prompt).strip()
        if "<search>" in question:  # already carries the instruction
            return question, {}
        question = question if question.endswith("?") else question + "?"
        return TEMPLATE.format(question=question), {}

    def reset(self, *, seed=None, options=None):
        return self._start(seed, options)

    async def areset(self, *, seed=None, options=None):
        return self._start(seed, options)

    def _judge(self, text: str):
        """(kind, content) of the action, and the final step's tuple if it ends the episode."""
        kind, content = parse_action(text)
        if kind == "answer":
            em, f1 = exact_match(content, self.golds), f1_score(content, self.golds)
            score = em if self.reward_kind == "em" else f1
            if score == 0.0:
                score = self.format_score
            info = {"answer": content, "em": em, "f1": f1, "searches": len(self.searches), "metrics": {"answered": 1}}
            return kind, content, ([], score, True, False, info)
        if kind == "search" and content:
            return kind, content, None
        invalid = f"\n{INVALID}\n" if self.observation == "append" else INVALID  # generation.py:396-398
        return None, "", (self._message(invalid), 0.0, False, False, {"invalid": True, "searches": len(self.searches),
                                                                     "metrics": {"invalid_actions": 1}})

    def _information(self, text: str):
        info = f"<information>{text.strip()}</information>"
        if self.observation == "append":  # Search-R1's generation.py:391
            info = f"\n\n{info}\n\n"
        return self._message(info), 0.0, False, False, {"query": self.searches[-1], "searches": len(self.searches),
                                                         "metrics": {"searches": 1}}

    def _message(self, text: str) -> list[dict]:
        if self.observation == "append":  # no new chat turn: the text continues the model's own reply
            return [{"role": self.obs_role, "content": text, "continuation": True}]
        return [{"role": self.obs_role, "content": text}]

    async def astep(self, action):
        kind, content, done = self._judge(str(action))
        if done is not None:
            return done
        self.searches.append(content)
        return self._information(await self.search(valid_unicode(content)))

    def step(self, action):
        kind, content, done = self._judge(str(action))
        if done is not None:
            return done
        self.searches.append(content)

        async def once():
            try:
                return await self.search(valid_unicode(content))
            finally:
                await self.aclose()

        return self._information(asyncio.run(once()))

    # -- the search tool -------------------------------------------------------------------------
    def _target(self):
        if self.search_server is None:  # a big corpus takes a while to index: callers use a thread
            return _in_process_server(self.corpus, self.retriever_url, self.topk)
        if self.search_server == "stdio":
            from mcp.client.stdio import StdioServerParameters, stdio_client

            source = ["--corpus", self.corpus] if self.corpus else ["--retriever-url", self.retriever_url]
            params = StdioServerParameters(command=sys.executable,
                                           args=["-m", "agentrl.tools.search_server", *source, "--topk", str(self.topk)])
            # its stderr to a file of our own: the SDK's default is the sys.stderr of when mcp was first
            # imported, which may have no file descriptor (a notebook's, a test's capture) and fail the spawn
            errlog = self._stack.enter_context(tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace"))
            return stdio_client(params, errlog=errlog)
        return self.search_server  # the URL of a running MCP server

    async def search(self, query: str) -> str:
        """Call the `search` MCP tool; the passages as Search-R1 renders them."""
        from mcp import Client

        if self._client is None:
            self._stack = AsyncExitStack()
            try:
                target = await asyncio.to_thread(self._target)  # builds/loads the BM25 index off the loop
                self._client = await self._stack.enter_async_context(Client(target, read_timeout_seconds=60))
            except Exception as exc:
                await self.aclose()
                raise SearchError(f"cannot connect to the search server {self.search_server or '(in-process)'}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        result = await self._client.call_tool("search", {"query": query, "topk": self.topk})
        text = "".join(getattr(c, "text", "") for c in result.content)
        if result.is_error:
            raise SearchError(f"search tool error for query {query!r}: {text}")
        return text

    async def aclose(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    def close(self) -> None:
        pass
