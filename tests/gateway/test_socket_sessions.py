"""A session served on a unix socket (Gateway.bind, the sandbox bridge's host end): the socket
names the session whatever key a request carries, it is its uid's alone, it answers 401 once the
session ends, and it holds a bounded number of connections (a sandbox cannot take the host's fds)."""

import asyncio
import json
import os
import stat

import pytest

from helpers import ScriptedEngine, new_session

from agentrl.gateway import Gateway
from agentrl.gateway.server import MAX_SOCKET_CONNECTIONS

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


async def post(path, key="wrong-key", target="/v1/chat/completions"):
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(f"POST {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(BODY)}\r\nConnection: close\r\n\r\n".encode() + BODY)
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_the_socket_names_the_session(tokenizer, tmp_path):
    async def go():
        a = new_session(tokenizer, ScriptedEngine(tokenizer, ["from A"]), trajectory_id="a")
        b = new_session(tokenizer, ScriptedEngine(tokenizer, ["from B", "again B"]), trajectory_id="b")
        gateway = await Gateway().start()
        try:
            _, key_a = gateway.open(a)
            _, key_b = gateway.open(b)
            path = tmp_path / "b.sock"
            await gateway.bind(key_b, path, uid=os.geteuid())
            mode = stat.S_IMODE(os.stat(path).st_mode)
            # A's key, in the header and in the path: still B's session, the one the socket is for
            first = await post(path, key=key_a)
            second = await post(path, key=key_a, target=f"/s/{key_a}/v1/chat/completions")
            gateway.close(key_b)
            ended = await post(path, key=key_b)
            await gateway.unbind(path)
            return mode, first, second, ended, a.requests, b.requests, path.exists()
        finally:
            await gateway.aclose()

    mode, first, second, ended, requests_a, requests_b, left = asyncio.run(go())
    assert mode == 0o600
    assert first[0] == 200 and first[1]["choices"][0]["message"]["content"] == "from B"
    assert second[0] == 200 and second[1]["choices"][0]["message"]["content"] == "again B"
    assert (requests_a, requests_b) == (0, 2)
    assert ended[0] == 401 and ended[1]["error"]["code"] == "invalid_api_key"
    assert not left  # unbind removed the socket


@pytest.mark.slow
def test_a_socket_holds_a_bounded_number_of_connections(tokenizer, tmp_path):
    async def go():
        session = new_session(tokenizer, ScriptedEngine(tokenizer, ["ok"]))
        gateway = await Gateway().start()
        try:
            _, key = gateway.open(session)
            path = tmp_path / "s.sock"
            await gateway.bind(key, path)
            held = [await asyncio.open_unix_connection(path) for _ in range(MAX_SOCKET_CONNECTIONS + 4)]
            refused = 0
            for reader, _ in held:  # a refused connection is closed by the server at once
                try:
                    refused += await asyncio.wait_for(reader.read(1), 0.5) == b""
                except asyncio.TimeoutError:
                    pass
            for _, writer in held:
                writer.close()
            await asyncio.sleep(0.2)
            status, _ = await post(path)  # once they are gone, a new one is served
            return refused, status
        finally:
            await gateway.aclose()

    refused, status = asyncio.run(go())
    assert refused == 4 and status == 200


def test_a_wrong_sandbox_is_named_at_the_decorator():
    import pytest

    from agentrl.gateway import agent_env

    for wrong in ("dockr", True, 3):
        with pytest.raises(TypeError, match="test-gw-wrong-sandbox.*sandbox must be"):
            agent_env("test-gw-wrong-sandbox", command="true", sandbox=wrong)
