"""The one retry policy (comap_async/retry.py): attempt counts and waits follow the policy, in the
policy itself, the inference client, the broker client and the learner's publish (no nesting)."""

from __future__ import annotations

import asyncio
import random

import pytest

from comap_async import retry
from comap_async.config import load_config
from comap_async.retry import RetryPolicy
from comap_async.wire.broker_client import BROKER_RETRY, BrokerClient, BrokerError
from comap_async.wire.inference_client import INFERENCE_RETRY, InferenceClient, InferenceError, _Retryable
from comap_async.wire.messages import Reply
from learner.publish import PUBLISH_RETRY, PublishError, load_everywhere


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The backoff waits the policy asks for (not slept)."""
    got: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        got.append(seconds)

    monkeypatch.setattr(retry, "_sleep", fake_sleep)
    return got


class Failing:
    """A coroutine function that fails ``fails`` times (every time when None), counting calls."""

    def __init__(self, fails: int | None = None, exc: type[Exception] = ValueError) -> None:
        self.fails, self.exc, self.calls = fails, exc, []

    async def __call__(self, attempt: int) -> str:
        self.calls.append(attempt)
        if self.fails is None or len(self.calls) <= self.fails:
            raise self.exc(f"failure {len(self.calls)}")
        return "ok"


class Log:
    def __init__(self) -> None:
        self.warnings: list[dict] = []

    def warning(self, event: str, **kw) -> None:
        self.warnings.append({"event": event, **kw})

    info = warning


async def test_attempts_and_waits_follow_the_policy(sleeps):
    cfg = RetryPolicy(attempts=5, backoff_s=0.1, backoff_max_s=0.3, jitter="none")
    fn = Failing()
    with pytest.raises(ValueError, match="failure 5"):  # the last error, after exactly `attempts` tries
        await retry.call(cfg, fn, retry_on=ValueError)
    assert fn.calls == [1, 2, 3, 4, 5]
    assert sleeps == pytest.approx([0.1, 0.2, 0.3, 0.3])  # exponential, capped, one wait between tries


async def test_full_jitter_draws_below_the_exponential_wait(sleeps):
    cfg = RetryPolicy(attempts=6, backoff_s=0.25, backoff_max_s=1.0, jitter="full")
    with pytest.raises(ValueError):
        await retry.call(cfg, Failing(), retry_on=ValueError, rng=random.Random(7))
    caps = [0.25, 0.5, 1.0, 1.0, 1.0]
    rng = random.Random(7)
    assert sleeps == pytest.approx([rng.uniform(0, c) for c in caps])
    assert all(0 <= s <= c for s, c in zip(sleeps, caps))


async def test_success_stops_and_other_errors_are_not_retried(sleeps):
    cfg = RetryPolicy(attempts=4, backoff_s=0.01, backoff_max_s=0.01)
    ok = Failing(fails=2)
    assert await retry.call(cfg, ok, retry_on=ValueError) == "ok" and ok.calls == [1, 2, 3] and len(sleeps) == 2
    other = Failing(exc=KeyError)
    with pytest.raises(KeyError):
        await retry.call(cfg, other, retry_on=ValueError)
    assert other.calls == [1]
    once = Failing()
    with pytest.raises(ValueError):
        await retry.call(retry.NO_RETRY, once, retry_on=ValueError)
    assert once.calls == [1]


def test_each_client_has_its_policy_and_a_caller_may_pass_another():
    assert INFERENCE_RETRY == RetryPolicy(attempts=6, backoff_s=0.25, backoff_max_s=8.0, jitter="full")
    assert BROKER_RETRY.attempts == 3 and PUBLISH_RETRY.attempts == 6
    cfg = load_config(None)
    assert InferenceClient.from_config(cfg).retry == INFERENCE_RETRY
    assert InferenceClient.from_config(cfg, retries=0).retry.attempts == 1  # eval_runner's probe clients
    assert BrokerClient.from_config(cfg).retry == BROKER_RETRY
    with pytest.raises(ValueError, match="backoff_max_s"):
        RetryPolicy(backoff_s=2, backoff_max_s=1)
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)


def _failing_client(monkeypatch, client: InferenceClient, ok_after: dict[str, int] | None = None) -> dict[str, int]:
    """Replace the one HTTP exchange: per endpoint, fail (retryably) until ``ok_after[ep]`` calls."""
    calls: dict[str, int] = {}

    loaded: dict[str, list[str]] = {}  # per endpoint: each server lists what it loaded itself

    async def once(ep, method, path, body):
        if path == "/v1/models":  # a publish checks that the endpoint lists what it loaded
            import json

            return 200, json.dumps({"object": "list", "data": [{"id": name} for name in loaded.get(ep, [])]})
        calls[ep] = calls.get(ep, 0) + 1
        if calls[ep] > (ok_after or {}).get(ep, 1 << 30):
            if isinstance(body, dict) and "lora_name" in body:
                loaded.setdefault(ep, []).append(body["lora_name"])
            return 200, "Success"
        raise _Retryable(f"ConnectionRefusedError: scripted {calls[ep]}")

    monkeypatch.setattr(client, "_once", once)
    return calls


async def test_inference_client_attempts_equal_the_policy(monkeypatch, sleeps):
    cfg = RetryPolicy(attempts=4, backoff_s=0.1, backoff_max_s=0.25, jitter="none")
    client = InferenceClient(["http://a", "http://b"], retry=cfg, seed=0)
    calls = _failing_client(monkeypatch, client)
    with pytest.raises(InferenceError) as err:
        await client.complete("x")
    assert sum(calls.values()) == 4 and err.value.attempts == 4 and "failed after 4 attempts" in str(err.value)
    assert set(calls) == {"http://a", "http://b"}  # failed over to the other endpoint
    assert sleeps == pytest.approx([0.1, 0.2, 0.25])
    sleeps.clear()
    calls.clear()
    with pytest.raises(InferenceError, match="after 1 attempts"):  # a per-call policy replaces the client's
        await client.load_adapter("p", "/x", endpoint="http://a", retry=retry.NO_RETRY)
    assert calls == {"http://a": 1} and sleeps == []
    await client.close()


async def test_legacy_keywords_override_the_policy(monkeypatch, sleeps):
    client = InferenceClient("http://a", retries=2, backoff_s=0.01, backoff_max_s=0.02)
    assert client.retry.attempts == 3 and client.retries == 2 and client.retry.jitter == "full"
    calls = _failing_client(monkeypatch, client)
    with pytest.raises(InferenceError, match="after 3 attempts"):
        await client.complete("x")
    assert calls == {"http://a": 3} and len(sleeps) == 2 and all(0 <= s <= 0.02 for s in sleeps)
    await client.close()


async def test_broker_client_attempts_equal_the_policy(sleeps):
    cfg = RetryPolicy(attempts=3, backoff_s=0.05, backoff_max_s=0.05, jitter="none")
    client = BrokerClient("tcp://127.0.0.1:9", timeout_s=0.02, retry=cfg)
    sent: list[bytes] = []

    async def never_answered(data, fut):
        sent.append(data)
        await asyncio.Event().wait()

    client._send_and_wait = never_answered
    try:
        with pytest.raises(BrokerError, match="no reply from the broker") as err:
            await client.get_stats()
    finally:
        await client.close()
    assert len(sent) == 3 and "attempt 3 of 3" in str(err.value)
    assert sleeps == pytest.approx([0.05, 0.05])
    assert BrokerClient("tcp://127.0.0.1:9", retries=0).retry.attempts == 1


async def test_broker_refusal_is_not_retried(sleeps):
    client = BrokerClient("tcp://127.0.0.1:9", timeout_s=1.0)
    sent: list[bytes] = []

    async def refused(data, fut):
        sent.append(data)
        return Reply(req=1, ok=False, error="n must be >= 1", data={})

    client._send_and_wait = refused
    try:
        with pytest.raises(BrokerError, match="broker refused sample: n must be"):
            await client.sample("transitions", 0)
    finally:
        await client.close()
    assert len(sent) == 1 and sleeps == []


async def test_load_everywhere_does_not_nest_retries(monkeypatch, sleeps, tmp_path):
    """The client would retry 6 times by default; under load_everywhere each endpoint sees exactly
    the publish policy's attempts (it used to be up to 6 x (retries + 1))."""
    client = InferenceClient(["http://a", "http://b"])
    assert client.retry.attempts == 6
    calls = _failing_client(monkeypatch, client, ok_after={"http://a": 2})  # a: fails twice, then loads
    log = Log()
    policy = RetryPolicy(attempts=3, backoff_s=0.5, backoff_max_s=0.75, jitter="none")
    with pytest.raises(PublishError, match="http://b could not load policy-v1 after 3 attempts"):
        await load_everywhere(client, ["http://a", "http://b"], "policy-v1", tmp_path, policy, log)
    assert calls == {"http://a": 3, "http://b": 3}
    assert sleeps == pytest.approx([0.5, 0.75, 0.5, 0.75])  # per endpoint: one wait between its tries
    assert [(w["endpoint"], w["attempt"]) for w in log.warnings] == [
        ("http://a", 1),
        ("http://a", 2),
        ("http://b", 1),
        ("http://b", 2),
        ("http://b", 3),
    ]
    await client.close()


async def test_load_everywhere_with_a_retry_count(monkeypatch, sleeps, tmp_path):
    """``retries`` as a number: that many retries per endpoint, with the publish backoff (0.5 s doubling,
    at most 5 s, no jitter, as :data:`PUBLISH_RETRY`)."""
    client = InferenceClient(["http://a"])
    calls = _failing_client(monkeypatch, client)
    with pytest.raises(PublishError, match="after 5 attempts"):
        await load_everywhere(client, ["http://a"], "wm-v2", tmp_path, 4, Log())
    assert calls == {"http://a": 5} and sleeps == pytest.approx([0.5, 1.0, 2.0, 4.0])
    await client.close()


def test_a_process_still_starting_is_a_wait_not_a_failure():
    from comap_async.waiting import waiting_reason

    refused = RuntimeError(
        "GET /v1/models failed after 6 attempts: http://127.0.0.1:8000: ConnectionError: cannot "
        "connect to 127.0.0.1:8000: [Errno 111] Connection refused"
    )
    assert waiting_reason(refused) == "not accepting connections yet (still starting?)"
    assert waiting_reason(ConnectionRefusedError()) == "not accepting connections yet (still starting?)"
    assert waiting_reason(RuntimeError("HTTP 500: boom")) == "HTTP 500: boom"  # anything else is quoted


def test_library_deprecation_warnings_are_filtered(capsys):
    import warnings

    from comap_async.logsetup import configure_logging

    configure_logging("test", json=True)
    warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning)
    assert "is_gradient_checkpointing" not in capsys.readouterr().err
