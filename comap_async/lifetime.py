"""A child process's lifetime tied to its parent's.

A command that starts a helper process (``comap eval`` and ``comap compare`` their embedded server,
an experiment its honcho, the broker its gate workers) stops it in a ``finally``;
a parent killed by a signal runs no ``finally``, and the helper would be left holding the cores.
Linux's ``PR_SET_PDEATHSIG`` has the kernel signal the child when its parent dies, however it died.

A ``comap`` command started with :func:`tied_env` asks for it first thing (``comap_async.cli``),
which needs no ``preexec_fn`` (unsafe in a parent that runs threads).
"""

from __future__ import annotations

import os
import signal

PR_SET_PDEATHSIG = 1
PARENT_ENV = "COMAP_DIE_WITH_PARENT"


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send this process ``sig`` when its parent dies; False where the platform
    cannot (not Linux), so the caller keeps its own check."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) == 0
    except (OSError, AttributeError):
        return False


def tied_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a ``comap`` child that must stop (SIGTERM, so it shuts down as on
    Ctrl-C) when this process dies."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def tie_to_parent_from_env() -> None:
    """In a ``comap`` command started with :func:`tied_env`: SIGTERM this process when the parent
    that started it dies, at once if it died already (this process was re-parented before asking)."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not parent.isdigit():
        return
    if die_with_parent(signal.SIGTERM) and os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)
