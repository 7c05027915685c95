"""Helpers shared by the top-level tests (a uniquely named module: several conftest.py
files exist under tests/, so `from conftest import ...` would be ambiguous)."""

import os
import sys
from pathlib import Path

BIN = Path(sys.executable).parent  # the venv's bin: agentrl, ray


def agentrl_cli() -> str:
    return str(BIN / "agentrl")


def run_env() -> dict:
    env = dict(os.environ)
    env.pop("AGENTRL_ENV_MODULES", None)
    return env
