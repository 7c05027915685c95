"""Fixtures of the tools tests, imported by each test module (not a conftest.py: root tests
import helpers with `from conftest import ...`, which another conftest.py would shadow)."""
import asyncio
import sys
from pathlib import Path

import pytest

DEMO_SERVER = Path(__file__).with_name("demo_server.py")


@pytest.fixture(scope="module")
def arun():
    """Run a coroutine on one event loop per test module (servers started in one test of the
    module stay usable in the next)."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


@pytest.fixture(scope="session")
def demo_command() -> str:
    return f"{sys.executable} {DEMO_SERVER}"
