"""The embedded engine against SGLang 0.5.15's own request/response structures (field names
and types vendored in sglang_contract.json): what agentrl sends is a valid SGLang request,
what the embedded engine answers has SGLang's shape, and its handlers read no field SGLang
does not define."""

import ast
import asyncio
import inspect

import pytest
import torch
from aiohttp.test_utils import TestServer

from agentrl.engines import embedded
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.weight_transfer import sync_weights_from_disk, sync_weights_from_tensor
from contract_helpers import CONTRACT, RecordingClient, check_reply, check_request, conforms


def test_the_fixture_is_sglang_0_5_15():
    assert CONTRACT["source"]["package"] == "sglang==0.5.15"
    gen = CONTRACT["requests"]["/generate"]["fields"]
    assert {"input_ids", "sampling_params", "return_logprob", "rid"} <= set(gen)
    assert conforms([1, 2], gen["input_ids"]) and conforms(None, gen["input_ids"]) and not conforms("x", "int")
    assert conforms(["YWJj"], CONTRACT["requests"]["/update_weights_from_tensor"]["fields"]["serialized_named_tensors"])


def test_agentrl_requests_and_embedded_replies_fit_sglang(tiny_model):
    torch.set_num_threads(1)
    engine = EmbeddedEngine(str(tiny_model))
    weights = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]

    async def go():
        server = TestServer(engine.app())
        await server.start_server()
        try:
            c = RecordingClient(str(server.make_url("")).rstrip("/"))
            ids = list(range(5, 40))
            await c.generate(ids, {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 4,
                                   "stop_token_ids": [2], "ignore_eos": False, "skip_special_tokens": True},
                             session_id="traj-1", rid="traj-1-t0")
            long = asyncio.create_task(c.generate(ids, {"max_new_tokens": 3000, "ignore_eos": True}, rid="long"))
            await asyncio.sleep(0.5)
            await c.post("/abort_request", {"rid": "long"})
            aborted = await long
            await sync_weights_from_tensor([c], weights, version=1, bucket_bytes=1 << 16)
            await sync_weights_from_disk([c], str(tiny_model), version=2)
            for path, payload in [("/pause_generation", {"mode": "in_place"}), ("/continue_generation", {}),
                                  ("/pause_generation", {}), ("/continue_generation", {"torch_empty_cache": True}),
                                  ("/abort_request", {"abort_all": True}), ("/flush_cache", {}),
                                  ("/release_memory_occupation", {"tags": ["kv_cache"]}),
                                  ("/resume_memory_occupation", {"tags": ["kv_cache"]}),
                                  ("/update_weight_version", {"new_version": "5", "abort_all_requests": False})]:
                await c.post(path, payload)
            gets = []
            for path in ("/health", "/health_generate", "/model_info"):
                async with c.session.get(c.base_url + path) as r:
                    body = await r.json() if r.content_type == "application/json" else await r.text()
                    gets.append((path, r.status, r.content_type, body))
            await c.close()
            return c.calls, gets, aborted
        finally:
            await server.close()

    calls, gets, aborted = asyncio.run(go())
    seen = set()
    for path, payload, status, ctype, body in calls:
        if path in CONTRACT["requests"]:
            check_request(path, payload)
        else:
            assert payload == {}, (path, payload)
        check_reply(path, status, ctype, body)
        seen.add(path)
    for path, status, ctype, body in gets:
        check_reply(path, status, ctype, body)
    assert aborted.finish_reason == "abort" and 0 < len(aborted.output_ids) < 3000
    assert seen >= {"/generate", "/update_weights_from_tensor", "/update_weights_from_disk", "/pause_generation",
                    "/continue_generation", "/abort_request", "/flush_cache", "/release_memory_occupation",
                    "/resume_memory_occupation", "/update_weight_version"}
    abort_reply = next(b for p, _, _, _, b in calls if p == "/generate" and b["meta_info"]["finish_reason"]["type"]
                       == "abort")
    assert abort_reply["meta_info"]["id"] == "long"


# OpenAI's chat-completion request fields the embedded engine reads (the LLM judge, agentrl.judge)
OPENAI_FIELDS = {"/v1/chat/completions": {"messages", "temperature", "top_p", "max_tokens", "stream", "n"}}


def _handler_fields() -> tuple[dict[str, set[str]], set[str]]:
    """endpoint -> request keys its handler reads; and the sampling params read anywhere."""
    tree = ast.parse(inspect.getsource(embedded))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EmbeddedEngine")
    methods = {f.name: f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    routes: dict[str, str] = {}
    for node in ast.walk(methods["app"]):
        if isinstance(node, ast.Call) and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[1], ast.Attribute):
            routes[node.args[0].value] = node.args[1].attr
    reads: dict[str, set[str]] = {}
    for path, handler in routes.items():
        keys = set()
        for node in ast.walk(methods[handler]):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "body" \
                    and isinstance(node.slice, ast.Constant):
                keys.add(node.slice.value)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "body":
                keys.add(node.args[0].value)
        reads[path] = keys
    sampling = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "params":
            sampling.add(node.args[0].value)
    return reads, sampling


def test_embedded_handlers_read_only_sglang_fields():
    reads, sampling = _handler_fields()
    assert reads["/generate"] >= {"input_ids", "sampling_params", "return_logprob", "rid"}
    for path, keys in reads.items():
        if path in CONTRACT["requests"]:
            fields = set(CONTRACT["requests"][path]["fields"])
            assert keys <= fields, f"{path}: the embedded engine reads {keys - fields}, which SGLang does not define"
        elif path in OPENAI_FIELDS:  # OpenAI's protocol, which SGLang serves too (the LLM judge's path)
            assert keys <= OPENAI_FIELDS[path], keys - OPENAI_FIELDS[path]
        else:
            assert not keys, (path, keys)
    assert sampling <= set(CONTRACT["sampling_params"]), sampling - set(CONTRACT["sampling_params"])
    # every endpoint of the contract is served
    assert set(CONTRACT["requests"]) <= set(reads) and set(CONTRACT["responses"]) <= set(reads)


@pytest.mark.parametrize("value,annotation,ok", [
    (None, "Optional[int]", True), (3, "float", True), (True, "int", False), ("a", "Literal['abort', 'x']", False),
    ({"a": 1.0}, "Dict[str, float]", True), ([[1, 2]], "Union[List[List[int]], List[int]]", True)])
def test_type_checker(value, annotation, ok):
    assert conforms(value, annotation) is ok
