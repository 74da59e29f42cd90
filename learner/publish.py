"""Publishing adapters: save versioned, load into every inference endpoint, announce, prune.

Order matters (docs/design.md section 6): the broker announces a version only after every endpoint
serves it, so an actor never asks for an adapter that is not loaded; versions older than the
previous one are unloaded last, so requests already in flight on the previous version finish.
Versioned names (``policy-v7``) avoid the stale-cache bugs of reloading under one name.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from comap_async import retry as retry_policy
from comap_async.retry import RetryPolicy
from comap_async.run_files import VERSION_META
from comap_async.wire.messages import ROLES, adapter_name, adapter_version

PUBLISH_BACKOFF = {"backoff_s": 0.5, "backoff_max_s": 5.0, "jitter": "none"}
"""Waits between an endpoint's load attempts when the policy is given as a number of retries."""
PUBLISH_RETRY = RetryPolicy(attempts=6, **PUBLISH_BACKOFF)
"""The learner's policy for one endpoint's adapter load: 6 attempts, waiting 0.5 s doubling up to 5 s."""


def publish_policy(retries: int | RetryPolicy) -> RetryPolicy:
    """The retry policy of one endpoint's adapter load: a :class:`RetryPolicy` as is, or ``retries``
    (retries after the first attempt) with :data:`PUBLISH_BACKOFF`."""
    if isinstance(retries, RetryPolicy):
        return retries
    return retry_policy.policy(None, attempts=int(retries) + 1, **PUBLISH_BACKOFF)


class PublishError(RuntimeError):
    """An endpoint could not load a new adapter version after all retries."""


def save_adapter(model: Any, role: str, out: Path) -> Path:
    """peft's on-disk adapter format (adapter_config.json + adapter_model.safetensors), atomically."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        config = model.peft_config[role]
        config.save_pretrained(str(tmp))
        state = {
            k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(model, adapter_name=role).items()
        }
        save_file(state, str(tmp / "adapter_model.safetensors"))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def save_versioned_adapters(model: Any, root: Path, version: int) -> dict[str, Path]:
    return {role: save_adapter(model, role, root / adapter_name(role, version)) for role in ROLES}


def _version_dirs(root: Path, role: str) -> list[Path]:
    """``role``'s saved versions under ``root``, oldest first."""
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name == adapter_name(role, adapter_version(p.name))]
    return sorted(dirs, key=lambda p: adapter_version(p.name))


def rotate_adapter_dirs(root: Path, keep_dirs: int, keep_steps: Collection[int] = ()) -> None:
    """Delete all but the newest ``keep_dirs`` versions of each role, except those published at one of
    ``keep_steps`` (the pinned checkpoints' steps: a fork from a phase's first version needs its
    checkpoint and its adapters both)."""

    def step_of(path: Path) -> int | None:
        try:
            return int(json.loads((path / VERSION_META).read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    for role in ROLES:
        for old_dir in _version_dirs(root, role)[:-keep_dirs]:
            if step_of(old_dir) not in keep_steps:
                shutil.rmtree(old_dir, ignore_errors=True)


async def load_everywhere(
    client: Any,
    endpoints: list[str],
    name: str,
    path: Path,
    retries: int | RetryPolicy,
    log: Any,
    reload: bool = False,
) -> None:
    """Load one adapter into every endpoint and check that the endpoint lists it; each failure is
    retried and logged, never skipped.

    Never in place: vLLM keeps the in-place flag on the stored adapter and re-reads it from disk at
    every engine step for as long as it stays loaded
    (https://github.com/vllm-project/vllm/issues/33791). A name the endpoint already lists is therefore
    not loaded again where it holds ``path``'s files: on a ``reload`` (a restarted learner loading the
    registry's names, published from these very files) and on a retry (the earlier attempt landed before
    its answer was lost). A new version's name listed before its first
    attempt is a leftover of a publish that was never announced (the learner died between load and
    announce and numbers its next version the same), saved over since: it is unloaded, then loaded.

    The retries are this function's alone (:func:`publish_policy` of ``retries``): the client is
    called with ``retry=NO_RETRY``, so an endpoint sees at most ``attempts`` loads, not that many
    times the client's own retries."""
    policy = publish_policy(retries)
    for endpoint in endpoints:
        current = reload  # whether a listed ``name`` on this endpoint holds ``path``'s files

        async def attempt(n: int, endpoint: str = endpoint) -> None:
            nonlocal current
            try:
                if name in await client.models(endpoint=endpoint):
                    if current:
                        return
                    log.info("publish.stale_adapter", endpoint=endpoint, adapter=name)
                    await client.unload_adapter(name, missing_ok=True, endpoint=endpoint, retry=retry_policy.NO_RETRY)
                current = True  # from here on a listed name is this load's
                await client.load_adapter(
                    name, str(path), load_inplace=False, endpoint=endpoint, retry=retry_policy.NO_RETRY
                )
                # an answered load is not yet a served adapter (a LoRA never delivered looks like staleness:
                # https://github.com/volcengine/verl/issues/7495): the endpoint must list it
                if name not in await client.models(endpoint=endpoint):
                    raise PublishError(f"{endpoint} answered the load of {name} but does not list it")
            except Exception as exc:  # any failure of this endpoint: retry, then fail the publish loudly
                log.warning("publish.load_failed", endpoint=endpoint, adapter=name, attempt=n, error=str(exc))
                raise

        try:
            await retry_policy.call(policy, attempt, retry_on=Exception)
        except Exception as exc:
            raise PublishError(f"{endpoint} could not load {name} after {policy.attempts} attempts: {exc}") from exc


async def unload_everywhere(client: Any, endpoints: list[str], name: str, log: Any) -> None:
    for endpoint in endpoints:
        try:
            await client.unload_adapter(name, missing_ok=True, endpoint=endpoint)
        except Exception as exc:  # unload is cleanup: a failure is reported, the new version is already live
            log.warning("publish.unload_failed", endpoint=endpoint, adapter=name, error=str(exc))


RELISTS = 3
"""How many times :func:`reload_until_listed` loads a version's missing adapters again."""


async def reload_until_listed(
    client: Any, endpoints: list[str], version: int, paths: dict[str, Path], retries: int | RetryPolicy, log: Any
) -> None:
    """Just before the announce, every endpoint lists every role's adapter of ``version``; those it
    does not list are loaded again. An endpoint restarted while the roles were loaded one after the
    other (by its supervisor, after a crash) lost the earlier ones: announced, they would fail every
    actor request naming them. :class:`PublishError` after :data:`RELISTS` rounds."""
    for endpoint in endpoints:
        for _ in range(RELISTS):
            listed = set(await client.models(endpoint=endpoint))
            missing = [role for role in paths if adapter_name(role, version) not in listed]
            if not missing:
                break
            log.warning("publish.relisting", endpoint=endpoint, missing=[adapter_name(r, version) for r in missing])
            for role in missing:
                await load_everywhere(client, [endpoint], adapter_name(role, version), paths[role], retries, log)
        else:
            raise PublishError(f"{endpoint} keeps losing version {version}'s adapters ({RELISTS} reloads)")


async def publish_adapters(
    model: Any,
    version: int,
    phase: str,
    step: int,
    *,
    root: Path,
    inference: Any,
    endpoints: list[str],
    broker: Any,
    log: Any,
    retries: int | RetryPolicy = PUBLISH_RETRY,
    keep_dirs: int = 5,
    metrics: dict[str, float] | None = None,
    ablation: list[str] | None = None,
    keep_steps: Collection[int] = (),
) -> dict[str, Any]:
    """Save, load everywhere, announce, unload old; returns the new registry and timings.
    ``keep_steps``: versions published at these steps outlive the rotation (:func:`rotate_adapter_dirs`).

    Each saved adapter directory gets ``comap.json`` (version, phase, step and the run's
    ``ablation`` list), so a version says what produced it wherever it is copied."""
    t0 = time.perf_counter()
    # absolute: a server resolves a relative lora_path inside its own adapter root
    paths = await asyncio.to_thread(save_versioned_adapters, model, root.resolve(), version)
    meta = {"version": version, "phase": phase, "step": step, "ablation": list(ablation or [])}
    for path in paths.values():
        (path / VERSION_META).write_text(json.dumps(meta) + "\n")
    t_saved = time.perf_counter()
    for role, path in paths.items():
        await load_everywhere(inference, endpoints, adapter_name(role, version), path, retries, log)
    await reload_until_listed(inference, endpoints, version, paths, retries, log)
    t_loaded = time.perf_counter()
    registry = await broker.announce(
        phase=phase,
        versions={role: version for role in ROLES},
        adapters={role: adapter_name(role, version) for role in ROLES},
        step=step,
        metrics=metrics,
    )
    t_live = time.perf_counter()  # loaded on every server and named by the registry: actors switch at their next ack
    # keep the newest three versions live: actors learn of a new version only with their next ack
    for old in range(max(1, version - 6), version - 2):
        for role in ROLES:
            await unload_everywhere(inference, endpoints, adapter_name(role, old), log)
    rotate_adapter_dirs(root, keep_dirs, keep_steps)
    (root / "latest.json").write_text(json.dumps(meta))
    timings = {
        "learner/publish_s": time.perf_counter() - t0,
        "learner/save_s": t_saved - t0,
        "learner/load_s": t_loaded - t_saved,
        "learner/publish_live_ms": 1000 * (t_live - t_saved),
    }
    log.info(
        "publish.done",
        version=version,
        phase=phase,
        step=step,
        **{k.split("/")[1]: round(v, 3) for k, v in timings.items()},
    )
    return {"registry": registry, **timings}
