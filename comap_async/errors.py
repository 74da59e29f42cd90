"""Expected failures of a command: what a user gets wrong or must fix (missing data, a missing model,
a busy port, an unusable run directory). ``comap`` prints their message as one line on stderr and
exits 2; ``--debug`` (or ``COMAP_DEBUG=1``) shows the traceback instead."""

from __future__ import annotations

import errno
import socket


class CommandError(Exception):
    """Base of the errors a command reports in one line (other exceptions are bugs: traceback)."""


class PortInUse(CommandError, OSError):
    pass


def check_port_free(host: str, port: int, setting: str) -> None:
    """Refuse at once, before any slow start-up, when ``host:port`` is taken (``setting`` names the
    config field to change)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(f"{host}:{port} is in use (another comap process?); stop it or set {setting}") from None
            raise CommandError(f"cannot listen on {host}:{port} ({setting}): {exc.strerror}") from None
