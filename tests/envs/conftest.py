"""Fixtures of the built-in env tests (helpers live in envtest_helpers.py)."""

import asyncio

import pytest


@pytest.fixture
def run_async():
    return asyncio.run
