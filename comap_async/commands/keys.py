"""``comap keys``: create ZeroMQ CURVE key pairs for the broker and its clients."""

from __future__ import annotations

import argparse

from comap_async.wire.curve import generate_keys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from comap_async.cli import add_config_arguments

    add_config_arguments(p)
    p.add_argument("--out", default=None, help="keys directory (default: broker.keys_dir of the config)")
    p.add_argument(
        "--client",
        action="append",
        default=None,
        metavar="NAME",
        help="client identity to create and authorise (repeatable; default: client)",
    )
    p.add_argument("--force", action="store_true", help="replace existing key pairs")


def run(args: argparse.Namespace) -> int:
    from comap_async.config import load_config

    out = args.out
    if out is None:
        out = load_config(args.config, args.overrides).broker.keys_dir
    path = generate_keys(out, args.client, args.force)
    print(path)
    return 0
