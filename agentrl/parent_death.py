"""PR_SET_PDEATHSIG for children we fork or spawn: the kernel kills the child when the thread that
started it dies, even by SIGKILL, so a killed run leaves no engine or grader behind (Linux; elsewhere
a no-op, and atexit must do).

`prctl` is looked up here, at import, in the parent: a forked child (or a `preexec_fn`, which runs
between fork and exec) must not dlopen/dlsym, whose loader lock another thread of the parent may
have held at the fork; the child would wait on it forever."""

from __future__ import annotations

import signal
from typing import Callable


def _resolve_prctl() -> Callable | None:
    try:
        import ctypes
        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _resolve_prctl()
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child: SIGKILL when the parent thread goes. Safe between fork and exec."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
