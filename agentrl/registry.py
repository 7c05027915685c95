"""The env registry: a dict of EnvSpecs, filled three ways.

1. ``@register_env("name")`` on an Env subclass or a factory function;
2. the entry-point group ``agentrl.envs`` (``name = "package.module:Class"``), read lazily,
   so pip-installed envs (and agentrl's own built-ins) need no import by hand;
3. ``--env-module MODULE_OR_PATH``: imported before lookup. A process started with the
   ``AGENTRL_ENV_MODULES`` environment variable imports the modules it lists, so a parent hands
   its modules to subprocesses and Ray workers there (`env_modules_environ`), and they resolve
   the same names (nothing is pickled from the parent).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from agentrl.errors import ConfigError, EnvNotFoundError, EnvRegistrationError

ENTRY_POINT_GROUP = "agentrl.envs"
ENV_MODULES_VAR = "AGENTRL_ENV_MODULES"


@dataclass
class EnvSpec:
    name: str
    entry_point: Any  # the class/factory, or "module:attr" not yet imported
    source: str  # where it was registered: "file.py:line" or "entry point of <dist>"
    description: str = ""

    def load(self) -> Callable[..., Any]:
        if isinstance(self.entry_point, str):
            module_name, _, attr = self.entry_point.partition(":")
            obj = importlib.import_module(module_name)  # an ImportError here is the user's to see
            for part in attr.split("."):
                obj = getattr(obj, part)
            self.entry_point = obj
        return self.entry_point

    @property
    def qualified_name(self) -> str:
        if isinstance(self.entry_point, str):
            return self.entry_point
        return f"{self.entry_point.__module__}:{self.entry_point.__qualname__}"


_REGISTRY: dict[str, EnvSpec] = {}
_entry_points_loaded = False


def _add(spec: EnvSpec) -> None:
    old = _REGISTRY.get(spec.name)
    if old is not None and old.qualified_name != spec.qualified_name:
        raise EnvRegistrationError(
            f"env name {spec.name!r} is taken: {old.qualified_name} (registered at {old.source}) "
            f"and {spec.qualified_name} (registered at {spec.source}); rename one of them"
        )
    if old is not None and isinstance(old.entry_point, str) and not isinstance(spec.entry_point, str):
        old.entry_point = spec.entry_point  # same object: keep the loaded one
        old.description = old.description or spec.description
        return
    if old is None:
        _REGISTRY[spec.name] = spec


def register_env(name: str, *, description: str | None = None):
    """Decorator: register an `agentrl.Env` subclass or a factory returning one."""

    def decorator(obj):
        try:
            source = f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
        except (OSError, TypeError):
            source = getattr(obj, "__module__", "?")
        desc = description or description_of(obj)
        _add(EnvSpec(name=name, entry_point=obj, source=source, description=desc))
        return obj

    return decorator


def description_of(obj) -> str:
    """An env's one-line description: its `description`, else its docstring's first line."""
    return getattr(obj, "description", "") or (inspect.getdoc(obj) or "").split("\n")[0]


def load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist else "?"
        _add(EnvSpec(name=ep.name, entry_point=ep.value, source=f"entry point of {dist}"))


def _is_file(module_or_path: str) -> bool:
    return module_or_path.endswith(".py") or Path(module_or_path).exists()


def import_env_module(module_or_path: str) -> None:
    """Import a user's module (dotted name) or .py file."""
    path = Path(module_or_path)
    if _is_file(module_or_path):
        if not path.is_file():
            raise EnvNotFoundError(f"--env-module {module_or_path}: no such file")
        path = path.resolve()
        # A stable name per path: importing the same file twice must not register twice.
        mod_name = f"agentrl_user_env_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        if mod_name not in sys.modules:
            spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[mod_name]
                raise
    else:
        importlib.import_module(module_or_path)


def _given_modules() -> list[str]:
    """The modules this process was started with (AGENTRL_ENV_MODULES)."""
    return [m for m in os.environ.get(ENV_MODULES_VAR, "").split(os.pathsep) if m]


def _import_recorded_modules() -> None:
    for module in _given_modules():
        import_env_module(module)


def env_modules_environ(modules: list[str]) -> dict[str, str]:
    """The environment variable that makes a child process import `modules` (--env-module values;
    files as absolute paths) besides the ones this process was started with, and so resolve the
    same env names: {} when there are none."""
    records = _given_modules()
    for module in modules:
        record = str(Path(module).resolve()) if _is_file(module) else module
        if record not in records:
            records.append(record)
    return {ENV_MODULES_VAR: os.pathsep.join(records)} if records else {}


def list_envs() -> list[EnvSpec]:
    load_entry_points()
    _import_recorded_modules()
    for spec in _REGISTRY.values():  # descriptions come from the loaded objects
        if not spec.description:
            try:
                spec.description = description_of(spec.load())
            except Exception as exc:  # listing must not die on one broken env
                spec.description = f"(cannot import: {exc})"
    return sorted(_REGISTRY.values(), key=lambda s: s.name)


def get_spec(name: str) -> EnvSpec:
    load_entry_points()
    _import_recorded_modules()
    if name not in _REGISTRY:
        known = sorted(_REGISTRY)
        close = difflib.get_close_matches(name, known, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise EnvNotFoundError(
            f"unknown env {name!r}.{hint} Known envs: {', '.join(known) or '(none)'}. "
            "Register one with @agentrl.register_env, an 'agentrl.envs' entry point, or --env-module."
        )
    return _REGISTRY[name]


def check_env_kwargs(name: str, factory: Callable[..., Any], kwargs: dict, flag: str = "--env-kwargs") -> None:
    """Fail before any work when `kwargs` cannot go to the env's constructor: an unknown name
    (with the nearest accepted one), or a required argument left out."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to check against (some builtins)
        return
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in kwargs:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{flag}: env {name!r} takes no argument {key!r}.{hint} "
                              f"It takes: {', '.join(accepted) or '(none)'}")
    missing = [n for n, p in params.items() if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and n not in kwargs]
    if missing:
        raise ConfigError(f"{flag}: env {name!r} needs {', '.join(missing)} (its constructor has no default for them)")


def make(name: str | EnvSpec, **kwargs):
    """Build the env registered under `name` (or described by a spec from `list_envs`)."""
    from agentrl.env import Env

    spec = name if isinstance(name, EnvSpec) else get_spec(name)
    name = spec.name
    factory = spec.load()
    try:
        env = factory(**kwargs)
    except Exception as exc:
        exc.add_note(f"while building env {name!r} with kwargs {kwargs}")
        raise
    if not isinstance(env, Env):
        raise TypeError(f"env {name!r} built a {type(env).__name__}, not an agentrl.Env")
    return env
