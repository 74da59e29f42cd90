"""The ``comap`` console command.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
a module is imported only when its command runs (``build_parser`` adds the arguments of the one
command named), so ``comap --help`` is instant and the core never imports a process package.
Only working commands are listed here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys

# name -> (module, one-line help). Process packages own their entry modules.
COMMANDS: dict[str, tuple[str, str]] = {
    "model": ("comap_async.commands.model", "provision models: `comap model prepare` (default SmolLM2, offline)"),
    "config": ("comap_async.commands.show_config", "print the validated configuration (with --set overrides)"),
    "serve": (
        "comap_async.inference.cli",
        "OpenAI-compatible LLM server with LoRA hot-swap (embedded CPU, or --backend vllm)",
    ),
    "data": ("comap_async.commands.data", "extract offline datasets: `comap data alfworld --archive PATH... --to DIR`"),
    "env": ("comap_async.commands.env", "check environments: `comap env check --split NAME --data DIR`"),
    "procfile": (
        "comap_async.commands.procfile",
        "write the Procfile of a GPU host from inference.gpus and "
        "learner.gpus (CUDA_VISIBLE_DEVICES, one vLLM server per GPU group, endpoints wired)",
    ),
    "broker": ("broker.cli", "run the replay broker (ZeroMQ ingest, gates, LMDB stores, stats HTTP)"),
    "keys": ("comap_async.commands.keys", "create ZeroMQ CURVE key pairs for the broker and its clients"),
    "learner": ("learner.cli", "train the policy and world-model LoRA adapters continuously; publish them"),
    "actor": ("actors.cli", "run environment workers playing the CoMap loop (phases from the broker)"),
    "eval": ("evaluator.evaluate", "evaluate adapters on a split; writes eval.json and eval.md"),
    "compare": (
        "evaluator.compare",
        "the newest version of each run and the prompting baselines on the same games: one table and one bar chart",
    ),
    "evaluator": (
        "evaluator.evaluator",
        "held-out probes and success rate of every new adapter version, while the system runs",
    ),
    "fork": (
        "experiments.fork",
        "start a new run from another run's published version (its checkpoint, adapters and "
        "the replay of then): ablations share one warm-up",
    ),
    "experiment": (
        "experiments.cli",
        "run an experiment spec end to end (source, forks trained N steps, every row on the same games, paired "
        "statistics), resumable; or redraw its report",
    ),
    "stats": ("comap_async.commands.stats", "live summary of a running system from the broker (--plot DIR for PNGs)"),
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    # $COMAP_CONFIG / $COMAP_OVERRIDES let one Procfile drive any config (honcho passes the environment)
    parser.add_argument(
        "--config",
        "-c",
        default=os.environ.get("COMAP_CONFIG") or None,
        help="YAML config file (default: $COMAP_CONFIG, else built-in defaults)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=shlex.split(os.environ.get("COMAP_OVERRIDES", "")),
        metavar="SECTION.KEY=VALUE",
        help="override one config field (repeatable; $COMAP_OVERRIDES holds more, whitespace-separated)",
    )


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``comap`` parser; only ``command``'s module is imported (for its arguments), so no
    process package is loaded unless its own subcommand runs."""
    parser = argparse.ArgumentParser(
        prog="comap", description="comap-async: co-evolving LLM agent policies and world models"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, add_help=name == command)
        p.set_defaults(_module=module)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (its first word that is not an option), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    """Run a command; its expected failures (:class:`comap_async.errors.CommandError`: bad config,
    missing data or model, a busy port...) end with one line on stderr and exit 2, with the
    traceback only under ``--debug`` or ``COMAP_DEBUG=1``."""
    from comap_async.errors import CommandError
    from comap_async.lifetime import tie_to_parent_from_env

    tie_to_parent_from_env()
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("COMAP_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except CommandError as exc:
        if debug:
            raise
        print(f"comap {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
