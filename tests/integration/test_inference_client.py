"""InferenceClient against small real aiohttp servers on loopback (scripted answers, real sockets)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from comap_async.wire.inference_client import InferenceClient, InferenceError, affinity
from tests.fixtures.core import free_port

pytestmark = pytest.mark.timeout(60)

OK = {
    "id": "cmpl-1",
    "object": "text_completion",
    "model": "m",
    "usage": {"completion_tokens": 1},
    "choices": [
        {
            "index": 0,
            "text": " KEEP",
            "finish_reason": "length",
            "stop_reason": None,
            "logprobs": {
                "tokens": [" KEEP"],
                "token_logprobs": [-0.1],
                "top_logprobs": [{" KEEP": -0.1}],
                "text_offset": [0],
            },
        }
    ],
}


class Fake:
    """One scripted server: ``script`` is a list of statuses (or "hang") consumed per completion request."""

    def __init__(self, script=None, hold: asyncio.Event | None = None) -> None:
        self.script = list(script or [])
        self.hold = hold
        self.calls: list[tuple[str, dict, str | None]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        self.calls.append((request.path, body, request.headers.get("Authorization")))
        if self.hold is not None:
            await self.hold.wait()
        step = self.script.pop(0) if self.script else 200
        if step == "hang":
            await asyncio.sleep(1.5)
        if step != 200:
            return web.json_response({"error": {"message": f"scripted {step}", "code": step}}, status=step)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "base"}, {"id": "policy-v1"}]})
        if request.path == "/health":
            return web.Response()
        if request.path.endswith("lora_adapter"):
            return web.Response(text="Success")
        return web.json_response(OK)

    async def __aenter__(self) -> "Fake":
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def client(urls, **kw) -> InferenceClient:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("backoff_max_s", 0.05)
    return InferenceClient(urls, **kw)


async def test_retries_5xx_then_succeeds_and_parses():
    async with Fake([503, 500]) as s, client([s.url], retries=3, token="t") as c:
        resp = await c.complete("Decision:", logprobs=1)
    assert len(s.calls) == 3
    assert all(auth == "Bearer t" for _, _, auth in s.calls)
    assert resp.choices[0].logprobs.top_logprobs[0] == {" KEEP": -0.1}
    assert resp["choices"][0]["text"] == " KEEP" and resp.choices[0].get("logprobs").get("tokens") == [" KEEP"]


async def test_a_configured_priority_rides_on_every_completion():
    """A client's ``priority`` (the evaluator's: ``eval.priority``) reaches the server as vLLM's ``priority``
    field; the default sends none (a vLLM without priority scheduling refuses one)."""
    from comap_async.config import load_config

    async with Fake() as s:
        cfg = load_config(None, [f"inference.endpoints=['{s.url}']"])
        for kw, expected in (({}, None), ({"priority": -1}, -1)):
            async with InferenceClient.from_config(cfg, **kw) as c:
                await c.complete("x")
            assert s.calls[-1][1].get("priority") == expected


async def test_client_errors_are_not_retried():
    async with Fake([400]) as s, client([s.url], retries=3) as c:
        with pytest.raises(InferenceError) as err:
            await c.complete("x")
    assert err.value.status == 400 and "scripted 400" in str(err.value)
    assert len(s.calls) == 1


async def test_dead_endpoint_fails_over_to_live_one():
    dead = f"http://127.0.0.1:{free_port()}"
    async with Fake() as s, client([dead, s.url], retries=2, seed=1) as c:
        for _ in range(6):
            await c.complete("x")
    assert len(s.calls) == 6


async def test_clear_error_after_retry_budget():
    dead = f"http://127.0.0.1:{free_port()}"
    async with client([dead], retries=3) as c:
        t0 = time.monotonic()
        with pytest.raises(InferenceError) as err:
            await c.complete("x")
    assert err.value.attempts == 4 and "after 4 attempts" in str(err.value)
    assert "Connect" in str(err.value) or "Connection" in str(err.value)
    assert time.monotonic() - t0 < 5


async def test_timeout_is_retried_then_reported():
    async with Fake(["hang", "hang"]) as s, client([s.url], retries=1, timeout_s=0.3) as c:
        with pytest.raises(InferenceError) as err:
            await c.complete("x")
    assert "timed out" in str(err.value) and len(s.calls) == 2


async def test_least_outstanding_spreads_concurrent_requests():
    hold = asyncio.Event()
    async with Fake(hold=hold) as a, Fake(hold=hold) as b, client([a.url, b.url]) as c:
        tasks = [asyncio.create_task(c.complete("x")) for _ in range(6)]
        while len(a.calls) + len(b.calls) < 6:
            await asyncio.sleep(0.01)
        assert c.outstanding == {a.url: 3, b.url: 3}
        hold.set()
        await asyncio.gather(*tasks)
    assert len(a.calls) == len(b.calls) == 3


async def test_an_episodes_requests_stay_on_one_server_while_episodes_spread():
    """Each episode (an :data:`affinity` key, inherited by the tasks it starts) keeps its server,
    where its prompts' prefixes are cached; different episodes still spread by load."""
    async with Fake() as a, Fake() as b, client([a.url, b.url], seed=3) as c:

        async def episode(i: int) -> list[str]:
            affinity.set(f"e{i}")
            seen = []
            for _ in range(4):  # sequential steps, then a step with concurrent calls
                seen.append((await c.complete(f"episode {i}")).endpoint)
            both = await asyncio.gather(c.complete(f"episode {i}"), c.complete(f"episode {i}"))
            return seen + [r.endpoint for r in both]

        served = await asyncio.gather(*(episode(i) for i in range(8)))
    assert all(len(set(eps)) == 1 for eps in served)
    assert {eps[0] for eps in served} == {a.url, b.url}
    assert affinity.get() is None  # the tasks' keys stayed in the tasks


def test_an_episode_leaves_its_server_when_that_one_is_much_busier():
    a, b = "http://127.0.0.1:1", "http://127.0.0.1:2"
    c = InferenceClient([a, b], affinity_slack=2)
    affinity.set("e0")
    try:
        c.outstanding = {a: 0, b: 0}
        first = c.pick()
        other = b if first == a else a
        c.outstanding = {first: 2, other: 0}  # within the slack: the episode stays
        assert c.pick() == first
        c.outstanding = {first: 3, other: 0}  # beyond it: the episode moves, and stays there
        assert c.pick() == other
        c.outstanding = {first: 0, other: 1}
        assert c.pick() == other
    finally:
        affinity.set(None)


def test_the_affinity_map_is_bounded():
    from comap_async.wire import inference_client as ic

    c = InferenceClient(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    for i in range(ic.AFFINITY_KEYS + 50):
        affinity.set(f"e{i}")
        c.pick()
    affinity.set(None)
    assert len(c._sticky) == ic.AFFINITY_KEYS and "e0" not in c._sticky


async def test_admin_calls_reach_every_endpoint_and_report_failures():
    async with Fake() as a, Fake([200, 404, 404]) as b, client([a.url, b.url]) as c:
        await c.load_adapter("policy-v1", "/adapters/policy-v1")
        assert [p for p, _, _ in a.calls] == [p for p, _, _ in b.calls] == ["/v1/load_lora_adapter"]
        assert a.calls[0][1] == {"lora_name": "policy-v1", "lora_path": "/adapters/policy-v1", "load_inplace": False}
        with pytest.raises(InferenceError) as err:
            await c.unload_adapter("policy-v1")
        assert "1/2 endpoints" in str(err.value) and b.url in str(err.value)
        await c.unload_adapter("policy-v1", missing_ok=True)
        await c.load_adapter("policy-v2", "/p", endpoint=a.url)
        assert len(a.calls) == 4 and len(b.calls) == 3
        assert await c.models() == ["base", "policy-v1"]


async def test_health_probe():
    dead = f"http://127.0.0.1:{free_port()}"
    async with Fake() as s, client([s.url, dead]) as c:
        assert await c.health() == {s.url: True, dead: False}
        assert await c.health(endpoint=s.url) is True
        with pytest.raises(InferenceError):
            await c.health(endpoint=dead)
