"""Retrieval backends of the `search` tool: a local BM25 index over a JSONL corpus, or a
remote service speaking Search-R1's ``/retrieve`` HTTP API.

Corpus: JSONL rows ``{"id": ..., "contents": "\\"Title\\"\\ntext"}`` (Search-R1's wiki-18
format: the first line of ``contents`` is the title). The BM25 index (bm25s) is built on
first use and cached under ``$AGENTRL_CACHE/bm25/<hash of the corpus file>/`` (default
``~/.cache/agentrl``), so later runs load it in a moment.

Remote API (Search-R1's retrieval server)::

    POST /retrieve  {"queries": ["q1", ...], "topk": 3, "return_scores": true}
    ->  {"result": [[{"document": {"id": ..., "contents": ...}, "score": 1.2}, ...], ...]}

Both return, per query, a list of `Passage` (id, contents, score), best first.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Passage:
    id: str
    contents: str
    score: float = 0.0

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0].strip().strip('"')

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1].strip() if len(parts) > 1 else ""

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "contents": self.contents, "score": self.score}


class RetrievalError(RuntimeError):
    """The retriever could not answer (bad corpus, unreachable or malformed service)."""


class Retriever(Protocol):
    async def search(self, queries: list[str], topk: int = 3) -> list[list[Passage]]: ...


def format_passages(passages: list[Passage]) -> str:
    """Search-R1's rendering of results, byte for byte (search_r1/llm_agent/generation.py,
    _passages2string): ``Doc 1(Title: <first line>) <the other lines>`` lines; the title keeps
    the corpus's quotes (wiki-18 stores ``"Title"\ntext``)."""
    out = ""
    for i, p in enumerate(passages):
        title, *rest = p.contents.split("\n")
        text = "\n".join(rest)
        out += f"Doc {i + 1}(Title: {title}) {text}\n"
    return out


def cache_root() -> Path:
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))


def load_corpus(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL corpus; each needs ``contents`` (``id`` defaults to the row number)."""
    p = Path(path)
    if not p.is_file():
        raise RetrievalError(f"corpus {path}: no such file")
    from agentrl.data import iter_jsonl

    rows = []
    for lineno, row in iter_jsonl(p, error=RetrievalError):
        if not isinstance(row.get("contents"), str):
            raise RetrievalError(f"{path}:{lineno}: a corpus row needs a string 'contents' key")
        rows.append({"id": str(row.get("id", len(rows))), "contents": row["contents"]})
    if not rows:
        raise RetrievalError(f"corpus {path}: no rows")
    return rows


_TOKEN_RE = r"(?u)\b\w+\b"  # keep 1-character tokens and digits (years, single letters)


class BM25Retriever:
    """BM25 over a JSONL corpus with bm25s; the index is cached next to nothing the user owns
    (``$AGENTRL_CACHE/bm25/``) and keyed by the corpus content."""

    def __init__(self, corpus_path: str | Path, *, cache_dir: str | Path | None = None, k1: float = 1.5,
                 b: float = 0.75):
        import bm25s

        self.corpus_path = Path(corpus_path)
        self.docs = load_corpus(self.corpus_path)
        digest = hashlib.sha256(self.corpus_path.read_bytes()).hexdigest()[:16]
        self.index_dir = Path(cache_dir) if cache_dir else cache_root() / "bm25" / f"{digest}-k{k1}-b{b}"
        self._lock = threading.Lock()  # bm25s retrieval is not documented as thread-safe
        if (self.index_dir / "params.index.json").exists():
            self.bm25 = bm25s.BM25.load(str(self.index_dir), show_progress=False)
            log.info("loaded BM25 index of %s from %s", self.corpus_path, self.index_dir)
        else:
            self.bm25 = bm25s.BM25(k1=k1, b=b)
            tokens = bm25s.tokenize([d["contents"] for d in self.docs], token_pattern=_TOKEN_RE,
                                    stopwords="en", show_progress=False)
            self.bm25.index(tokens, show_progress=False)
            tmp = self.index_dir.with_name(self.index_dir.name + f".tmp{os.getpid()}")
            try:
                self.bm25.save(str(tmp), show_progress=False)
                if self.index_dir.exists():  # another process won the race
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    tmp.replace(self.index_dir)
            except OSError as exc:  # a read-only cache is not fatal: the index lives in memory
                log.warning("could not cache the BM25 index in %s: %s", self.index_dir, exc)
            log.info("built BM25 index of %s (%d docs) in %s", self.corpus_path, len(self.docs), self.index_dir)

    def search_sync(self, queries: list[str], topk: int = 3) -> list[list[Passage]]:
        import bm25s

        k = max(1, min(int(topk), len(self.docs)))
        out: list[list[Passage]] = []
        for query in queries:
            tokens = bm25s.tokenize([query], token_pattern=_TOKEN_RE, stopwords="en", return_ids=False,
                                    show_progress=False)
            if not any(tokens[0]):
                out.append([])
                continue
            with self._lock:
                idx, scores = self.bm25.retrieve(tokens, k=k, show_progress=False, n_threads=1)
            hits = [Passage(self.docs[int(i)]["id"], self.docs[int(i)]["contents"], float(s))
                    for i, s in zip(idx[0], scores[0]) if float(s) > 0]
            out.append(hits)
        return out

    async def search(self, queries: list[str], topk: int = 3) -> list[list[Passage]]:
        return await asyncio.to_thread(self.search_sync, queries, topk)


class RemoteRetriever:
    """Client of a Search-R1 retrieval service (``POST {url}`` with ``/retrieve``'s JSON)."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, retries: int = 2):
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout_s, self.retries = timeout_s, retries

    async def search(self, queries: list[str], topk: int = 3) -> list[list[Passage]]:
        from agentrl.http import HTTPCallError, RetryPolicy, json_session, post_json

        payload = {"queries": list(queries), "topk": int(topk), "return_scores": True}
        # no answer or a 5xx is sent again (0.2 s, 0.4 s, ... jittered); a 4xx will not get better on retry
        retry = RetryPolicy(attempts=self.retries + 1, backoff_s=0.2, max_backoff_s=5.0)
        try:
            async with json_session(timeout_s=self.timeout_s) as http:
                body, _ = await post_json(http, self.url, payload, retry=retry, expect_json=True)
        except HTTPCallError as exc:
            raise RetrievalError(f"retrieval service {self.url} failed: {type(exc).__name__}: {exc}") from None
        return self._parse(body, len(queries))

    def _parse(self, body: Any, n: int) -> list[list[Passage]]:
        result = body.get("result") if isinstance(body, dict) else None
        if not isinstance(result, list) or len(result) != n:
            raise RetrievalError(f"{self.url}: expected {{'result': [{n} lists]}}, got {str(body)[:200]}")
        out = []
        for hits in result:
            passages = []
            for hit in hits:
                doc = hit.get("document", hit) if isinstance(hit, dict) else None
                if not isinstance(doc, dict) or "contents" not in doc:
                    raise RetrievalError(f"{self.url}: a hit without document.contents: {str(hit)[:200]}")
                passages.append(Passage(str(doc.get("id", "")), str(doc["contents"]), float(hit.get("score", 0.0))))
            out.append(passages)
        return out


_CACHE: dict[tuple, Retriever] = {}
_CACHE_LOCK = threading.Lock()


def get_retriever(corpus: str | Path | None = None, url: str | None = None) -> Retriever:
    """One retriever per (corpus, url) per process: the BM25 index is built or loaded once."""
    if (corpus is None) == (url is None):
        raise ValueError("give exactly one of corpus (a JSONL file) or url (a /retrieve service)")
    key = ("url", url) if url else ("bm25", str(Path(corpus).resolve()))
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = RemoteRetriever(url) if url else BM25Retriever(corpus)
        return _CACHE[key]


def normalize_query(query: str, max_chars: int = 512) -> str:
    return re.sub(r"\s+", " ", query).strip()[:max_chars]
