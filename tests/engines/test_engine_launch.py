"""Launching engines: --sglang-* / --router-* pass-through and validation, GPU placement,
health-wait errors with the server's log, clean stops (exit, Ctrl-C, SIGTERM), attaching."""

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from agentrl.config import RolloutConfig
from agentrl.engines import sglang as sg
from agentrl.engines.group import start_engines
from agentrl.engines.launch import ServerProcess, free_port
from agentrl.engines.router import DEFAULTS, validate_router_args
from agentrl.errors import ConfigError, EngineError
from waiting import wait_until


def fake_sglang_parser() -> argparse.ArgumentParser:
    """The shape of SGLang's ServerArgs.add_cli_args (a few of its real arguments)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model-path", required=True)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--attention-backend", choices=["triton", "fa3", "flashinfer"])
    p.add_argument("--cuda-graph-max-bs-decode", type=int)
    p.add_argument("--random-seed", type=int)
    p.add_argument("--json-model-override-args", type=str)
    return p


def test_sglang_args_pass_through_and_are_checked():
    p = fake_sglang_parser()
    argv = sg.validate_sglang_args({"mem-fraction-static": "0.8", "enable-memory-saver": None,
                                    "attention_backend": "triton"}, p)
    assert argv == ["--mem-fraction-static", "0.8", "--enable-memory-saver", "--attention-backend", "triton"]
    assert sg.validate_sglang_args({"enable-memory-saver": "true"}, p) == ["--enable-memory-saver"]
    with pytest.raises(ConfigError, match=r"--sglang-mem-fraction-statc: .*no server argument.*did you mean "
                                          r"--sglang-mem-fraction-static"):
        sg.validate_sglang_args({"mem-fraction-statc": "0.8"}, p)
    with pytest.raises(ConfigError, match="use --rollout-num-gpus-per-engine"):
        sg.validate_sglang_args({"tp-size": "2"}, p)
    with pytest.raises(ConfigError, match="is a switch"):
        sg.validate_sglang_args({"enable-memory-saver": "yes please"}, p)
    with pytest.raises(ConfigError, match="needs a value"):
        sg.validate_sglang_args({"mem-fraction-static": None}, p)
    with pytest.raises(ConfigError, match="invalid --sglang"):
        sg.validate_sglang_args({"attention-backend": "nope"}, p)


def test_prefill_cuda_graphs_are_off_unless_a_prefill_graph_flag_is_given():
    """SGLang 0.5.15's prefill graphs cost a 1.5B engine 23 s of start-up for no rollout gain (1x H200,
    2026-12-03): agentrl adds --disable-prefill-cuda-graph, unless the user chose something for
    prefill graphs or the installed SGLang has no such flag (older versions)."""
    p = fake_sglang_parser()
    assert sg.with_rollout_defaults(["--mem-fraction-static", "0.8"], p) == ["--mem-fraction-static", "0.8"]
    p.add_argument("--disable-prefill-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-backend-prefill", choices=["breakable", "disabled"])
    argv = sg.with_rollout_defaults(sg.validate_sglang_args({"mem-fraction-static": "0.8"}, p), p)
    assert argv == ["--mem-fraction-static", "0.8", "--disable-prefill-cuda-graph"]
    assert p.parse_args(["--model-path", "m", *argv]).disable_prefill_cuda_graph
    for chosen in (["--cuda-graph-backend-prefill", "breakable"], ["--cuda-graph-backend-prefill=breakable"],
                   ["--disable-prefill-cuda-graph"]):
        assert sg.with_rollout_defaults(chosen, p) == chosen
    assert sg.with_rollout_defaults(["--cuda-graph-max-bs-decode", "8"], p)[-1] == "--disable-prefill-cuda-graph"


@pytest.mark.e2e
def test_missing_sglang_is_a_clear_error(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # not importable, as on this CPU machine
    sg._installed_parser.cache_clear()
    with pytest.raises(ConfigError, match="SGLang is not importable.*--rollout-engine-urls"):
        start_engines(RolloutConfig(rollout_engine="sglang"), model_path=str(tiny_model), device="cpu", seed=0,
                      log_dir=tmp_path, sglang_args={"mem-fraction-static": "0.5"})
    sg._installed_parser.cache_clear()


def test_gpu_placement_and_shared_gpu_memory():
    plan = lambda **kw: sg.plan_engines(model_path="/m", seed=7, ports=[1001, 1002, 1003, 1004],  # noqa: E731
                                        sglang_argv=kw.pop("argv", []), **kw)
    two_on_one = plan(num_engines=2, num_gpus=1, gpus_per_engine=1, gpu_ids=[0])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in two_on_one] == ["0", "0"]
    assert [p.start_after for p in two_on_one] == [None, 0]  # the second starts once the first is up
    frac = [p.argv[p.argv.index("--mem-fraction-static") + 1] for p in two_on_one]
    assert frac == ["0.4", "0.8"]  # engine k of n takes k * F / n of what it finds free (F = 0.8)
    shared = plan(num_engines=2, num_gpus=1, gpus_per_engine=1, gpu_ids=[0], argv=["--mem-fraction-static", "0.6"])
    assert [p.argv[p.argv.index("--mem-fraction-static") + 1] for p in shared] == ["0.3", "0.6"]
    restart = shared[0].restart_argv  # a restarted engine finds the other one up: it takes F / n
    assert restart[restart.index("--mem-fraction-static") + 1] == "0.6" and restart.count("--mem-fraction-static") == 1
    assert all(p.argv.count("--mem-fraction-static") == 1 for p in shared)
    tp = plan(num_engines=None, num_gpus=4, gpus_per_engine=2, gpu_ids=[0, 1, 2, 3])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in tp] == ["0,1", "2,3"]
    assert all(p.argv[p.argv.index("--tp-size") + 1] == "2" and p.start_after is None for p in tp)
    assert "--mem-fraction-static" not in tp[0].argv and tp[0].restart_argv is None  # not shared: SGLang's default
    assert tp[1].argv[tp[1].argv.index("--random-seed") + 1] == "8"
    assert tp[0].argv[:3] == [sys.executable, "-m", "agentrl.engines.sglang_server"]
    assert tp[0].env["AGENTRL_ENGINE_ID"] == "http://127.0.0.1:1001"
    mapped = plan(num_engines=None, num_gpus=None, gpus_per_engine=1, gpu_ids=[3, 5])  # parent's CUDA_VISIBLE_DEVICES
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in mapped] == ["3", "5"]
    with pytest.raises(ConfigError, match="needs GPUs"):
        plan(num_engines=None, num_gpus=None, gpus_per_engine=1, gpu_ids=[])
    with pytest.raises(ConfigError, match="not a multiple"):
        plan(num_engines=None, num_gpus=3, gpus_per_engine=2, gpu_ids=[0, 1, 2])


def test_router_args_pass_through_and_are_checked():
    argv = validate_router_args({"policy": "cache_aware", "retry-max-retries": "3", "disable-circuit-breaker": None})
    assert argv[argv.index("--policy") + 1] == "cache_aware"  # the user's flag wins over agentrl's default
    assert "--disable-circuit-breaker" in argv and argv[argv.index("--retry-max-retries") + 1] == "3"
    default = validate_router_args({})
    assert default[default.index("--policy") + 1] == DEFAULTS["policy"] == "manual"
    with pytest.raises(ConfigError, match="--router-polcy.*did you mean --router-policy"):
        validate_router_args({"polcy": "manual"})
    with pytest.raises(ConfigError, match="agentrl sets the router's --worker-urls"):
        validate_router_args({"worker-urls": "http://x"})
    with pytest.raises(ConfigError, match="invalid --router"):
        validate_router_args({"policy": "sticky"})


def _script(tmp_path, body: str) -> list[str]:
    path = tmp_path / "server.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_health_wait_errors_show_the_servers_last_log_lines(tmp_path):
    port = free_port()
    hangs = ServerProcess(_script(tmp_path, """
        import time
        for i in range(50):
            print(f"loading shard {i}", flush=True)
        time.sleep(60)
    """), url=f"http://127.0.0.1:{port}", name="slow", log_dir=tmp_path)
    with pytest.raises(EngineError, match=r"(?s)slow not healthy after 2 s.*loading shard 49"):
        hangs.wait_healthy(timeout_s=2)
    assert not hangs.alive()
    dies = ServerProcess(_script(tmp_path, """
        import sys
        print("RuntimeError: Loaded weights leave no GPU memory for the KV cache", flush=True)
        sys.exit(3)
    """), url=f"http://127.0.0.1:{port}", name="dies", log_dir=tmp_path)
    with pytest.raises(EngineError, match=r"(?s)dies exited with code 3 while starting.*no GPU memory"):
        dies.wait_healthy(timeout_s=30)
    assert "lower the engines per GPU" in sg.sglang_log_hint(dies.log_tail())


def test_a_garbled_health_reply_means_not_up_yet(tmp_path):
    """A server that answers its health poll with garbage (as a TCP self-connect does: the
    poll reads its own request back) is "not up yet", until it answers properly."""
    port = free_port()
    server = ServerProcess(_script(tmp_path, f"""
        import socket, time
        from http.server import BaseHTTPRequestHandler, HTTPServer
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", {port})); s.listen()
        for reply in (b"GET /health HTTP/1.1\\r\\n\\r\\n", b"", b"HTTP/1.1 200"):
            conn, _ = s.accept(); conn.recv(4096); conn.sendall(reply); conn.close()
        s.close()
        class Ok(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers()
        HTTPServer(("127.0.0.1", {port}), Ok).serve_forever()
    """), url=f"http://127.0.0.1:{port}", name="garbled", log_dir=tmp_path)
    try:
        server.wait_healthy(timeout_s=30)
        assert server.alive()
    finally:
        server.stop()


def _group_size(pgid: int) -> int:
    """How many live (non-zombie) processes the process group holds."""
    size = 0
    for stat in os.listdir("/proc"):
        if not stat.isdigit():
            continue
        try:
            fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        size += int(fields[2]) == pgid and fields[0] != "Z"  # fields: state, ppid, pgrp, ...
    return size


def _gone(pgid: int) -> bool:
    return _group_size(pgid) == 0


def test_stop_takes_the_whole_process_tree(tmp_path):
    server = ServerProcess(_script(tmp_path, """
        import subprocess, time
        subprocess.Popen(["sleep", "300"])  # like SGLang's scheduler processes
        time.sleep(300)
    """), url="http://127.0.0.1:1", name="tree", log_dir=tmp_path)
    pgid = server.proc.pid
    wait_until(lambda: _group_size(pgid) >= 2, timeout_s=30, what="the server starting its child")
    server.stop()
    wait_until(lambda: _gone(pgid), timeout_s=5, what="the server's process group ending")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_stop_the_engines(tmp_path, sig):
    """A parent that started servers and is interrupted (Ctrl-C) or terminated leaves none behind.
    The parent starts as from a terminal: SIGINT raising KeyboardInterrupt and not blocked. A child
    inherits an ignored or blocked SIGINT from its launcher, and in the full suite (two xdist
    workers) this test's worker had one, left by a test or library before it: then the parent slept on."""
    handler, blocked = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if handler is not signal.default_int_handler or signal.SIGINT in blocked:
        import warnings
        warnings.warn(f"this pytest process's SIGINT: handler {handler!r}, blocked signals {sorted(blocked)}")
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import signal
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT, signal.SIGTERM}})
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import sys, time
        from agentrl.engines.group import _stop_on_sigterm
        from agentrl.engines.launch import ServerProcess
        s = ServerProcess([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '300']); "
                           "time.sleep(300)"], url="http://127.0.0.1:1", name="e", log_dir={str(tmp_path)!r})
        _stop_on_sigterm()
        print(s.proc.pid, flush=True)
        try:
            time.sleep(300)
        finally:
            s.stop()
    """)], stdout=subprocess.PIPE, text=True)
    pgid = int(parent.stdout.readline())
    wait_until(lambda: _group_size(pgid) >= 2, timeout_s=30, what="the server starting its child")
    parent.send_signal(sig)
    parent.wait(timeout=30)
    wait_until(lambda: _gone(pgid), timeout_s=5, what="the server's process group ending")


@pytest.mark.e2e
def test_attach_to_running_engines(engine, tmp_path):
    group = start_engines(RolloutConfig(rollout_engine_urls=[engine.url + "/"]), model_path="unused", device="cpu",
                          seed=0, log_dir=tmp_path)
    assert group.url == engine.url and group.engine_urls == [engine.url] and group.kind == "embedded"
    assert group.servers == [] and group.router is None and group.monitor is None
    group.stop()
    assert engine.alive()  # attached engines are not ours to stop
    with pytest.raises(ConfigError, match="nothing is launched"):
        start_engines(RolloutConfig(rollout_engine_urls=[engine.url]), model_path="unused", device="cpu", seed=0,
                      log_dir=tmp_path, sglang_args={"mem-fraction-static": "0.5"})


def test_sglang_replies_name_their_engine_and_the_client_reads_it():
    """agentrl.engines.sglang_server's ASGI middleware adds x-agentrl-engine to SGLang's replies;
    the client reads it whatever its case (sglang-router sends header names lower-cased)."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from agentrl.engines.sglang_server import EngineHeader, _engine_id
    from agentrl.rollout.affinity import TurnLog
    from agentrl.rollout.client import EngineClient

    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b""})

    async def capture(message):
        sent.append(message)

    asyncio.run(EngineHeader(app, "http://e1")({"type": "http"}, None, capture))
    assert (b"x-agentrl-engine", b"http://e1") in sent[0]["headers"]
    assert _engine_id(["--host", "10.0.0.2", "--port", "30001"]) in ("http://10.0.0.2:30001",
                                                                     os.environ.get("AGENTRL_ENGINE_ID"))

    async def generate(request):  # an SGLang-shaped reply: no engine_id in meta_info, only the header
        return web.json_response({"text": "", "output_ids": [7], "meta_info": {
            "id": "x", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 3, "cached_tokens": 2,
            "weight_version": "default", "output_token_logprobs": [[-0.5, 7, None]]}},
            headers={"x-agentrl-engine": "http://e1"})

    async def go():
        web_app = web.Application()
        web_app.router.add_post("/generate", generate)
        server = TestServer(web_app)
        await server.start_server()
        log = TurnLog()
        try:
            async with EngineClient(str(server.make_url("")).rstrip("/"), turn_log=log) as c:
                res = await c.generate([1, 2, 3], {}, session_id="t")
        finally:
            await server.close()
        return res, log.get("t")

    res, turns = asyncio.run(go())
    assert res.engine_id == "http://e1" and turns[0].engine == "http://e1" and turns[0].cached_tokens == 2


def test_engine_ports_do_not_follow_the_run_seed():
    """Two runs with the same --seed (seed_everything seeds the global random) must not try the
    same ports in the same order: they could both take one before either server binds it."""
    import random

    def ports():
        random.seed(0)
        return [free_port() for _ in range(6)]

    assert ports() != ports()


def test_poll_returns_the_first_true_result_and_is_bounded():
    from agentrl.engines.launch import poll

    answers = iter([None, "", "up"])
    assert poll(lambda: next(answers), timeout_s=10, interval_s=0.01) == "up"
    calls = []
    start = time.monotonic()
    assert poll(lambda: calls.append(time.monotonic() - start), timeout_s=0.35, interval_s=0.1) is None
    # a call every 0.1 s, none that would start 0.35 s or more after the first
    assert len(calls) >= 3 and calls[-1] < 0.35 and time.monotonic() - start < 0.5

    def dead():
        raise EngineError("the server exited")

    with pytest.raises(EngineError, match="the server exited"):  # an exception ends the polling at once
        poll(dead, timeout_s=10, interval_s=0.01)


def test_detect_kind_gives_up_after_its_timeout_naming_the_url():
    from agentrl.engines.group import detect_kind

    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(EngineError, match=rf"--rollout-engine-urls {url}: no engine answers /model_info after 1 s "
                                          rf"\(GET {url}/model_info: URLError.*refused"):
        detect_kind(url, timeout_s=1)
    assert time.monotonic() - start < 1.5


ROUTED_ECHO = textwrap.dedent('''
    """An SGLang-shaped worker behind agentrl.engines.sglang_server's RoutedExperts middleware: its
    /generate reply says which of the request's fields arrived."""
    import json
    import sys

    import uvicorn
    from fastapi import FastAPI, Request

    from agentrl.engines.sglang_server import RoutedExperts

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.get("/get_model_info")
    async def info():
        return {"model_path": "m", "tokenizer_path": "m", "is_generation": True}

    @app.get("/get_server_info")
    async def server_info():
        return {}

    @app.post("/generate")
    async def generate(request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {"raw": raw.decode()}
        return {"text": "", "output_ids": [1], "meta_info": {"output_token_logprobs": [[-1.0, 1, None]],
                "finish_reason": {"type": "length"}, "prompt_tokens": 2, "arrived": body}}

    app.add_middleware(RoutedExperts)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
''')


def test_routed_experts_reach_sglang_through_the_router(tmp_path):
    """sglang-router 0.3.2 drops `return_routed_experts` from /generate requests (a typed struct
    without the field), so routing replay could not get its experts through the router. An SGLang
    launched by agentrl with --enable-return-routed-experts asks for them itself: through the real
    router, the worker sees the field set; a request that says false keeps false; other paths and
    malformed bodies pass untouched."""
    import json
    import urllib.request

    from agentrl.engines.router import launch_router

    script = tmp_path / "worker.py"
    script.write_text(ROUTED_ECHO)
    port = free_port()
    worker = ServerProcess([sys.executable, str(script), str(port)], url=f"http://127.0.0.1:{port}", name="worker",
                           log_dir=tmp_path)
    router = None
    try:
        worker.wait_healthy(60)
        router = launch_router([worker.url], router_args={}, log_dir=tmp_path, timeout_s=60)

        def arrived(url, payload):
            req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())["meta_info"]["arrived"]

        base = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
        through_router = arrived(router.url, {**base, "return_routed_experts": True, "rid": "r1"})
        assert through_router["return_routed_experts"] is True and through_router["rid"] == "r1"
        assert arrived(worker.url, base)["return_routed_experts"] is True
        assert arrived(worker.url, {**base, "return_routed_experts": False})["return_routed_experts"] is False
        bad = urllib.request.Request(worker.url + "/generate", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(bad, timeout=30) as resp:  # SGLang answers it with its own error
            assert json.loads(resp.read())["meta_info"]["arrived"] == {"raw": "{not json"}
    finally:
        if router is not None:
            router.stop()
        worker.stop()
