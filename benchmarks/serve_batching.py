"""Batching gain of the embedded inference server with the real default model (SmolLM2-135M-Instruct).

A real ``comap serve`` (default config: torch_threads=1, max_batch_size=8) gets actor draft prompts
(~140 tokens: the shared chat header and system prompt, then a state that differs per request) with
64 generated tokens per request (``ignore_eos`` so every request does the same work) from 1 client,
then from 8 concurrent clients, in alternating rounds so the ratio is taken under the same machine
load. Aggregate tokens/s = generated tokens / wall time. A last
measurement runs the 8 clients over 4 different adapters plus the base (one mixed batch).

    python benchmarks/serve_batching.py [--rounds 2] [--max-tokens 64]

Last line: ``batching_speedup=X`` (8 concurrent / 1 concurrent aggregate tokens/s).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _inference import served, write_random_adapters  # noqa: E402

from comap_async.config import load_config  # noqa: E402
from comap_async.inference.client import InferenceClient  # noqa: E402
from comap_async.models import resolve_model  # noqa: E402
from comap_async.prompts import ChatTemplate, Prompts  # noqa: E402

OBJECTS = ["apple", "bread", "knife", "mug", "egg", "lettuce", "potato", "tomato", "spoon", "cup"]
PLACES = ["countertop", "cabinet", "drawer", "shelf", "fridge", "sinkbasin", "microwave", "desk"]


def state(i: int) -> str:
    """A distinct ALFWorld-like state per request (prompts share only the header and system prompt)."""
    o, p = OBJECTS[i % len(OBJECTS)], PLACES[(i // len(OBJECTS)) % len(PLACES)]
    return (f"Task: put a clean {o} in {PLACES[(i + 3) % len(PLACES)]}.\nRecent history:\n> go to {p} {i % 3 + 1}\n"
            f"You arrive at {p} {i % 3 + 1}. On the {p} {i % 3 + 1}, you see a {o} {i % 4 + 1}, a bread 2, a knife 1.\n"
            f"Current observation: You pick up the {o} {i % 4 + 1} from the {p} {i % 3 + 1}.\n"
            f"Admissible commands: go to fridge 1, go to sinkbasin 1, inventory, look, examine {p} {i % 3 + 1}")


async def rate(client: InferenceClient, prompts: Prompts, concurrency: int, per_client: int, max_tokens: int,
               models: list[str | None], offset: int) -> float:
    tokens = 0

    async def worker(w: int) -> None:
        nonlocal tokens
        for i in range(per_client):
            prompt = prompts.draft(state(offset + w * per_client + i))
            r = await client.complete(prompt, model=models[w % len(models)], max_tokens=max_tokens, temperature=0.7,
                                      seed=100 * w + i, ignore_eos=True)
            tokens += r.usage["completion_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return tokens / (time.perf_counter() - t0)


async def main(args: argparse.Namespace) -> None:
    cfg = load_config(args.config)
    model_dir = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
    prompts = Prompts(ChatTemplate.from_model_dir(model_dir))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        names = [f"policy-v{i}" for i in range(4)]
        write_random_adapters(model_dir, root, names)
        overrides = [f"model.name_or_path={cfg.model.name_or_path}"] + (args.set or [])
        with served(overrides, root, root / "serve.log") as url:
            async with InferenceClient([url], timeout_s=600) as client:
                for name in names:
                    await client.load_adapter(name, str(root / name))
                await rate(client, prompts, 2, 1, 8, [None], 0)  # warm-up
                one, eight = [], []
                for r in range(args.rounds):
                    one.append(await rate(client, prompts, 1, 3, args.max_tokens, [None], 1000 + 100 * r))
                    eight.append(await rate(client, prompts, 8, 2, args.max_tokens, [None], 2000 + 100 * r))
                    print(f"round: 1 client {one[-1]:.1f} tok/s, 8 clients {eight[-1]:.1f} tok/s", flush=True)
                mixed = await rate(client, prompts, 8, 2, args.max_tokens, [None, *names], 5000)
    r1, r8 = sum(one) / len(one), sum(eight) / len(eight)
    print(f"tokens_per_s_1={r1:.1f}")
    print(f"tokens_per_s_8={r8:.1f}")
    print(f"tokens_per_s_8_mixed_adapters={mixed:.1f} (base + 4 adapters in one batch; {mixed / r8:.2f}x of base-only)")
    print(f"batching_speedup={r8 / r1:.2f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="config file (default: built-in defaults, the real default model)")
    p.add_argument("--set", action="append", help="extra --set overrides for the server")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    asyncio.run(main(p.parse_args()))
