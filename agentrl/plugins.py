"""Load user functions named on the command line: "package.module.fn" or "path/to/file.py:fn"."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Callable

from agentrl.errors import ConfigError


def load_function(spec: str, *, flag: str) -> Callable:
    if ":" in spec and spec.split(":")[0].endswith(".py"):
        path, name = spec.rsplit(":", 1)
        if not Path(path).is_file():
            raise ConfigError(f"{flag} {spec}: no such file {path}")
        module_spec = importlib.util.spec_from_file_location(f"agentrl_user_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module_name, _, name = spec.rpartition(".")
        if not module_name:
            raise ConfigError(f"{flag} {spec}: expected package.module.function or file.py:function")
        module = importlib.import_module(module_name)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{flag} {spec}: {name!r} is not a function of {module.__name__}")
    return fn
