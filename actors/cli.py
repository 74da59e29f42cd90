"""``comap actor`` / ``python -m actors``: concurrent environment workers running the CoMap loop."""

from __future__ import annotations

import argparse

from comap_async.cli import add_config_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--envs", type=int, default=None, help="concurrent episodes in this process (default: actor.envs)")
    p.add_argument("--episodes", type=int, default=None, help="stop after this many episodes (default: run for ever)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from actors.worker import ActorWorker
    from comap_async.config import load_config
    from comap_async.logsetup import configure_logging
    from comap_async.priority import lower_priority, niceness

    cfg = load_config(args.config, args.overrides, training=True)
    log = configure_logging("actor", run=cfg.run.name)
    if nice := niceness(cfg, "actor"):
        log.info("actor.priority", niceness=lower_priority(nice))
    worker = ActorWorker(cfg, log, envs=args.envs, episodes=args.episodes)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop.set)
        await worker.run()

    from comap_async.envs.pool import EnvPoolExhausted

    try:  # uvloop: 1.6 against 2.65 ms of actor CPU per step on asyncio (benchmarks/actor_overhead.py)
        import uvloop
    except ImportError:
        run_loop = asyncio.run
    else:
        run_loop = uvloop.run
    try:
        run_loop(main())
    except EnvPoolExhausted as exc:  # logged too; comap prints it as one line and exits non-zero
        log.error("actor.env_pool_exhausted", error=str(exc))
        raise
    return 0
