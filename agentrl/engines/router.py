"""sglang-router (PyPI `sglang-router`, checked with 0.3.2) in front of the engines.

Started as `python -m sglang_router.launch_router --worker-urls URL... --policy manual ...`;
every `--router-ARG` flag of agentrl passes through as `--ARG` and is checked against the
router's own parser (`RouterArgs.add_cli_args`). agentrl's defaults, each overridable:

  --policy manual                 sticky sessions on the X-SMG-Routing-Key header, which the
                                  rollout client sets to the trajectory id: every turn of a
                                  trajectory goes to one engine (its prefix cache stays warm);
                                  a key is remapped only when its engine leaves the pool
  --health-check-interval-secs 2  (router default 60) a dead engine is noticed in seconds
  --health-failure-threshold 2
  --log-level warn

Worker API of sglang-router 0.3.2 (read off the running router; the older /add_worker and
/remove_worker are gone): GET /workers -> {"workers": [{"id", "url", "is_healthy", ...}],
"total", "stats"}; POST /workers {"url"} -> 202 {"status": "accepted", "worker_id", ...}
(registration runs in the background: poll GET /workers); DELETE /workers/{worker_id} -> 202.
The router also forwards each worker's response headers (agentrl's X-Agentrl-Engine).

Prefill/decode disaggregation (slime's --prefill-num-servers): the router runs with
`--pd-disaggregation --prefill URL BOOTSTRAP_PORT ... --decode URL ...` instead of
`--worker-urls` (which PD mode ignores); a request goes to a prefill and a decode engine, which
hand the KV cache over through SGLang's disaggregation transfer. A worker re-added after a restart
is posted with its `worker_type` (and a prefill's `bootstrap_port`), as slime registers them.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from agentrl.engines.launch import ServerProcess, free_port, poll
from agentrl.errors import ConfigError, EngineError
from agentrl.http import HTTPCallError, request_json

OWNED = {"worker-urls": "--rollout-engine-urls / --num-engines", "host": "", "port": "", "prometheus-port": "",
         "pd-disaggregation": "", "prefill": "", "decode": ""}
DEFAULTS = {"policy": "manual", "health-check-interval-secs": "2", "health-failure-threshold": "2",
            "log-level": "warn"}


def router_parser() -> argparse.ArgumentParser:
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="sglang_router.launch_router", add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return parser


def validate_router_args(args: dict[str, str | None], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """--router-* arguments (agentrl's defaults under them) -> router argv, checked against
    the installed sglang-router's parser."""
    parser = parser or router_parser()
    actions = {s: a for a in parser._actions for s in a.option_strings}
    merged = {**DEFAULTS, **{k.replace("_", "-").lstrip("-"): v for k, v in args.items()}}
    argv: list[str] = []
    for name, value in merged.items():
        if name in OWNED:
            how = f"; use {OWNED[name]}" if OWNED[name] else ""
            raise ConfigError(f"--router-{name}: agentrl sets the router's --{name} itself{how}")
        action = actions.get(f"--{name}")
        if action is None:
            close = difflib.get_close_matches(name, [s[2:] for s in actions if s.startswith("--")], n=3)
            hint = f"; did you mean {', '.join('--router-' + c for c in close)}?" if close else ""
            raise ConfigError(f"--router-{name}: sglang-router has no argument --{name}{hint}")
        if action.nargs == 0:
            if value is None or str(value).lower() in ("true", "1", "yes"):
                argv.append(f"--{name}")
            elif str(value).lower() not in ("false", "0", "no"):
                raise ConfigError(f"--router-{name} is a switch and takes no value (got {value!r})")
            continue
        if value is None:
            raise ConfigError(f"--router-{name} needs a value")
        argv += [f"--{name}"] + (str(value).split() if action.nargs in ("+", "*") else [str(value)])
    try:
        parser.parse_args(argv)
    except SystemExit:
        raise ConfigError(f"invalid --router-* arguments: {' '.join(argv)} (the router's message is above)") from None
    return argv


class Router:
    """A running sglang-router: its URL, and its worker API."""

    def __init__(self, url: str, process: ServerProcess | None = None, pd: dict | None = None):
        self.url = url.rstrip("/")
        self.process = process
        self.pd = pd or {}  # PD mode: url -> (worker_type, bootstrap_port or None)

    def _call(self, method: str, path: str, payload: dict | None = None, timeout: float = 10.0):
        return request_json(method, self.url + path, payload, timeout=timeout)

    def workers(self) -> list[dict]:
        return self._call("GET", "/workers")["workers"]

    def healthy_urls(self) -> set[str]:
        return {w["url"] for w in self.workers() if w.get("is_healthy")}

    def add_worker(self, url: str) -> None:
        if url not in {w["url"] for w in self.workers()}:
            payload = {"url": url}
            if url in self.pd:
                payload["worker_type"], port = self.pd[url]
                if port is not None:
                    payload["bootstrap_port"] = port
            self._call("POST", "/workers", payload)

    def remove_worker(self, url: str) -> bool:
        ids = [w["id"] for w in self.workers() if w["url"] == url]
        for worker_id in ids:
            try:
                self._call("DELETE", f"/workers/{worker_id}")
            except HTTPCallError as exc:
                if exc.status != 404:  # gone already
                    raise
        return bool(ids)

    def wait_workers(self, urls: list[str], timeout_s: float) -> None:
        """Until every URL is registered and healthy (registration runs in the background)."""
        missing = set(urls)

        def all_registered() -> bool:
            nonlocal missing
            try:
                missing = set(urls) - self.healthy_urls()
                if not missing:
                    return True
            except (HTTPCallError, KeyError, TypeError):  # not answering yet, or not the worker API's answer
                pass
            if self.process is not None and not self.process.alive():
                raise EngineError(f"sglang-router exited with code {self.process.proc.returncode}; last log lines:\n"
                                  f"{self.process.log_tail()}")
            return False

        if poll(all_registered, timeout_s=timeout_s, interval_s=0.2):
            return
        tail = self.process.log_tail() if self.process else ""
        raise EngineError(f"sglang-router at {self.url}: engines {sorted(missing)} not registered and healthy after "
                          f"{timeout_s:.0f} s; last router log lines:\n{tail}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def router_argv(worker_urls: list[str], extra: list[str], *, port: int, prometheus_port: int,
                pd: dict | None = None) -> list[str]:
    """The router's command line. pd (url -> (worker_type, bootstrap_port)): PD mode, every URL
    of worker_urls a prefill or a decode engine."""
    if pd:
        workers = ["--pd-disaggregation"]
        for url in worker_urls:
            kind, boot = pd[url]
            workers += ["--prefill", url, str(boot)] if kind == "prefill" else ["--decode", url]
    else:
        workers = ["--worker-urls", *worker_urls]
    argv = [sys.executable, "-m", "sglang_router.launch_router", *workers,
            "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(prometheus_port)]
    if "--prometheus-host" not in extra:
        argv += ["--prometheus-host", "127.0.0.1"]
    return argv + extra


def launch_router(worker_urls: list[str], *, router_args: dict[str, str | None], log_dir: Path | None,
                  timeout_s: float = 120.0, pd: dict | None = None) -> Router:
    extra = validate_router_args(router_args)
    port = free_port()
    argv = router_argv(worker_urls, extra, port=port, prometheus_port=free_port(), pd=pd)
    process = ServerProcess(argv, url=f"http://127.0.0.1:{port}", name="router", log_dir=log_dir)
    process.wait_healthy(timeout_s)
    router = Router(process.url, process, pd=pd)
    router.wait_workers(worker_urls, timeout_s)
    return router
