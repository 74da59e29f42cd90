"""``comap broker`` / ``python -m broker``: run the broker until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from comap_async.cli import add_config_arguments

    add_config_arguments(p)
    p.add_argument("--replay-dir", default=None, help="LMDB directory (default: <run dir>/replay)")


def run(args: argparse.Namespace) -> int:
    from broker.gate_worker import pool_spec
    from broker.server import Broker
    from comap_async.config import ConfigError, is_loopback, load_config
    from comap_async.gctune import tune_gc_for_throughput
    from comap_async.logsetup import configure_logging
    from comap_async.wire.curve import KeysError, load_server_keys

    try:
        cfg = load_config(args.config, args.overrides, training=True)
    except ConfigError as exc:
        print(f"comap broker: error: {exc}", file=sys.stderr)
        return 2
    log = configure_logging("broker")
    b = cfg.broker
    if not is_loopback(b.host) and not b.curve:  # the config invariant says so too; never bind open
        log.error("broker.refused", reason=f"host {b.host} is not loopback and broker.curve is off")
        return 2
    try:
        keys = load_server_keys(b.keys_dir) if b.curve else None
    except KeysError as exc:
        print(f"comap broker: error: {exc}", file=sys.stderr)
        return 2

    async def main() -> int:
        broker = None
        try:
            broker = Broker(cfg, log, keys, replay_dir=args.replay_dir, gate_spec=pool_spec(cfg))
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, broker.stopping.set)
            await broker.start()
        except Exception as exc:  # port in use, LMDB unreadable...: a clear line, not a traceback wall
            log.error("broker.start_failed", error=f"{type(exc).__name__}: {exc}")
            if broker is not None:  # what started before the failure (ZeroMQ ports, gate workers) would keep us up
                try:
                    await broker.shutdown()
                except Exception as close_exc:  # noqa: BLE001 - the start's error is the one to report
                    log.error("broker.close_failed", error=repr(close_exc))
            print(f"comap broker: error: cannot start: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
            return 2
        tune_gc_for_throughput()
        await broker.stopping.wait()
        await broker.shutdown()
        return 0

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker", description="comap-async replay broker")
    add_arguments(parser)
    return run(parser.parse_args(argv))
