"""ZeroMQ CURVE keys: ``comap keys --out DIR`` writes them (:func:`generate_keys`), broker and clients load them.

Layout of a keys directory::

    server.key, server.key_secret          the broker's key pair (clients need server.key)
    <client>.key, <client>.key_secret      one pair per client identity (default name: client)
    authorized_clients/<client>.key        public keys the broker accepts (ZAP allow-list)

Copy the directory (or ``server.key`` plus one client pair) to each node. A client key is
authorised by having its public ``.key`` in ``authorized_clients/``; remove it to revoke.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from comap_async.errors import CommandError

AUTHORIZED = "authorized_clients"


class KeysError(CommandError, RuntimeError):
    """Keys are missing or unreadable; the message says which file and how to make it."""


@dataclass(frozen=True, slots=True)
class ServerKeys:
    public: bytes
    secret: bytes
    authorized_dir: Path


@dataclass(frozen=True, slots=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the broker (call before connect)."""
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_serverkey = self.server_public


def _make_pair(out: Path, name: str, force: bool) -> None:
    if (out / f"{name}.key_secret").exists() and not force:
        return
    for suffix in (".key", ".key_secret"):
        (out / f"{name}{suffix}").unlink(missing_ok=True)
    zmq.auth.create_certificates(str(out), name)
    os.chmod(out / f"{name}.key_secret", 0o600)


def generate_keys(out: str | Path, clients: list[str] | None = None, force: bool = False) -> Path:
    """Create the server pair and client pairs (kept if present unless ``force``); authorise clients."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    (out / AUTHORIZED).mkdir(exist_ok=True)
    _make_pair(out, "server", force)
    for name in clients or ["client"]:
        if name == "server" or "/" in name or not name:
            raise ValueError(f"invalid client name {name!r}")
        _make_pair(out, name, force)
        shutil.copyfile(out / f"{name}.key", out / AUTHORIZED / f"{name}.key")
    return out


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeysError(f"CURVE key file {path} not found (create keys with `comap keys --out {path.parent}`)")
    try:
        public, sec = zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as exc:
        raise KeysError(f"CURVE key file {path} is unreadable: {exc}") from None
    if secret and sec is None:
        raise KeysError(f"{path} holds no secret key")
    return public, sec


def load_server_keys(keys_dir: str | Path) -> ServerKeys:
    d = Path(keys_dir).expanduser()
    public, secret = _load(d / "server.key_secret", True)
    auth = d / AUTHORIZED
    if not auth.is_dir() or not any(auth.glob("*.key")):
        raise KeysError(f"no authorised client keys in {auth} (run `comap keys --out {d}`)")
    return ServerKeys(public, secret, auth)  # type: ignore[arg-type]


def load_client_keys(keys_dir: str | Path, name: str = "client") -> ClientKeys:
    d = Path(keys_dir).expanduser()
    public, secret = _load(d / f"{name}.key_secret", True)
    server_public, _ = _load(d / "server.key", False)
    return ClientKeys(public, secret, server_public)  # type: ignore[arg-type]


def client_connection(cfg: Any, port: int, keys: Any = None) -> tuple[str, Any]:
    """(endpoint, CURVE client keys or None) for a client of the broker's ``port`` under ``cfg``."""
    if keys is None and cfg.broker.curve:
        keys = load_client_keys(cfg.broker.keys_dir)
    host = "127.0.0.1" if cfg.broker.host in ("localhost", "0.0.0.0") else cfg.broker.host
    return f"tcp://{host}:{port}", keys
