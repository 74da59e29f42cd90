"""The actor's one view of the broker's registry: the phase, and which adapter serves each role.

It rides on every ack (the outbox hands each ack's registry to :meth:`RegistryView.update`); before
the first ack, and when an adapter turns out to be gone (404), :meth:`RegistryView.refresh` asks
the broker. Everything else in the actor reads it through this object's methods.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from comap_async.wire.messages import WARMUP, Registry

Fetch = Callable[[], Awaitable[dict[str, Any] | Registry | None]]


class RegistryView:
    def __init__(self, registry: Registry | None = None, fetch: Fetch | None = None) -> None:
        self._registry = registry
        self._fetch = fetch
        self.changes = 0

    @property
    def known(self) -> bool:
        """Whether a registry has been heard of (an ack or a fetch)."""
        return self._registry is not None

    def get(self) -> Registry:
        """The current registry (the defaults, i.e. warm-up on the base model, before any is known)."""
        return self._registry if self._registry is not None else Registry()

    def phase(self) -> str:
        return self._registry.phase if self._registry is not None else WARMUP

    def version(self, role: str) -> int:
        return self._registry.versions.get(role, 0) if self._registry is not None else 0

    def adapter(self, role: str) -> str | None:
        """The adapter serving ``role``, or None for the base model."""
        return self._registry.adapters.get(role) if self._registry is not None else None

    def update(self, registry: Registry | dict[str, Any] | None) -> None:
        """Take a registry from an ack or the broker (a map is checked against :class:`Registry`)."""
        if registry is None:
            return
        if not isinstance(registry, Registry):
            registry = msgspec.convert(registry, Registry)
        if registry != self._registry:
            self._registry = registry
            self.changes += 1

    @property
    def can_refresh(self) -> bool:
        return self._fetch is not None

    async def refresh(self) -> Registry:
        """Ask the broker for the current registry (the one known when there is no broker to ask)."""
        if self._fetch is not None:
            self.update(await self._fetch())
        return self.get()
