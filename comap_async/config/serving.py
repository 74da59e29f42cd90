"""The broker's and the inference servers' sections."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from comap_async.config.base import RequestPriority, RetryConfig, Section


class BrokerConfig(Section):
    host: str = "127.0.0.1"
    """Address the broker binds to (and actors/learners connect to). Non-loopback needs CURVE."""
    actor_port: int = Field(default=5555, ge=1, le=65535)
    """ZeroMQ ROUTER port for actors (Transition/Episode in, Ack out)."""
    learner_port: int = Field(default=5556, ge=1, le=65535)
    """ZeroMQ ROUTER port for learners (sample, announce, stats)."""
    http_port: int = Field(default=8770, ge=1, le=65535)
    """aiohttp port for /healthz, /stats, /metrics."""
    http_token: str | None = None
    """Bearer token required by /stats and /metrics when set (required off loopback)."""
    curve: bool = False
    """Enable ZeroMQ CURVE authentication (forced on when ``host`` is not loopback)."""
    keys_dir: str = "~/.config/comap-async/keys"
    """Where ``comap keys`` writes and the processes read CURVE key pairs."""
    map_size_mb: int = Field(default=256, ge=1)
    """Initial LMDB map size; grown automatically when full."""
    max_map_size_mb: int = Field(default=65536, ge=1)
    """Upper bound for LMDB map growth; beyond it the broker refuses writes with a clear error."""
    max_message_bytes: int = Field(default=1 << 20, ge=1024)
    """Largest accepted frame (ZeroMQ MAXMSGSIZE) and message size."""
    capacity_transitions: int = Field(default=200_000, ge=1)
    """Ring capacity of the world-model transition store."""
    capacity_reflections: int = Field(default=200_000, ge=1)
    """Ring capacity of the policy reflection-sample store."""
    capacity_demos: int = Field(default=100_000, ge=1)
    """Ring capacity of the expert demonstration store."""
    capacity_episodes: int = Field(default=100_000, ge=1)
    """Ring capacity of the episode store."""
    capacity_imagined: int = Field(default=100_000, ge=1)
    """Ring capacity of the imagined-episode store (``actor.imagined_rollouts``)."""
    ack_queue_max: int = Field(default=50_000, ge=100)
    """Replies queued for one peer (ZeroMQ's send high-water mark per connection). A peer that sends
    without reading its acks cannot grow the broker past it: further replies to it are dropped and
    counted (``peer_ack_dropped``). Nothing acknowledged is lost that way: an actor's outbox resends
    what was not acked and the broker, which stores each id once, acks it again."""
    group_commit: int = Field(default=256, ge=1)
    """Most messages stored per LMDB transaction (acks go out after its commit)."""
    gate_workers: int = Field(default=1, ge=0, le=16)
    """Processes that decode, validate and gate actor messages while the broker process stores
    and acks (``0``: all in the broker process, one core). Decoding and fact parsing cost more
    than storing; with one worker the broker ingests about twice as fast on two free cores."""
    drain_s: float = Field(default=2.0, ge=0.0, le=30.0)
    """On SIGTERM, keep storing and acking actor messages for at most this long, so actors stopping
    at the same moment (``honcho`` signals every process at once) flush their outboxes."""
    drain_quiet_s: float = Field(default=0.5, gt=0.0)
    """The drain ends early once no actor message has arrived for this long."""
    max_staleness: int = Field(default=4, ge=0)
    """Samples whose policy version is more than this behind the current one are not served."""
    window: int = Field(default=20_000, ge=1)
    """Sampling is uniform over the newest ``window`` items of a store."""
    client_retry: RetryConfig = Field(default_factory=lambda: RetryConfig(attempts=3, backoff_s=0.0, backoff_max_s=0.0))
    """Retry policy of the learner-side broker client (``BrokerClient``): a request without a reply
    within its timeout is sent again, up to ``attempts`` tries in all (every request is idempotent)."""


SHARED_GPU_MEMORY = 0.45
"""vLLM's memory share on a GPU the learner also trains on (the rest: the learner's weights,
activations and optimizer state)."""


class InferenceConfig(Section):
    backend: Literal["embedded", "vllm"] = "embedded"
    """``embedded`` (aiohttp + transformers + peft, CPU default) or ``vllm`` (GPU)."""
    host: str = "127.0.0.1"
    """Address ``comap serve`` binds to."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Port ``comap serve`` listens on."""
    endpoints: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """Base URLs of all inference servers (actors spread load; the learner publishes to each)."""
    admin_token: str | None = None
    """Bearer token for the adapter load/unload endpoints (required off loopback)."""
    adapter_root: str | None = None
    """Directory adapters may be loaded from; ``None`` = ``<run dir>/adapters``."""
    max_batch_size: int = Field(default=8, ge=1)
    """Most concurrent requests decoded together (vLLM: ``--max-num-seqs``; a GPU wants hundreds)."""
    gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """GPU ids that serve inference (``comap procfile``): one vLLM server per ``tensor_parallel`` of
    them, on consecutive ports from ``port``, all listed in ``inference.endpoints``. Empty: the one
    server this config describes (the CPU default)."""
    tensor_parallel: int = Field(default=1, ge=1)
    """GPUs per vLLM server (``--tensor-parallel-size``): more than 1 when the model does not fit one."""
    gpu_memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0)
    """vLLM's ``--gpu-memory-utilization``; None: vLLM's own (0.9) on a card of its own, 0.45 on one
    that ``learner.gpus`` also lists (:meth:`comap_async.config.CoMapConfig.vllm_memory_share`, for
    ``comap serve --backend vllm`` however it is started)."""
    max_loras: int = Field(default=12, ge=1)
    """vLLM's ``--max-loras``, adapters in one batch: 3 roles x 2 versions while actors move to a new
    one, plus the evaluator's and one ``comap eval``'s copies (3 each). Requests naming a 13th wait."""
    vllm_args: list[str] = Field(default_factory=list)
    """More command-line options for vLLM's server, passed as given (e.g. ``["--enforce-eager"]``)."""
    batch_wait_ms: float = Field(default=5.0, ge=0.0)
    """How long the batcher waits for more requests before starting a batch."""
    max_prompt_tokens: int = Field(default=2048, ge=16)
    """Longer prompts are rejected with 400."""
    spare_adapter_slots: int = Field(default=7, ge=0, le=64)
    """Embedded server: LoRA slots built ahead with the learner's adapter shape, so loading a
    published adapter only copies tensors (~10-50 ms); each costs one adapter's memory (~20 MB for
    SmolLM2 r=8). The default covers a publish (policy, wm, wm_teacher) and the evaluator's copies
    of the same version, which it loads a few seconds later, plus one: with 4, the evaluator's third
    load took the slow path (2.3 s) while the spares were being rebuilt. The versions a publish
    replaces return to the pool when the learner unloads them."""
    max_loaded_adapters: int = Field(default=32, ge=1)
    """Embedded server: adapter names loaded at once (a publish keeps 3 roles x 3 versions, the
    evaluator 3 more); a load beyond it is refused with 400 until one is unloaded."""
    prefix_cache_mb: int = Field(default=256, ge=0)
    """Embedded server: memory for the KV of shared prompt prefixes (0 turns the cache off). vLLM:
    0 passes ``--no-enable-prefix-caching``, else ``--enable-prefix-caching`` (its automatic prefix
    caching, sized by its KV cache)."""
    prefix_cache_block: int = Field(default=8, ge=1, le=512)
    """Embedded server: tokens per prefix-cache block. A prompt reuses whole blocks only, so it recomputes
    half a block of its known prefix on average: with 8, a co-evolution step computed 23 % fewer prompt tokens
    than with 32 (the earlier size; docs/inference.md), for a lookup that copies four times as many
    blocks."""
    priority_hold_s: float = Field(default=0.0, ge=0)
    """Embedded server: a request waits while one of a lower ``priority`` (the evaluator's, ``eval.priority``)
    is running, for at most this long, instead of joining the batch whenever it has room (0, vLLM's
    priority scheduling). On one CPU core a joining row is not free: its prefill stops every running row,
    and an actor's turns-form conversation re-prefilled after a publish is ~1,400 tokens (~4 s). Held, the
    actors' calls wait out an evaluation (the server's time is the same, the evaluation no longer shares
    it): keep it well under the clients' ``request_timeout_s``."""
    speculative_tokens: int = Field(default=0, ge=0, le=32)
    """Prompt-lookup speculative decoding: up to this many tokens proposed per row and decode step
    from where the row's last tokens occurred before in its prompt or output, checked in one forward
    pass; the output is the one decoding token by token gives (``comap_async/inference/speculative.py``).
    The roles copy much of their prompts (the teacher the real observation, a reflection the draft).
    0: off. vLLM: its ``ngram`` method (``--speculative-config``) with the same count."""
    max_new_tokens: int = Field(default=256, ge=1)
    """Upper bound on ``max_tokens`` per request."""
    forward: Literal["fused", "transformers"] = "fused"
    """Embedded server: ``fused`` (a forward written for Llama-family decoders: fused and prepacked
    weights in ``inference.dtype``, LoRA over the batch's adapters in two small GEMMs per projection,
    about 3x the decode rate on CPU) or ``transformers`` (transformers' forward with peft's LoRA
    layers in ``model.dtype``: the reference path). Models the fused forward does not know fall
    back to ``transformers`` with a warning."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Embedded server, fused forward: weights and KV-cache dtype. ``auto``: bfloat16 where the
    CPU multiplies bf16 in hardware (avx512_bf16/AMX), else float32. The residual stream, norms,
    softmax, LoRA and logits stay float32 either way."""
    request_timeout_s: float = Field(default=120.0, gt=0)
    """Client timeout for one HTTP request."""
    request_priority: RequestPriority = 0
    """Client: the ``priority`` this process's completion requests carry (lower is admitted first;
    0 is sent as no field). The evaluator sets its own from ``eval.priority``."""
    retry: RetryConfig = Field(default_factory=RetryConfig)
    """Retry policy of the inference client on connection errors, timeouts, 429 and 5xx (on another
    endpoint when there is one), before a clear error. ``inference.retries: N`` (the former field,
    still accepted) means ``retry.attempts: N + 1``."""
    vllm_cpu_kv_cache_gb: int = Field(default=2, ge=1)
    """vLLM on a CPU only (``VLLM_CPU_KVCACHE_SPACE``, ignored by its GPU backend): GiB of KV cache.
    Without it vLLM's CPU backend takes ~92% of the host's memory (measured: 22 GB of 24)."""

    @model_validator(mode="before")
    @classmethod
    def _former_retries(cls, data: Any) -> Any:
        """``inference.retries`` (retries after the first try) keeps working as ``retry.attempts - 1``."""
        if not isinstance(data, dict) or "retries" not in data:
            return data
        data = dict(data)
        retries = data.pop("retries")
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ValueError(
                f"inference.retries must be an integer >= 0 (got {retries!r}); "
                "it is the former name of inference.retry.attempts - 1"
            )
        retry = data.get("retry")
        retry = dict(retry) if isinstance(retry, dict) else ({} if retry is None else retry)
        if isinstance(retry, dict):
            if "attempts" in retry:
                raise ValueError("inference.retries is the former name of inference.retry.attempts - 1: set only one")
            retry["attempts"] = retries + 1
        data["retry"] = retry
        return data

    @model_validator(mode="after")
    def _hold_under_timeout(self) -> "InferenceConfig":
        if self.priority_hold_s and self.priority_hold_s >= self.request_timeout_s:
            raise ValueError(
                f"inference.priority_hold_s ({self.priority_hold_s:g}) must be under inference.request_timeout_s "
                f"({self.request_timeout_s:g}): a held request would time out before it is admitted"
            )
        return self

    @property
    def retries(self) -> int:
        """Retries after the first try (``retry.attempts - 1``), for readers of the former field."""
        return self.retry.attempts - 1
