"""structlog set-up shared by every process: JSON lines off a terminal, readable console on one."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import structlog


def configure_logging(
    role: str, level: str | None = None, json: bool | None = None, **ids: Any
) -> structlog.BoundLogger:
    """Configure structlog for this process and return a logger bound to its role and ids.

    ``json=None`` picks JSON lines when stderr is not a terminal (honcho, CI, files) and the
    console renderer otherwise; ``COMAP_LOG_JSON=1/0`` and ``COMAP_LOG_LEVEL`` override.
    """
    level = (level or os.environ.get("COMAP_LOG_LEVEL", "INFO")).upper()
    if json is None:
        env = os.environ.get("COMAP_LOG_JSON")
        json = (env == "1") if env in ("0", "1") else not sys.stderr.isatty()
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Libraries that use stdlib logging (aiohttp, transformers) go to the same stream.
    logging.basicConfig(
        stream=sys.stderr,
        level=max(logging.WARNING, getattr(logging, level, logging.INFO)),
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
        force=True,
    )
    # libraries' deprecation notices (transformers' `is_gradient_checkpointing`...) tell a user nothing
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(role=role, pid=os.getpid(), **ids)
    return structlog.get_logger(role)
