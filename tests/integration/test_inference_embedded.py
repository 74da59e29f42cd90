"""Embedded-server specifics beyond the shared contract: several prompts and n, metrics, start-up adapters."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.fixtures.core import free_port
from tests.fixtures.inference import AdapterFactory, start_server, stop_server

pytestmark = pytest.mark.timeout(120)


async def test_prompt_list_and_n_give_one_choice_each(embedded_server):
    async with embedded_server.client() as c:
        r = await c.complete(["go to", "look around"], n=2, max_tokens=3, temperature=1.0, seed=3, ignore_eos=True)
        single = await c.complete("look around", max_tokens=3, temperature=1.0, seed=3, ignore_eos=True)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.usage["completion_tokens"] == 12
    assert r.choices[2].text == single.text  # prompt 2, first sample: seed 3 as in the single request


async def test_metrics_are_prometheus_text(embedded_server):
    async with embedded_server.client() as c:
        await c.complete("look", max_tokens=4, ignore_eos=True)
    async with aiohttp.ClientSession() as s, s.get(embedded_server.url + "/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["comap_inference_generation_tokens_total"] >= 4
    assert values['comap_inference_http_requests_total{route="/v1/completions",status="200"}'] >= 1
    assert values["comap_inference_engine_alive"] == 1
    assert 0.0 <= values["comap_inference_idle_fraction"] < 1.0 and values["comap_inference_uptime_seconds"] > 0
    assert "# TYPE comap_inference_decode_steps_total counter" in text


def test_serve_loads_adapters_given_at_start(tiny_model_dir, tmp_path):
    root = tmp_path / "adapters"
    AdapterFactory(tiny_model_dir, root).random("policy-v1", seed=5)
    port = free_port()
    proc = start_server(
        [
            "--set",
            f"model.name_or_path={tiny_model_dir}",
            "--set",
            f"inference.port={port}",
            "--set",
            f"inference.adapter_root={root}",
            "--lora",
            "policy-v1=policy-v1",
        ],
        port,
        tmp_path / "serve.log",
        timeout_s=90,
    )
    try:
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
            ids = [m["id"] for m in json.loads(r.read())["data"]]
        assert ids == [str(tiny_model_dir), "policy-v1"]
    finally:
        stop_server(proc)
    assert proc.returncode == 0  # SIGTERM is a clean shutdown


def _metrics(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}


async def test_spare_slots_and_prefix_cache_follow_the_config(embedded_server, tiny_model_dir, tmp_path):
    from comap_async.inference.adapters import SPARE_ADAPTER_SLOTS

    # the shared server's spares are rebuilt in the background after earlier tests' loads (REFILL_DELAY_S,
    # then one slot at a time): wait for the pool to settle at its size
    deadline = time.monotonic() + 60
    while (default := _metrics(embedded_server.url))[
        "comap_inference_adapter_spare_slots"
    ] != SPARE_ADAPTER_SLOTS and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert (
        default["comap_inference_adapter_spare_slots"] == SPARE_ADAPTER_SLOTS
        and "comap_inference_prefix_cache_blocks" in default
    )
    root = tmp_path / "adapters"
    AdapterFactory(tiny_model_dir, root).random("policy-v1", seed=5, r=4)  # not the spares' shape (r=8)
    port = free_port()
    proc = start_server(
        [
            "--set",
            f"model.name_or_path={tiny_model_dir}",
            "--set",
            f"inference.port={port}",
            "--set",
            f"inference.adapter_root={root}",
            "--set",
            "inference.prefix_cache_mb=0",
        ],
        port,
        tmp_path / "serve.log",
        timeout_s=90,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        from comap_async.wire.inference_client import InferenceClient

        async with InferenceClient([url]) as c:
            await c.load_adapter("policy-v1", str(root / "policy-v1"))  # no spare fits: the slow path works
            out = await c.complete("look", model="policy-v1", max_tokens=3, ignore_eos=True)
        assert len(out.choices) == 1
        m = _metrics(url)
        assert m['comap_inference_adapter_loads_total{path="slow"}'] == 1
        assert "comap_inference_prefix_cache_blocks" not in m
    finally:
        stop_server(proc)


async def test_publishes_under_load_all_take_the_fast_path(embedded_server):
    """The learner's publish pattern (3 adapters per version, the version-3 ones unloaded) while
    clients keep the engine busy: with the fused forward, spares are rebuilt beside the decoding, so
    no load waits on the slow path (they used to, once the spares ran out under load)."""
    import asyncio
    import re

    from comap_async.inference.slot_registry import REFILL_DELAY_S

    factory = AdapterFactory(embedded_server.model_dir, embedded_server.adapter_root)
    roles = ("policy", "wm", "wm_teacher")
    paths = {
        (r, v): factory.random(f"fast-{r}-v{v}", seed=10 * v + i) for v in range(1, 6) for i, r in enumerate(roles)
    }

    async def slow_loads() -> float:
        async with aiohttp.ClientSession() as s, s.get(embedded_server.url + "/metrics") as r:
            m = re.search(r'^comap_inference_adapter_loads_total\{path="slow"\} (\S+)$', await r.text(), re.M)
        return float(m.group(1)) if m else 0.0

    before = await slow_loads()
    busy = True
    async with embedded_server.client() as c:

        async def client_loop(w: int) -> None:
            while busy:
                await c.complete(
                    "You arrive at the countertop 1.", max_tokens=24, temperature=1.0, seed=w, ignore_eos=True
                )

        loops = [asyncio.create_task(client_loop(w)) for w in range(4)]
        try:
            for v in range(1, 6):
                for r in roles:
                    await c.load_adapter(f"fast-{r}-v{v}", str(paths[(r, v)]))
                for r in roles if v > 3 else ():
                    await c.unload_adapter(f"fast-{r}-v{v - 3}")
                # a publish every few minutes in a run; spares are rebuilt REFILL_DELAY_S after a load,
                # beside the decoding: the engine stays busy all along
                await asyncio.sleep(REFILL_DELAY_S + 2.0)
        finally:
            busy = False
            await asyncio.gather(*loops)
        for v in (3, 4, 5):
            for r in roles:
                await c.unload_adapter(f"fast-{r}-v{v}")
    assert await slow_loads() == before


async def test_computed_prompt_tokens_are_counted_by_adapter_without_version(embedded_server):
    """``prompt_tokens_computed_total{adapter=...}``: what the prefix cache did not serve, per role (and
    ``generation_tokens_by_adapter_total``, what it generated): a repeated prompt on one adapter is mostly
    served; another version of the same role (its own slot, so its own cache entries) computes it all
    again, under the same label."""
    factory = AdapterFactory(embedded_server.model_dir, embedded_server.adapter_root)
    label = 'comap_inference_prompt_tokens_computed_total{adapter="acct-policy"}'
    generated = 'comap_inference_generation_tokens_by_adapter_total{adapter="acct-policy"}'
    prompt = "You arrive at countertop 1. On the countertop 1, you see a mug 2 and a knife 1. " * 6
    async with embedded_server.client() as c:
        for v in (1, 2):
            await c.load_adapter(f"acct-policy-v{v}", str(factory.random(f"acct-policy-v{v}", seed=v)))
        deltas = []
        for model in ("acct-policy-v1", "acct-policy-v1", "acct-policy-v2"):
            before = _metrics(embedded_server.url)
            await c.complete(prompt, model=model, max_tokens=2, temperature=0.0)
            after = _metrics(embedded_server.url)
            deltas.append(
                (
                    after["comap_inference_prompt_tokens_total"] - before["comap_inference_prompt_tokens_total"],
                    after[label] - before.get(label, 0.0),
                    after["comap_inference_prefix_cache_hit_tokens_total"]
                    - before["comap_inference_prefix_cache_hit_tokens_total"],
                )
            )
            # the tokens generated are counted under the same label (where decode steps go, by role)
            made = after["comap_inference_generation_tokens_total"] - before["comap_inference_generation_tokens_total"]
            assert after[generated] - before.get(generated, 0.0) == made >= 1
        for v in (1, 2):
            await c.unload_adapter(f"acct-policy-v{v}")
    (n1, computed1, hit1), (n2, computed2, hit2), (n3, computed3, hit3) = deltas
    assert n1 == n2 == n3 > 64
    assert computed1 == n1 and hit1 == 0
    assert computed2 + hit2 == n2 and hit2 >= 32 and computed2 < n2  # the same slot: served from the cache
    assert computed3 == n3 and hit3 == 0  # another version, another slot: computed again, counted as policy's


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_an_oversized_prompt_is_refused_before_it_is_tokenized(embedded_server, route):
    """An 8 MB prompt cannot fit in inference.max_prompt_tokens: it is refused on its length alone. It
    used to be tokenized first (10-32 s, the server grown by 0.9-2.5 GB), then refused all the same."""
    import json

    text = "go to cabinet 1 " * 500_000  # 8 MB
    body = {"prompt": text} if route == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    data = json.dumps({**body, "max_tokens": 4})
    pid = embedded_server.proc.pid
    before = _rss_mb(pid)
    async with aiohttp.ClientSession() as s:
        started = time.monotonic()
        async with s.post(embedded_server.url + route, data=data, headers={"Content-Type": "application/json"}) as r:
            status, answer = r.status, await r.json()
        elapsed = time.monotonic() - started
    grown = _rss_mb(pid) - before
    print(f"{route}: {status} in {elapsed:.2f} s, RSS {before:.0f} MB -> {before + grown:.0f} MB")
    assert status == 400 and elapsed < 2.0 and grown < 200, f"{status} in {elapsed:.1f} s, RSS +{grown:.0f} MB"
    message = answer["error"]["message"]
    assert message.startswith("prompt 0 has 8000000 characters; no more than ") and "max_prompt_tokens" in message
    assert "\n" not in message
    async with embedded_server.client() as c:  # the server goes on serving
        r = await c.complete("look around", max_tokens=3, ignore_eos=True)
    assert r.usage["completion_tokens"] == 3
