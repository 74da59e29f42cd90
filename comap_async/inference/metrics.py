"""Prometheus metrics of the embedded server: its plain in-memory counters (``ServerState.requests``,
``engine.stats``, the adapter registry) turned into ``prometheus_client`` families at scrape time, in a
registry of the server's own (:func:`make_registry`)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from comap_async.httpcommon import exposition, family, scrape_registry

_P = "comap_inference_"


def _line(out: list[Metric], name: str, kind: str, help_: str, samples: list[tuple[dict[str, Any], float]]) -> None:
    out.append(family(kind, _P + name, help_, samples))


def families(state: Any) -> list[Metric]:
    """The server's counters and gauges as metric families, read now."""
    st = state.engine.stats
    reg = state.registry
    out: list[Metric] = []
    _line(
        out,
        "http_requests_total",
        "counter",
        "HTTP requests by route and status.",
        [({"route": r, "status": s}, n) for (r, s), n in sorted(state.requests.items())],
    )
    _line(
        out,
        "http_request_seconds_total",
        "counter",
        "Time spent handling HTTP requests.",
        [({}, state.request_seconds)],
    )
    _line(out, "prompt_tokens_total", "counter", "Prompt tokens prefilled.", [({}, st.prompt_tokens)])
    _line(
        out,
        "prompt_tokens_computed_total",
        "counter",
        "Prompt tokens prefilled by computation (not from the prefix cache), by adapter name without its version.",
        [({"adapter": a}, n) for a, n in sorted(st.computed_by_adapter.items())],
    )
    _line(out, "generation_tokens_total", "counter", "Tokens generated.", [({}, st.generated_tokens)])
    _line(
        out,
        "generation_tokens_by_adapter_total",
        "counter",
        "Tokens generated, by adapter name without its version.",
        [({"adapter": a}, n) for a, n in sorted(st.generated_by_adapter.items())],
    )
    _line(
        out, "sequences_finished_total", "counter", "Sequences finished (stop, length or abort).", [({}, st.finished)]
    )
    _line(out, "sequences_failed_total", "counter", "Sequences failed by an engine error.", [({}, st.failed)])
    _line(out, "sequences_running", "gauge", "Sequences in the decoding batch.", [({}, st.running)])
    _line(out, "sequences_waiting", "gauge", "Sequences queued for the batch.", [({}, st.waiting)])
    _line(out, "decode_steps_total", "counter", "Batched decode steps.", [({}, st.steps)])
    _line(
        out,
        "decode_rows_total",
        "counter",
        "Sum of batch sizes over decode steps (rows/steps = mean batch).",
        [({}, st.batch_rows)],
    )
    _line(out, "decode_seconds_total", "counter", "Time in decode steps.", [({}, st.step_seconds)])
    _line(
        out,
        "attended_columns_total",
        "counter",
        "Rows times KV-cache columns read by decode and verify steps' attention, all and unmasked (real).",
        [({"kind": "all"}, st.attended_columns), ({"kind": "real"}, st.real_columns)],
    )
    _line(
        out,
        "speculative_tokens_total",
        "counter",
        "Tokens proposed by prompt lookup and confirmed by the model (an engine built with speculative_tokens).",
        [({"outcome": "proposed"}, st.proposed_tokens), ({"outcome": "accepted"}, st.accepted_tokens)],
    )
    _line(out, "verify_steps_total", "counter", "Decode steps that checked proposed tokens.", [({}, st.verify_steps)])
    _line(
        out,
        "choice_forced_tokens_total",
        "counter",
        "Tokens a row's choices forced, run in a verify step (up to 4 a step).",
        [({}, st.forced_tokens)],
    )
    _line(
        out,
        "prefill_seconds_total",
        "counter",
        "Time in prompt prefill (a prompt prefilled in a shared forward counts its tokens' share).",
        [({}, st.prefill_seconds)],
    )
    _line(
        out,
        "mixed_prefills_total",
        "counter",
        "Prompts prefilled in a forward shared with a decode step or other prompts.",
        [({}, st.mixed_prefills)],
    )
    _line(
        out,
        "adapter_loads_total",
        "counter",
        "Adapter loads by path (fast = prebuilt spare slot).",
        [({"path": k}, v) for k, v in sorted(reg.loads.items())],
    )
    _line(out, "adapter_load_seconds_total", "counter", "Time spent loading adapters.", [({}, reg.load_seconds)])
    _line(out, "adapters_loaded", "gauge", "Adapter names being served.", [({}, len(reg.bindings))])
    _line(
        out,
        "adapter_slots_retired",
        "gauge",
        "Old adapter versions still finishing requests.",
        [({}, len(reg.retired))],
    )
    peft = reg.slots.peft
    _line(
        out,
        "adapter_slots",
        "gauge",
        "LoRA slots in the model (served, retired and spare).",
        [({}, len(peft.peft_config) if peft is not None else 0)],
    )
    _line(
        out,
        "adapter_spare_slots",
        "gauge",
        "Prebuilt adapter slots ready for a fast load.",
        [({}, len(reg.slots.spares))],
    )
    pc = state.engine.prefix
    if pc is not None:
        _line(
            out,
            "prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens whose KV came from the prefix cache.",
            [({}, pc.hits)],
        )
        _line(out, "prefix_cache_blocks", "gauge", "Cached prompt-prefix blocks.", [({}, len(pc))])
        _line(out, "prefix_cache_bytes", "gauge", "Bytes of the cached prefixes' keys and values.", [({}, pc.bytes)])
        _line(
            out,
            "prefix_cache_evicted_blocks_total",
            "counter",
            "Blocks dropped for the cache's budget (inference.prefix_cache_mb).",
            [({}, pc.evicted)],
        )
    uptime = max(1e-9, time.time() - state.started_at)
    busy = st.step_seconds + st.prefill_seconds
    _line(out, "uptime_seconds", "gauge", "Seconds since the server started.", [({}, round(uptime, 3))])
    _line(
        out,
        "idle_fraction",
        "gauge",
        "Share of the uptime with no prefill or decode running (1 - busy/uptime).",
        [({}, round(max(0.0, 1.0 - busy / uptime), 6))],
    )
    _line(out, "engine_alive", "gauge", "1 while the engine thread runs.", [({}, 1 if state.engine.alive else 0)])
    return out


def make_registry(state: Any) -> CollectorRegistry:
    """A registry of this server instance's own (never the global default) that reads ``state`` per scrape."""
    return scrape_registry(lambda: families(state))


def render(state: Any, registry: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """The ``/metrics`` body and content type, from ``registry`` (a fresh one for ``state`` if not given)."""
    return exposition(registry if registry is not None else make_registry(state))
