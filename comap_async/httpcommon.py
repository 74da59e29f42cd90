"""What the broker's and the inference server's HTTP endpoints share: the bearer-token check and
Prometheus text exposition (format 0.0.4, no client library needed)."""

from __future__ import annotations

import hmac
from typing import Any


def bearer_matches(authorization: str, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (constant-time compare)."""
    return authorization.startswith("Bearer ") and hmac.compare_digest(authorization[7:].encode(), token.encode())


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def append_metric(out: list[str], name: str, kind: str, help_text: str,
                  samples: list[tuple[dict[str, Any], float]]) -> None:
    """Append one metric family (HELP, TYPE, a line per labelled sample); ``name`` is the full name."""
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        out.append(f"{name}{{{lab}}} {float(value)!r}" if lab else f"{name} {float(value)!r}")
