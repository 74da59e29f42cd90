"""The method's fingerprint: the settings every process must share, hashed, so that a process
started with another config is refused in one line instead of training on data it misreads.

The broker's config is the reference: it puts its fingerprint in the registry (every ack carries
it), refuses a learner's announce that names another, and the learner (at start) and the actors
(before each episode) compare theirs with the registry's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from comap_async.errors import CommandError
from comap_async.method.gates import SampleRule


class MethodMismatch(CommandError):
    """Two processes of one run disagree on the method's settings."""


def method_settings(cfg: Any) -> dict[str, Any]:
    """What must agree across processes: the environment, the gates' rule (thresholds and the
    ablations that change them), every ablation switched on and the related methods' switches."""
    return {
        "env": cfg.env.name,
        "rule": dataclasses.asdict(SampleRule.from_config(cfg)),
        "ablation": sorted(cfg.method.ablation),  # its key as before: the hash of the same method stays
        "methods": sorted(cfg.method_switches),
    }


def fingerprint(cfg: Any) -> str:
    blob = json.dumps(method_settings(cfg), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def describe(cfg: Any) -> str:
    s = method_settings(cfg)
    r = s["rule"]
    return (
        f"{fingerprint(cfg)} (env {s['env']}, ablation {'+'.join(s['ablation']) or 'none'}, methods "
        f"{'+'.join(s['methods']) or 'none'}, tau_p {r['tau_p']}, tau_q {r['tau_q']}, tau_ws {r['tau_ws']})"
    )


def check_method(cfg: Any, theirs: str | None, who: str) -> None:
    """MethodMismatch when ``who`` (e.g. "the broker") runs another method than ``cfg``'s; an empty
    ``theirs`` (a peer that does not say) passes."""
    if theirs and theirs != fingerprint(cfg):
        raise MethodMismatch(
            f"{who} runs method {theirs}, this process {describe(cfg)}: start every process of a "
            "run with the same config (env, method, related methods)"
        )
