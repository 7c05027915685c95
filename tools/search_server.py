"""The `search` MCP tool server: top-k passages from a local BM25 index over a JSONL corpus,
or from a remote Search-R1 ``/retrieve`` service (see agentrl.tools.retrieval).

    python -m agentrl.tools.search_server --corpus corpus.jsonl            # stdio (default)
    python -m agentrl.tools.search_server --retriever-url http://host:8000/retrieve \\
        --transport streamable-http --port 8765                          # MCP at http://host:8765/mcp

Tools:
  * ``search(query, topk=3)`` -> the passages as Search-R1 renders them (``Doc 1(Title: t) text``
    lines); ``structured_content`` holds the same passages as ``{"id", "contents", "score"}``.

In-process use (no subprocess, the same MCP protocol): ``build_server(corpus=...)`` returns the
MCPServer; ``mcp.Client(server)`` connects to it directly.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from agentrl.tools.retrieval import (Passage, RetrievalError, format_passages, get_retriever, normalize_query)

MAX_TOPK = 50


def build_server(corpus: str | Path | None = None, retriever_url: str | None = None, *, default_topk: int = 3,
                 name: str = "search") -> MCPServer:
    """An MCP server with the `search` tool over the corpus or the remote retriever."""
    retriever = get_retriever(corpus=corpus, url=retriever_url)
    source = f"BM25 over {corpus}" if corpus else f"the retrieval service at {retriever_url}"
    server = MCPServer(name, instructions=f"Search a document collection ({source}).")

    @server.tool(structured_output=False)
    async def search(query: str, topk: int = default_topk) -> str:
        """Search the document collection; returns the top-k passages, best first, as
        'Doc i(Title: title) text' lines."""
        query = normalize_query(query)
        if not query:
            raise ToolError("the query is empty")
        topk = max(1, min(int(topk), MAX_TOPK))
        try:
            passages: list[Passage] = (await retriever.search([query], topk))[0]
        except RetrievalError as exc:
            raise ToolError(str(exc)) from None
        return format_passages(passages) if passages else "No results."

    @server.tool()
    async def retrieve(queries: list[str], topk: int = default_topk) -> list[list[dict[str, Any]]]:
        """Batch retrieval: for each query, the top-k passages as {id, contents, score}."""
        topk = max(1, min(int(topk), MAX_TOPK))
        try:
            results = await retriever.search([normalize_query(q) for q in queries], topk)
        except RetrievalError as exc:
            raise ToolError(str(exc)) from None
        return [[p.as_dict() for p in hits] for hits in results]

    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentrl.tools.search_server", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", help="JSONL corpus ({id, contents}) to index with BM25")
    source.add_argument("--retriever-url", help="Search-R1 retrieval service (http://host:port/retrieve)")
    parser.add_argument("--topk", type=int, default=3, help="default number of passages (default 3)")
    parser.add_argument("--transport", choices=["stdio", "streamable-http", "sse"], default="stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="search_server: %(message)s")
    try:
        server = build_server(corpus=args.corpus, retriever_url=args.retriever_url, default_topk=args.topk)
    except RetrievalError as exc:
        print(f"search_server: error: {exc}", file=sys.stderr)
        return 2
    if args.transport == "stdio":
        server.run("stdio")
    else:
        server.run(args.transport, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
