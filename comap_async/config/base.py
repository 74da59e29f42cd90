"""What every config section shares: the strict base model, the one config error, the request priority's
bounds, and the host check that decides when a listener needs authentication."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
