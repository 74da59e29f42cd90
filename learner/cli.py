"""``comap learner`` / ``python -m learner``: train the policy and world-model adapters continuously."""

from __future__ import annotations

import argparse

from comap_async.cli import add_config_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many optimizer steps (default: run for ever)"
    )


def run(args: argparse.Namespace) -> int:
    from comap_async.config import load_config
    from comap_async.logsetup import configure_logging

    cfg = load_config(args.config, args.overrides, training=True)
    from learner.loop import run_learner  # torch: after the config, so a refused one ends in a second

    log = configure_logging("learner", run=cfg.run.name)
    return run_learner(cfg, log, args.max_steps)
