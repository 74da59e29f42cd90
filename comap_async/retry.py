"""The one retry policy of every client: the inference client, the broker client, the learner's publish.

A :class:`RetryPolicy` says how many attempts in all and how long to wait between them (exponential
from ``backoff_s``, capped at ``backoff_max_s``, with full jitter or none); :func:`retrying` turns it
into a ``tenacity.AsyncRetrying`` and :func:`call` runs a coroutine function under it. Each client
names its own policy as a constant (``INFERENCE_RETRY``, ``BROKER_RETRY``, ``PUBLISH_RETRY``); a test
that needs a short one passes it as an argument. Layers never both retry: a caller that retries around
a client passes the client :data:`NO_RETRY` (one attempt), so the attempts of one operation are
exactly ``attempts``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any, Awaitable, Callable, Literal, TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_base

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How often a client call is tried and how long it waits in between. A caller that wraps a client
    which retries itself passes that client :data:`NO_RETRY`, so attempts never multiply."""

    attempts: int = 6
    """Tries in all, the first one included (1 = no retry); then the last error is raised."""
    backoff_s: float = 0.25
    """Wait before the second try; it doubles before each later try (exponential backoff)."""
    backoff_max_s: float = 8.0
    """Upper bound of one wait."""
    jitter: Literal["full", "none"] = "full"
    """``full``: each wait is drawn uniformly from [0, the exponential wait], so many clients that
    failed together do not retry in lockstep; ``none``: exactly the exponential wait."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1 (got {self.attempts})")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0 (got {self.backoff_s})")
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) must be at least backoff_s ({self.backoff_s})")
        if self.jitter not in ("full", "none"):
            raise ValueError(f"jitter must be 'full' or 'none' (got {self.jitter!r})")


NO_RETRY = RetryPolicy(attempts=1, backoff_s=0.0, backoff_max_s=0.0)
"""One attempt: what a client gets from a caller that runs its own retry policy around it."""


def policy(base: RetryPolicy | None = None, **changes: Any) -> RetryPolicy:
    """``base`` (:class:`RetryPolicy`'s defaults when None) with ``changes`` applied (None: unchanged),
    checked (e.g. ``attempts=1``)."""
    return dataclasses.replace(base or RetryPolicy(), **{k: v for k, v in changes.items() if v is not None})


class Backoff(wait_base):
    """Wait after the ``n``-th failed attempt: ``min(backoff_max_s, backoff_s * 2**(n-1))``, or with
    full jitter a uniform draw from [0, that] (``rng``: a seeded ``random.Random`` for reproducibility)."""

    def __init__(self, cfg: RetryPolicy, rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.rng = rng or random.Random()

    def cap(self, failed: int) -> float:
        return min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2 ** (failed - 1))

    def delay(self, failed: int) -> float:
        cap = self.cap(failed)
        return self.rng.uniform(0.0, cap) if self.cfg.jitter == "full" and cap > 0 else cap

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.delay(retry_state.attempt_number)


async def _sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


def _default_sleep(seconds: float) -> Awaitable[None]:
    return _sleep(seconds)  # looked up per call, so a test can replace ``_sleep``


def retrying(
    cfg: RetryPolicy,
    *,
    retry_on: type[BaseException] | tuple[type[BaseException], ...] = Exception,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[None]] | None = None,
) -> AsyncRetrying:
    """A ``tenacity.AsyncRetrying`` for ``cfg``: at most ``cfg.attempts`` attempts, :class:`Backoff`
    between them, retrying only ``retry_on`` exceptions; after the last attempt its error is re-raised."""
    return AsyncRetrying(
        stop=stop_after_attempt(cfg.attempts),
        wait=Backoff(cfg, rng),
        retry=retry_if_exception_type(retry_on),
        sleep=sleep or _default_sleep,
        reraise=True,
    )


async def call(
    cfg: RetryPolicy,
    fn: Callable[[int], Awaitable[T]],
    *,
    retry_on: type[BaseException] | tuple[type[BaseException], ...] = Exception,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[None]] | None = None,
) -> T:
    """``await fn(attempt)`` (attempt counts from 1) until it returns, under :func:`retrying`.

    The first attempt runs before tenacity is involved, so a call that succeeds at once costs
    nothing extra (the inference client makes several per actor step); a failed first attempt is
    handed to tenacity as its attempt 1, so the count and the waits are the policy's exactly.
    """
    try:
        return await fn(1)
    except retry_on as exc:
        first: BaseException = exc
    async for attempt in retrying(cfg, retry_on=retry_on, rng=rng, sleep=sleep):
        with attempt:
            n = attempt.retry_state.attempt_number
            if n == 1:
                raise first
            return await fn(n)
    raise AssertionError("unreachable: tenacity re-raises the last error")  # pragma: no cover
