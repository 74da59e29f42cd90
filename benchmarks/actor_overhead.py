"""The actor's own CPU time per environment step (the CoMap step: 4-5 model calls, gates, outbox).

Runs a real actor in this process against a broker subprocess and an embedded tiny-model server
subprocess; environments live in worker processes. This process's CPU time (all its threads)
therefore excludes inference and the environment; it is sampled in steady state (after the first
steps) and divided by the steps taken meanwhile.

    python benchmarks/actor_overhead.py [--data DIR] [--episodes 12] [--envs 4]

Last line: ``actor_cpu_ms_per_step=X``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


async def measure(cfg, episodes: int, envs: int) -> tuple[float, int]:
    from actors.worker import ActorWorker
    from comap_async.logsetup import configure_logging
    from comap_async.wire.broker_client import BrokerClient
    from comap_async.wire.messages import COEVOLVE, ROLES

    async with BrokerClient(f"tcp://127.0.0.1:{cfg.broker.learner_port}") as bc:
        await bc.announce(COEVOLVE, dict.fromkeys(ROLES, 0), {}, 0)
    worker = ActorWorker(cfg, configure_logging("actor-bench", level="WARNING"), envs=envs, episodes=episodes)
    samples: list[tuple[float, int]] = []

    async def sample() -> None:
        while True:
            samples.append((time.process_time(), worker.metrics.steps))
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample())
    await worker.run()
    sampler.cancel()
    # steady state: from the first completed episode to the last sample with progress
    steady = [s for s in samples if s[1] > 0]
    if len(steady) < 2 or steady[-1][1] == steady[0][1]:
        raise SystemExit("too few steps measured; raise --episodes")
    (c0, n0), (c1, n1) = steady[0], max(steady, key=lambda s: s[1])
    return (c1 - c0) / (n1 - n0) * 1000.0, n1 - n0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default=os.environ.get("ALFWORLD_DATA", "~/.cache/comap-async/alfworld"))
    ap.add_argument("--episodes", type=int, default=12)
    ap.add_argument("--envs", type=int, default=4)
    ap.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="event loop of the actor process (comap actor uses uvloop when installed)",
    )
    args = ap.parse_args()

    from benchmarks._inference import broker_running, served
    from comap_async.config import load_config
    from comap_async.models import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="actor-bench-"))
    model = build_tiny_model(tmp / "tiny")
    (tmp / "runs").mkdir()
    with (
        broker_running(tmp / "runs", ["broker.max_staleness=100"], tmp) as broker,
        served(
            [f"model.name_or_path={model}", "inference.max_prompt_tokens=2048"], tmp, tmp / "serve.log", timeout_s=120
        ) as url,
    ):
        cfg = load_config(
            REPO / "configs" / "test.yaml",
            [
                *broker.overrides(),
                f"model.name_or_path={model}",
                f"inference.endpoints=['{url}']",
                f"env.data_dir={Path(args.data).expanduser()}",
                "env.split=train",
                "env.max_steps=10",
            ],
        )
        if args.loop == "uvloop":
            import uvloop

            ms, steps = uvloop.run(measure(cfg, args.episodes, args.envs))
        else:
            ms, steps = asyncio.run(measure(cfg, args.episodes, args.envs))
    print(
        f"loop={args.loop} steps_measured={steps} envs={args.envs} "
        "calls_per_step=4-5 (draft, imagine, reflect, teacher[, imagine])"
    )
    print(f"actor_cpu_ms_per_step={ms:.2f}")


if __name__ == "__main__":
    main()
