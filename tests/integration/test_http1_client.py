"""The keep-alive HTTP/1.1 client against real servers on loopback: aiohttp ``web`` and scripted raw ones."""

from __future__ import annotations

import asyncio
import re
import time

import orjson
import pytest
import uvloop
from aiohttp import web

from comap_async.config import CoMapConfig
from comap_async.wire.http1 import Http1Pool, HttpProtocolError
from comap_async.wire.inference_client import InferenceClient, InferenceError
from tests.fixtures.core import free_port

pytestmark = pytest.mark.timeout(60)

COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "model": "m",
    "usage": {"completion_tokens": 2},
    "choices": [
        {
            "index": 0,
            "text": " take apple",
            "finish_reason": "stop",
            "stop_reason": "\n",
            "logprobs": {
                "tokens": [" take", " apple"],
                "token_logprobs": [-0.1, -0.2],
                "top_logprobs": [{" take": -0.1}, {" apple": -0.2}],
                "text_offset": [0, 5],
            },
        }
    ],
}


class Server:
    """An aiohttp app on a free port that records, per request, the client's address (one per connection)."""

    def __init__(self, keepalive_timeout: float = 75.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.peers: list[tuple] = []
        self.seen: list[tuple[str, str, bytes, str | None]] = []
        self.keepalive_timeout = keepalive_timeout
        self.dropped = 0

    async def echo(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername"))
        body = await request.read()
        self.seen.append((request.method, request.path, body, request.headers.get("Authorization")))
        return web.Response(
            body=orjson.dumps({"path": request.path, "body": body.decode()}), content_type="application/json"
        )

    async def completions(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername"))
        body = await request.json()
        self.seen.append((request.method, request.path, orjson.dumps(body), request.headers.get("Authorization")))
        if body.get("prompt") == "bad":
            return web.json_response({"error": {"message": "prompt is bad", "code": 400}}, status=400)
        return web.json_response(COMPLETION)

    async def chunked(self, request: web.Request) -> web.StreamResponse:
        self.peers.append(request.transport.get_extra_info("peername"))
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for part in (b"alpha,", b"beta,", b"gamma"):
            await resp.write(part)
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    async def slow(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername"))
        try:
            await asyncio.sleep(float(request.query.get("s", "1")))
        except asyncio.CancelledError:
            self.dropped += 1  # handler_cancellation: the client closed the connection
            raise
        return web.Response(text="late")

    async def __aenter__(self) -> "Server":
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/chunked", self.chunked)
        app.router.add_get("/slow", self.slow)
        app.router.add_route("*", "/{tail:.*}", self.echo)
        self.runner = web.AppRunner(app, keepalive_timeout=self.keepalive_timeout, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


class RawServer:
    """asyncio server answering request ``n`` of connection ``c`` with ``script(c, n)``: (bytes, close after)."""

    def __init__(self, script) -> None:
        self.script, self.connections = script, 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn, n = self.connections, 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                reply, close = self.script(conn, n)
                n += 1
                writer.write(reply)
                await writer.drain()
                if close:
                    return
        except asyncio.IncompleteReadError:
            return  # the client closed its end: the normal end of a keep-alive connection
        finally:
            writer.close()

    async def __aenter__(self) -> "RawServer":
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()


async def get(pool: Http1Pool, url: str, path: str, body: bytes | None = None, timeout_s: float = 10.0, **kw):
    return await pool.request(
        url,
        "POST" if body is not None else "GET",
        path,
        body,
        kw.get("headers", {}),
        timeout_s,
        kw.get("connect_timeout_s", 5.0),
    )


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def test_one_connection_serves_many_requests_with_a_path_prefix():
    async with Server() as s:
        pool = Http1Pool()
        for i in range(20):
            status, body = await get(pool, s.url + "/api/", "/v1/echo", f"n{i}".encode(), headers={"X-N": str(i)})
            assert status == 200 and orjson.loads(body) == {"path": "/api/v1/echo", "body": f"n{i}"}
        assert len(set(s.peers)) == 1 and len(s.peers) == 20
        await pool.close()


async def test_fifty_concurrent_requests_then_the_connections_are_reused():
    async with Server() as s:
        pool = Http1Pool()
        for _ in range(2):
            results = await asyncio.gather(*(get(pool, s.url, f"/r{i}", str(i).encode()) for i in range(50)))
            assert [orjson.loads(b) for _, b in results] == [{"path": f"/r{i}", "body": str(i)} for i in range(50)]
        assert len(s.peers) == 100 and len(set(s.peers)) <= 50
        await pool.close()


async def test_idle_connection_closed_by_the_server_is_replaced_transparently():
    async with Server(keepalive_timeout=0.2) as s:
        pool = Http1Pool()
        assert (await get(pool, s.url, "/a"))[0] == 200
        await asyncio.sleep(0.5)  # the server has closed the idle connection by now
        assert (await get(pool, s.url, "/b"))[0] == 200
        assert len(set(s.peers)) == 2
        await pool.close()


async def test_reused_connection_closed_before_any_response_byte_is_retried_once():
    # every connection answers its first request and silently drops the second: the race with a
    # server's idle timeout, made deterministic
    async with RawServer(lambda conn, n: (OK, False) if n == 0 else (b"", True)) as s:
        pool = Http1Pool()
        assert await get(pool, s.url, "/1") == (200, b"ok")
        assert await get(pool, s.url, "/2") == (200, b"ok")  # reused, dropped, answered on a fresh one
        assert s.connections == 2
        await pool.close()
    async with RawServer(lambda conn, n: (b"", True)) as s:  # a fresh connection is never retried
        pool = Http1Pool()
        with pytest.raises(HttpProtocolError, match="without sending a response"):
            await get(pool, s.url, "/1")
        assert s.connections == 1


async def test_partial_response_is_not_retried_and_the_connection_is_dropped():
    partial = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"
    async with RawServer(lambda conn, n: (OK, False) if n == 0 else (partial, True)) as s:
        pool = Http1Pool()
        await get(pool, s.url, "/1")
        with pytest.raises(HttpProtocolError, match="before the response was complete"):
            await get(pool, s.url, "/2")
        assert s.connections == 1
        assert await get(pool, s.url, "/3") == (200, b"ok") and s.connections == 2
        await pool.close()


async def test_body_until_close_and_http10_connections_are_not_reused():
    script = {
        0: (b"HTTP/1.0 200 OK\r\n\r\nuntil close", True),
        1: (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
    }
    async with RawServer(lambda conn, n: script[min(conn - 1, 1)]) as s:
        pool = Http1Pool()
        assert await get(pool, s.url, "/1") == (200, b"until close")
        assert await get(pool, s.url, "/2") == (200, b"ok")
        assert await get(pool, s.url, "/3") == (200, b"ok")
        assert s.connections == 3  # HTTP/1.0 without "Connection: keep-alive" closes after each response
        await pool.close()


async def test_chunked_response():
    async with Server() as s:
        pool = Http1Pool()
        for _ in range(3):
            assert await get(pool, s.url, "/chunked") == (200, b"alpha,beta,gamma")
        assert len(set(s.peers)) == 1
        await pool.close()


async def test_request_timeout_then_the_pool_still_works():
    async with Server() as s:
        pool = Http1Pool()
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError, match="timed out after 0.2 s"):
            await get(pool, s.url, "/slow?s=2", timeout_s=0.2)
        assert time.monotonic() - t0 < 1.0
        await asyncio.sleep(0.1)
        assert s.dropped == 1
        assert (await get(pool, s.url, "/after"))[0] == 200
        assert len(set(s.peers)) == 2  # the timed-out connection was closed, not reused
        await pool.close()


async def test_unreachable_port_fails_fast():
    pool = Http1Pool()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="cannot connect to 127.0.0.1"):
        await get(pool, f"http://127.0.0.1:{free_port()}", "/x")
    assert time.monotonic() - t0 < 1.0


async def test_cancellation_closes_the_connection():
    async with Server() as s:
        pool = Http1Pool()
        task = asyncio.create_task(get(pool, s.url, "/slow?s=5"))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)
        assert not pool._eps[s.url].conns and not pool._eps[s.url].idle and s.dropped == 1
        assert (await get(pool, s.url, "/after"))[0] == 200
        assert len(set(s.peers)) == 2
        await pool.close()


async def test_inference_client_gives_the_same_results_over_keepalive_and_the_https_client():
    """``http://`` goes through the keep-alive client; ``https://`` through aiohttp, forced here on a plain server."""
    async with Server() as s:
        results = []
        for transport in ("keepalive", "aiohttp"):
            async with InferenceClient([s.url], token="secret", retries=0) as c:
                if transport == "aiohttp":
                    c._lean[s.url] = False  # what an https:// endpoint gets
                assert c.transport_for(s.url) == transport
                r = await c.complete("go", model="policy-v1", max_tokens=4, stop=["\n"], logprobs=1)
                with pytest.raises(InferenceError) as err:
                    await c.complete("bad")
                results.append((r, err.value.status, str(err.value), await c.health(endpoint=s.url)))
        assert results[0] == results[1]
        r, status, message, healthy = results[0]
        assert r.text == " take apple" and r.choices[0].logprobs.token_logprobs == [-0.1, -0.2]
        assert status == 400 and "prompt is bad" in message and healthy is True
        keepalive, aio = s.seen[:3], s.seen[3:]
        assert [(m, p, orjson.loads(b) if b else b, a) for m, p, b, a in keepalive] == [
            (m, p, orjson.loads(b) if b else b, a) for m, p, b, a in aio
        ]
        assert keepalive[0][3] == "Bearer secret"


async def test_inference_client_picks_aiohttp_for_https():
    c = InferenceClient(["https://gpu-1.example:8000", "http://127.0.0.1:1"])
    assert c.transport_for("https://gpu-1.example:8000") == "aiohttp"
    assert c.transport_for("http://127.0.0.1:1") == "keepalive"
    assert InferenceClient.from_config(CoMapConfig()).transport_for("http://127.0.0.1:8000") == "keepalive"


async def test_inference_client_maps_failures_to_retries():
    async with RawServer(lambda conn, n: (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", True)) as s:
        async with InferenceClient([s.url], retries=1, backoff_s=0.01) as c:
            with pytest.raises(InferenceError, match="HttpProtocolError: bad Content-Length") as err:
                await c.complete("x")
        assert err.value.attempts == 2 and s.connections == 2 and c.outstanding == {s.url: 0}


def test_under_uvloop():
    async def scenario() -> None:
        async with Server(keepalive_timeout=0.2) as s:
            pool = Http1Pool()
            for _ in range(5):
                assert (await get(pool, s.url, "/e", b"x"))[0] == 200
            assert await get(pool, s.url, "/chunked") == (200, b"alpha,beta,gamma")
            assert len(set(s.peers)) == 1
            with pytest.raises(asyncio.TimeoutError):
                await get(pool, s.url, "/slow?s=2", timeout_s=0.2)
            await asyncio.sleep(0.5)  # idle timeout on the server
            results = await asyncio.gather(*(get(pool, s.url, f"/c{i}") for i in range(20)))
            assert all(status == 200 for status, _ in results)
            async with InferenceClient([s.url]) as c:
                assert (await c.complete("go")).text == " take apple"
            await pool.close()

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
