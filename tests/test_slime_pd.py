"""slime's --prefill-num-servers (its scripts/run-glm5-744B-A40B.sh): prefill/decode
disaggregation as slime runs it. The first N SGLang engines start with SGLang's
`--disaggregation-mode prefill --disaggregation-bootstrap-port P`, the rest with
`--disaggregation-mode decode`; the router runs in sglang-router's PD mode over them
(`--pd-disaggregation --prefill URL P --decode URL`). Checked here: the engines' command lines,
the router's against the installed sglang-router (its parser, then the real router in front of
two stand-in workers: a request reaches both with the prefill's bootstrap port), a restarted
worker re-added with its type, the config checks slime makes, and each worker type's own SGLang
arguments (--prefill-sglang-args, --decode-sglang-args; --sglang-config's prefill and decode
groups) in the command lines of the engines launched."""

import importlib.util
import json
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from agentrl.config import parse_config
from agentrl.engines import sglang as sg
from agentrl.errors import ConfigError

needs_router = pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="sglang-router not installed")


def test_prefill_and_decode_engines_get_slimes_disaggregation_arguments():
    plans = sg.plan_engines(num_engines=None, num_gpus=4, gpus_per_engine=1, gpu_ids=[0, 1, 2, 3],
                            ports=[1001, 1002, 1003, 1004], model_path="/m", sglang_argv=[], seed=0,
                            prefill=1, bootstrap_ports=[2001])
    assert [p.worker_type for p in plans] == ["prefill", "decode", "decode", "decode"]
    assert [p.bootstrap_port for p in plans] == [2001, None, None, None]
    first = plans[0].argv
    assert first[first.index("--disaggregation-mode") + 1] == "prefill"
    assert first[first.index("--disaggregation-bootstrap-port") + 1] == "2001"
    assert all(p.argv[p.argv.index("--disaggregation-mode") + 1] == "decode"
               and "--disaggregation-bootstrap-port" not in p.argv for p in plans[1:])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0", "1", "2", "3"]  # each on GPUs of its own
    plain = sg.plan_engines(num_engines=None, num_gpus=2, gpus_per_engine=1, gpu_ids=[0, 1], ports=[1, 2],
                            model_path="/m", sglang_argv=[], seed=0)
    assert all(p.worker_type == "regular" and "--disaggregation-mode" not in p.argv for p in plain)
    with pytest.raises(ConfigError, match="--prefill-num-servers 2: 2 engines .* at least one decode engine"):
        sg.plan_engines(num_engines=None, num_gpus=2, gpus_per_engine=1, gpu_ids=[0, 1], ports=[1, 2],
                        model_path="/m", sglang_argv=[], seed=0, prefill=2, bootstrap_ports=[3, 4])
    with pytest.raises(ConfigError, match="GPUs of its own"):  # engines sharing a GPU
        sg.plan_engines(num_engines=3, num_gpus=2, gpus_per_engine=1, gpu_ids=[0, 1], ports=[1, 2, 3],
                        model_path="/m", sglang_argv=[], seed=0, prefill=1, bootstrap_ports=[4])
    with pytest.raises(ConfigError, match="--sglang-disaggregation-mode: agentrl sets .* --prefill-num-servers"):
        sg.validate_sglang_args({"disaggregation-mode": "prefill"}, argparse_stub())


def argparse_stub():
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model-path")
    p.add_argument("--disaggregation-mode")
    return p


@needs_router
def test_the_router_command_is_sglang_routers_pd_mode():
    from sglang_router.router_args import RouterArgs

    from agentrl.engines.router import router_argv, router_parser, validate_router_args

    P, D1, D2 = "http://127.0.0.1:1001", "http://127.0.0.1:1002", "http://127.0.0.1:1003"
    pd = {P: ("prefill", 2001), D1: ("decode", None), D2: ("decode", None)}
    argv = router_argv([P, D1, D2], validate_router_args({}), port=3000, prometheus_port=3001, pd=pd)
    assert argv[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    assert argv[3:10] == ["--pd-disaggregation", "--prefill", P, "2001", "--decode", D1, "--decode"]
    args = RouterArgs.from_cli_args(router_parser().parse_args(argv[3:]), use_router_prefix=False)
    assert args.pd_disaggregation and args.prefill_urls == [(P, 2001)] and args.decode_urls == [D1, D2]
    assert (args.port, args.policy) == (3000, "manual")
    plain = router_argv([P, D1], [], port=3000, prometheus_port=3001)
    assert plain[3:6] == ["--worker-urls", P, D1] and "--pd-disaggregation" not in plain


WORKER = textwrap.dedent('''
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    port, log = int(sys.argv[1]), sys.argv[2]

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _reply(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._reply({"model_path": "m", "is_generation": True})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            with open(log, "a") as f:
                f.write(json.dumps({"path": self.path, "body": body, "key": self.headers.get("X-SMG-Routing-Key")})
                        + "\\n")
            self._reply({"text": "x", "output_ids": [1], "meta_info": {"id": "r", "finish_reason": {"type": "stop"}}})

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@needs_router
def test_the_router_pairs_a_prefill_and_a_decode_engine(tmp_path):
    """The real sglang-router, launched as agentrl launches it, in front of two stand-in workers:
    registered with their types, a /generate sent to a prefill and a decode with the prefill's
    bootstrap port, a trajectory's turns (its X-SMG-Routing-Key, agentrl's default manual policy) on
    one decode engine, and a worker taken out and re-added (the engine monitor's restart path)
    keeping its type."""
    from agentrl.engines.launch import free_port, poll
    from agentrl.engines.router import launch_router
    from agentrl.http import request_json
    from agentrl.rollout.client import ROUTING_KEY_HEADER  # the rollout client's session key

    (tmp_path / "worker.py").write_text(WORKER)
    ports, boot = [free_port(), free_port(), free_port()], free_port()
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(p), str(tmp_path / f"{p}.log")])
             for p in ports]
    P, D, D2 = (f"http://127.0.0.1:{p}" for p in ports)
    logs = [tmp_path / f"{p}.log" for p in ports]

    def sent(log):
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    router = None
    try:
        router = launch_router([P, D, D2], router_args={}, log_dir=tmp_path, timeout_s=60,
                               pd={P: ("prefill", boot), D: ("decode", None), D2: ("decode", None)})
        kinds = {w["url"]: (w["worker_type"], w.get("bootstrap_port")) for w in router.workers()}
        assert kinds == {P: ("prefill", boot), D: ("decode", None), D2: ("decode", None)}
        request_json("POST", router.url + "/generate", {"input_ids": [1, 2, 3], "sampling_params": {}}, timeout=30)
        (first,) = sent(logs[0])
        (second,) = sent(logs[1]) + sent(logs[2])
        for one in (first, second):
            assert one["path"] == "/generate" and one["body"]["input_ids"] == [1, 2, 3]
            assert one["body"]["bootstrap_port"] == boot and "bootstrap_room" in one["body"]
        assert first["body"]["bootstrap_room"] == second["body"]["bootstrap_room"]
        for key in [f"trajectory-{i}" for i in range(8) for _ in range(3)]:
            req = urllib.request.Request(router.url + "/generate", method="POST", headers={
                "Content-Type": "application/json", ROUTING_KEY_HEADER: key},
                data=json.dumps({"input_ids": [4], "sampling_params": {}}).encode())
            urllib.request.urlopen(req, timeout=30).read()
        where = {}
        for log in logs[1:]:
            for one in sent(log):
                if one["key"]:
                    where.setdefault(one["key"], set()).add(log)
        assert len(where) == 8 and all(len(decodes) == 1 for decodes in where.values())
        assert len(sent(logs[0])) == 1 + 24  # every request prefilled on the prefill engine
        assert router.remove_worker(P)  # the router deletes it in the background: gone within seconds
        assert poll(lambda: P not in {w["url"] for w in router.workers()}, timeout_s=10, interval_s=0.1)
        router.add_worker(P)
        router.wait_workers([P, D, D2], timeout_s=30)
        assert {(w["url"], w["worker_type"], w.get("bootstrap_port")) for w in router.workers()} == {
            (P, "prefill", boot), (D, "decode", None), (D2, "decode", None)}
    finally:
        if router is not None:
            router.stop()
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def test_prefill_num_servers_is_checked_as_slime_checks_it():
    cfg, ns = parse_config(["--rollout-engine", "sglang", "--prefill-num-servers", "1", "--rollout-num-gpus", "4"])
    assert cfg.rollout.prefill_num_servers == 1 and not ns.slime_notices
    for argv, message in (
            (["--prefill-num-servers", "1"], "SGLang engines agentrl launches"),  # the embedded engine
            (["--rollout-engine", "sglang", "--prefill-num-servers", "1", "--rollout-engine-urls", "http://x:1"],
             "SGLang engines agentrl launches"),
            (["--rollout-engine", "sglang", "--prefill-num-servers", "1", "--use-router", "never"],
             "the router pairs prefill and decode engines"),
            (["--rollout-engine", "sglang", "--prefill-num-servers", "2", "--rollout-num-gpus", "4",
              "--rollout-num-gpus-per-engine", "2"], "no decode engine left of 2")):
        with pytest.raises(ConfigError, match=f"--prefill-num-servers .*{message}"):
            parse_config(argv)


def test_the_glm5_scripts_prefill_flag_is_taken():
    """slime's scripts/run-glm5-744B-A40B.sh passes `--prefill-num-servers 1` (a slime run: SGLang)."""
    model = Path(__file__).parent  # any folder: the shape flags are not given here
    cfg, _ = parse_config(["--ref-load", str(model / "nowhere"), "--hf-checkpoint", str(model), "--rm-type", "math",
                           "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "4",
                           "--prefill-num-servers", "1"])
    assert cfg.rollout.rollout_engine == "sglang" and cfg.rollout.prefill_num_servers == 1


def test_the_weight_check_probes_prefill_and_decode_engines_through_the_router():
    """A prefill or a decode engine cannot generate alone: the weight check's probe goes to the
    router (here a stand-in answering /generate), never to the engines (unreachable here)."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from agentrl.engines.group import Engine, EngineGroup
    from agentrl.rollout.client import EngineClient
    from agentrl.weight_update import probe_engines

    seen = []

    class Router(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            seen.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            body = json.dumps({"meta_info": {"output_token_logprobs": [[-0.5, 7, None]], "weight_version": "3"}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    engines = [Engine(url="http://127.0.0.1:9", kind="sglang", worker_type="prefill", bootstrap_port=10),
               Engine(url="http://127.0.0.1:11", kind="sglang", worker_type="decode")]
    group = EngineGroup(url=url, engine_urls=[e.url for e in engines], engines=engines)
    group.probe_prompts = [[1, 2, 3], [4, 5]]
    cfg, _ = parse_config(["--rollout-temperature", "1.0"])

    async def go():
        clients = [EngineClient(e.url, request_timeout_s=5) for e in engines]
        try:
            await probe_engines(cfg, group, clients)
        finally:
            await asyncio.gather(*[c.close() for c in clients])

    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        server.shutdown()
    assert sorted(body["input_ids"] for path, body in seen if path == "/generate") == [[1, 2, 3], [4, 5]]
    assert [(u, v, s.response_tokens) for u, v, s in group.probe_results] == [(url, "3", [7])] * 2


def stand_in_sglang_parser():
    """The SGLang server arguments the test gives, as SGLang's parser takes them (SGLang is not
    installed here)."""
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    for name in ("--model-path", "--host", "--port", "--tp-size", "--random-seed", "--dtype", "--mem-fraction-static",
                 "--chunked-prefill-size", "--cuda-graph-max-bs", "--deepep-mode", "--max-running-requests",
                 "--disaggregation-mode", "--disaggregation-bootstrap-port", "--cuda-graph-backend-prefill"):
        p.add_argument(name)
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--disable-prefill-cuda-graph", action="store_true")
    p.add_argument("--enable-dp-attention", action="store_true")
    return p


def test_prefill_and_decode_engines_get_their_own_sglang_arguments():
    plans = sg.plan_engines(num_engines=None, num_gpus=3, gpus_per_engine=1, gpu_ids=[0, 1, 2], ports=[1, 2, 3],
                            model_path="/m", sglang_argv=["--mem-fraction-static", "0.7"], seed=0, prefill=1,
                            bootstrap_ports=[4], worker_argv={"prefill": ["--chunked-prefill-size", "8192"],
                                                              "decode": ["--cuda-graph-max-bs", "12"]})
    assert [p.argv[p.argv.index("--tp-size") + 2:] for p in plans] == [
        ["--chunked-prefill-size", "8192", "--random-seed", "0", "--disaggregation-mode", "prefill",
         "--disaggregation-bootstrap-port", "4"],
        ["--cuda-graph-max-bs", "12", "--random-seed", "1", "--disaggregation-mode", "decode"],
        ["--cuda-graph-max-bs", "12", "--random-seed", "2", "--disaggregation-mode", "decode"]]


@pytest.mark.e2e  # agentrl's engine group (start_engines), stand-in workers for SGLang
@needs_router
def test_launched_prefill_and_decode_engines_take_their_groups_arguments(tmp_path, monkeypatch):
    """slime's --sglang-config with prefill and decode groups of different overrides (its GLM-5.2
    script's), through agentrl's engine group: the engines launched (stand-in workers on the ports
    agentrl picked) get the shared --sglang-* plus their own type's arguments, and the real
    sglang-router pairs them with those types."""
    from agentrl.engines import group as eg

    (tmp_path / "worker.py").write_text(WORKER)
    launched = {}

    def launch(index, argv, *, url, name, env, log_dir):
        launched[url] = argv
        port = url.rsplit(":", 1)[1]
        return eg.ServerProcess([sys.executable, str(tmp_path / "worker.py"), port, str(tmp_path / f"{port}.log")],
                                url=url, name=name, env=env, log_dir=log_dir)

    monkeypatch.setattr(eg, "_local_launcher", launch)
    monkeypatch.setattr(sg, "_installed_parser", stand_in_sglang_parser)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    yaml = tmp_path / "sglang.yaml"
    yaml.write_text("sglang:\n  - name: actor\n    server_groups:\n"
                    "      - {worker_type: prefill, num_gpus: 1, overrides: {enable_dp_attention: true, "
                    "chunked_prefill_size: 131072, max_running_requests: 512, deepep_mode: auto, "
                    "cuda_graph_backend_prefill: breakable}}\n"
                    "      - {worker_type: decode, num_gpus: 2, overrides: {enable_dp_attention: true, "
                    "max_running_requests: 768, cuda_graph_max_bs: 12, deepep_mode: low_latency, "
                    "disable_overlap_schedule: true}}\n")
    cfg, _ = parse_config(["--sglang-config", str(yaml), "--sglang-mem-fraction-static", "0.7",
                           "--sglang-deepep-mode", "normal", "--engine-startup-timeout-s", "60"])
    bad = cfg.rollout.model_copy(update={"decode_sglang_args": {"cuda-graph-max-bz": 12}})
    with pytest.raises(ConfigError, match=r'^--decode-sglang-args \{"cuda-graph-max-bz": 12\}: --sglang-cuda-graph-max-bz: '
                                          r"the installed SGLang has no server argument .*did you mean"):
        eg.start_engines(bad, model_path="/m", device="cuda", seed=0, log_dir=tmp_path, sglang_args=cfg.sglang_args)
    assert not launched
    group = eg.start_engines(cfg.rollout, model_path="/m", device="cuda", seed=0, log_dir=tmp_path,
                             sglang_args=cfg.sglang_args)
    try:
        kinds = {w["url"]: w["worker_type"] for w in group.router.workers()}
        assert sorted(kinds.values()) == ["decode", "decode", "prefill"] and set(kinds) == set(launched)

        common = dict(model_path="/m", host="127.0.0.1", tp_size="1", dtype=None, mem_fraction_static="0.7",
                      enable_dp_attention=True)
        expected = {"prefill": dict(common, chunked_prefill_size="131072", max_running_requests="512",
                                    deepep_mode="auto", cuda_graph_max_bs=None, disable_overlap_schedule=False,
                                    disaggregation_mode="prefill",  # prefill graphs asked for: kept
                                    cuda_graph_backend_prefill="breakable", disable_prefill_cuda_graph=False),
                    "decode": dict(common, chunked_prefill_size=None, max_running_requests="768",
                                   deepep_mode="low_latency", cuda_graph_max_bs="12", disable_overlap_schedule=True,
                                   disaggregation_mode="decode", disaggregation_bootstrap_port=None,
                                   cuda_graph_backend_prefill=None, disable_prefill_cuda_graph=True)}  # agentrl's default
        for url, argv in launched.items():
            assert argv[1:3] == ["-m", "agentrl.engines.sglang_server"]
            got = vars(stand_in_sglang_parser().parse_args(argv[3:]))
            assert got.pop("port") == url.rsplit(":", 1)[1] and got.pop("random_seed") is not None
            if kinds[url] == "prefill":
                assert got.pop("disaggregation_bootstrap_port") is not None
            assert got == expected[kinds[url]], (kinds[url], argv)
    finally:
        group.stop()


def test_settings_read_from_the_engines_see_each_worker_types_own_arguments():
    """What agentrl reads back from the engines' arguments (the share of the GPU a colocated
    trainer leaves them, fp8 serving) sees a value given to one worker type only, as the engines
    launched with it do; a quantization that differs between types is refused, naming both."""
    from agentrl.cluster.trainer_actor import engine_memory_fraction, out_of_memory_hint
    from agentrl.fp8 import fp8_requested

    pd = ["--rollout-engine", "sglang", "--prefill-num-servers", "1", "--rollout-num-gpus", "2", "--colocate"]
    cfg, _ = parse_config(pd + ["--sglang-mem-fraction-static", "0.5",
                                "--decode-sglang-args", '{"mem_fraction_static": 0.7}'])
    assert sg.engine_arg_values(cfg, "mem-fraction-static") == {"prefill": "0.5", "decode": "0.7"}
    assert engine_memory_fraction(cfg) == 0.7  # the largest any engine takes back
    hint = out_of_memory_hint(cfg, {"used_gib": 80.0, "mine_gib": 30.0, "total_gib": 140.0}, 64)
    assert "now 0.7;" in hint
    cfg, _ = parse_config(pd + ["--prefill-sglang-args", '{"mem-fraction-static": 0.6}'])
    assert engine_memory_fraction(cfg) == 0.6
    plain, _ = parse_config(["--rollout-engine", "sglang", "--sglang-mem-fraction-static", "0.4"])
    assert sg.engine_arg_values(plain, "mem-fraction-static") == {"all": "0.4"}

    both, _ = parse_config(pd + ["--prefill-sglang-args", '{"quantization": "fp8"}',
                                 "--decode-sglang-args", '{"quantization": "fp8"}'])
    assert fp8_requested(both)
    with pytest.raises(ConfigError, match=r"quantization differs between worker types \(prefill: fp8, decode: none\)"):
        fp8_requested(parse_config(pd + ["--prefill-sglang-args", '{"quantization": "fp8"}'])[0])
    dropped, _ = parse_config(pd + ["--sglang-quantization", "fp8", "--decode-sglang-args", '{"quantization": false}'])
    with pytest.raises(ConfigError, match=r"prefill: fp8, decode: none"):
        fp8_requested(dropped)
    assert fp8_requested(parse_config(["--rollout-engine", "sglang", "--sglang-quantization", "fp8"])[0])
    assert not fp8_requested(plain)
