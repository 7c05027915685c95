"""One builder at a time of what is built once per machine (~/.cache/agentrl, the sandbox image):
pytest-xdist's workers, or a suite in another checkout, would build it at once."""

import contextlib
import fcntl
import tempfile
from pathlib import Path


@contextlib.contextmanager
def machine_lock(name: str):
    with open(Path(tempfile.gettempdir()) / f"agentrl-tests-{name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
