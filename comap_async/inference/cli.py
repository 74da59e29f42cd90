"""``comap serve``: the OpenAI-compatible inference server (embedded CPU server, or vLLM)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from comap_async.cli import add_config_arguments

if TYPE_CHECKING:
    from comap_async.inference.server import Forward


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument(
        "--backend",
        choices=["embedded", "vllm"],
        default=None,
        help="override inference.backend (embedded: aiohttp + transformers + peft; vllm: vLLM's server)",
    )
    p.add_argument("--host", default=None, help="override inference.host")
    p.add_argument("--port", type=int, default=None, help="override inference.port")
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="adapter to load at start (repeatable); PATH inside the adapter root",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of the vLLM virtualenv (default: $COMAP_VLLM_PYTHON, else this interpreter)",
    )
    p.add_argument("--print-command", action="store_true", help="vllm backend: print the command instead of running it")


def run(args: argparse.Namespace, forward: Forward | None = None) -> int:
    """``forward``: the embedded server's forward when a caller names one (``benchmarks/serve_batching.py``
    compares the two); None: decided from the model."""
    from comap_async.config import ConfigError, load_config
    from comap_async.logsetup import configure_logging

    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f"inference.backend={args.backend}")
    if args.host:
        overrides.append(f"inference.host={args.host}")
    if args.port:
        overrides.append(f"inference.port={args.port}")
    cfg = load_config(args.config, overrides)
    log = configure_logging("inference", port=cfg.inference.port)
    loras: dict[str, str] = {}
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora {item!r}: expected NAME=PATH")
        loras[name] = path
    if not getattr(args, "print_command", False):  # before minutes of model loading, not after
        from comap_async.errors import check_port_free

        check_port_free(cfg.inference.host, cfg.inference.port, "inference.port (or --port)")
    if cfg.inference.backend == "vllm":
        from comap_async.inference import vllm

        try:
            if args.print_command:
                from comap_async.models import resolve_model

                argv, env = vllm.build_command(
                    cfg,
                    resolve_model(cfg.model.name_or_path, cfg.model.cache_dir),
                    vllm.find_vllm_python(args.vllm_python),
                    loras,
                    gpus=vllm.visible_gpus(),
                )
                print(" ".join(f"{k}={v}" for k, v in env.items()), " ".join(argv))
                return 0
            vllm.exec_vllm(cfg, args.vllm_python, loras, log=log)
        except FileNotFoundError as exc:
            raise ConfigError(str(exc)) from None
        return 1  # not reached: exec replaces the process
    from comap_async.inference.server import run_server

    return run_server(cfg, log, loras, forward=forward)
