"""What every config section shares: the strict base model, the one config error, the retry policy
of clients, and the host check that decides when a listener needs authentication."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from comap_async.errors import CommandError


class ConfigError(CommandError, ValueError):
    """A configuration file or override is wrong; the message names the file, field and reason."""


PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
RequestPriority = Annotated[int, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX)]
"""vLLM's request ``priority`` (lower is admitted first), as an int32: the bounds the embedded server takes too."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


def lookup_env_spec(name: str) -> Any:
    from comap_async.envs.registry import env_spec  # light: the entries name their parts by import path

    return env_spec(name)


class RetryConfig(Section):
    """One retry policy (``comap_async/retry.py``): how often a client call is tried and how long it
    waits in between. A caller that wraps a client which retries itself passes that client a policy
    of one attempt, so attempts never multiply."""

    attempts: int = Field(default=6, ge=1)
    """Tries in all, the first one included (1 = no retry); then the last error is raised."""
    backoff_s: float = Field(default=0.25, ge=0.0)
    """Wait before the second try; it doubles before each later try (exponential backoff)."""
    backoff_max_s: float = Field(default=8.0, ge=0.0)
    """Upper bound of one wait."""
    jitter: Literal["full", "none"] = "full"
    """``full``: each wait is drawn uniformly from [0, the exponential wait], so many clients that
    failed together do not retry in lockstep; ``none``: exactly the exponential wait."""

    @model_validator(mode="after")
    def _bounds(self) -> "RetryConfig":
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) must be at least backoff_s ({self.backoff_s})")
        return self


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
