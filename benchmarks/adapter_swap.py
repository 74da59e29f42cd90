"""Publish-to-live latency of a LoRA adapter on the embedded server with the real default model.

For each new version the clock starts when ``POST /v1/load_lora_adapter`` is sent (an r=8, alpha=16,
all-linear peft adapter, the learner's format) and stops when the first completion from that
version arrives (a short prompt, one token). Like the learner, each publish loads ``policy-vN`` and
unloads ``policy-v(N-2)``. Measured twice: with the server idle, and while 4 clients keep generating
on the base model (the server is never idle in a run). Prints the medians; the last line is the
under-load one.

    python benchmarks/adapter_swap.py [--versions 12]

Last line: ``adapter_swap_ms=X`` (median under load).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _inference import served, write_random_adapters  # noqa: E402

from comap_async.config import load_config  # noqa: E402
from comap_async.models import resolve_model  # noqa: E402
from comap_async.wire.inference_client import InferenceClient  # noqa: E402
from comap_async.wire.messages import POLICY, adapter_name  # noqa: E402

PROBE = "Decision:"


async def publish_series(client: InferenceClient, root: Path, start: int, count: int) -> list[float]:
    out = []
    for v in range(start, start + count):
        name = adapter_name(POLICY, v)
        t0 = time.perf_counter()
        await client.load_adapter(name, str(root / f"a{v % 4}"))
        r = await client.complete(PROBE, model=name, max_tokens=1, temperature=0.0)
        out.append((time.perf_counter() - t0) * 1000)
        assert r.model == name
        if v - 2 >= start:
            await client.unload_adapter(adapter_name(POLICY, v - 2))
        await asyncio.sleep(0.2)
    for v in range(max(start, start + count - 2), start + count):
        await client.unload_adapter(adapter_name(POLICY, v))
    return out


async def main(args: argparse.Namespace) -> None:
    cfg = load_config(args.config)
    model_dir = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_random_adapters(model_dir, root, [f"a{i}" for i in range(4)])
        with served([f"model.name_or_path={cfg.model.name_or_path}"], root, root / "serve.log") as url:
            async with InferenceClient([url], timeout_s=600) as client:
                await client.complete(PROBE, max_tokens=2)  # warm-up
                idle = await publish_series(client, root, 1, args.versions)
                stop = asyncio.Event()

                async def background(w: int) -> None:
                    while not stop.is_set():
                        await client.complete(
                            "You are in the middle of a room.", max_tokens=32, temperature=0.7, seed=w, ignore_eos=True
                        )

                bg = [asyncio.create_task(background(w)) for w in range(4)]
                await asyncio.sleep(2.0)
                loaded = await publish_series(client, root, 100, args.versions)
                stop.set()
                await asyncio.gather(*bg)
                metrics = await (await client._get_session().get(url + "/metrics")).text()
    fast = [line for line in metrics.splitlines() if line.startswith("comap_inference_adapter_loads_total")]
    print(f"idle: median {statistics.median(idle):.0f} ms, max {max(idle):.0f} ms over {len(idle)} publishes")
    print(f"under load (4 clients generating): median {statistics.median(loaded):.0f} ms, max {max(loaded):.0f} ms")
    print("loads: " + ", ".join(fast))
    print(f"adapter_swap_ms={statistics.median(loaded):.0f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None)
    p.add_argument("--versions", type=int, default=12)
    asyncio.run(main(p.parse_args()))
