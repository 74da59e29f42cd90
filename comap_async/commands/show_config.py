"""``comap config``: validate a config and print it as YAML (or explain each field)."""

from __future__ import annotations

import argparse

from comap_async.cli import add_config_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--explain", action="store_true", help="print every field with its description")


def run(args: argparse.Namespace) -> int:
    import yaml

    from comap_async.config import CoMapConfig, load_config

    cfg = load_config(args.config, args.overrides)
    if not args.explain:
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    for section, field in CoMapConfig.model_fields.items():
        print(f"{section}:  # {field.description}")
        sub = getattr(cfg, section)
        for name, f in type(sub).model_fields.items():
            desc = " ".join((f.description or "").split())
            print(f"  {name}: {getattr(sub, name)!r}  # {desc}")
    return 0
