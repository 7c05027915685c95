"""Where this process's served models answer (agentrl.teacher starts them): role ("judge",
"teacher") -> base URL. A leaf module, so the reward functions that read it (agentrl.judge)
import nothing of the engine machinery."""

from __future__ import annotations

_urls: dict[str, str] = {}


def served_url(role: str) -> str | None:
    """The base URL of the engine group serving `role` in this process, if one was started."""
    return _urls.get(role)


def set_served(role: str, url: str | None) -> None:
    if url is None:
        _urls.pop(role, None)
    else:
        _urls[role] = url.rstrip("/")
