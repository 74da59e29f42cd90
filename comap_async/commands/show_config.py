"""``comap config``: validate a config and print it as YAML (or explain each field)."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import BaseModel

from comap_async.cli import add_config_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--explain", action="store_true", help="print every field with its description")


def run(args: argparse.Namespace) -> int:
    import yaml

    from comap_async.config import load_config

    cfg = load_config(args.config, args.overrides)
    if not args.explain:
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    explain(cfg)
    return 0


def explain(section: Any, indent: str = "") -> None:
    """Every field of ``section`` with its value and docstring; a nested section (``learner.phases``)
    as a heading with its own fields below it."""
    for name, f in type(section).model_fields.items():
        value, desc = getattr(section, name), " ".join((f.description or "").split())
        if isinstance(value, BaseModel):
            print(f"{indent}{name}:  # {desc}")
            explain(value, indent + "  ")
        else:
            print(f"{indent}{name}: {value!r}  # {desc}")
