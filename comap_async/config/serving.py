"""The broker's and the inference servers' sections."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from comap_async.config.base import Section


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
    max_map_size_mb: int = Field(default=65536, ge=1)
    """Upper bound of the LMDB map: it starts at 256 MB (``broker.store.MAP_SIZE_MB``) and doubles when
    full up to this; beyond it the broker refuses writes with a clear error (the actors keep and resend)."""
    max_message_bytes: int = Field(default=1 << 20, ge=1024)
    """Largest accepted frame (ZeroMQ MAXMSGSIZE) and message size."""
    capacity: int = Field(default=200_000, ge=1)
    """Records kept per store (transitions, reflections, demos, episodes, imagined); when a store is full
    the oldest record is evicted first."""
    gate_workers: int = Field(default=1, ge=0, le=16)
    """Processes that decode, validate and gate actor messages while the broker process stores
    and acks (``0``: all in the broker process, one core). Decoding and fact parsing cost more
    than storing; with one worker the broker ingests about twice as fast on two free cores."""
    max_staleness: int = Field(default=4, ge=0)
    """Samples whose policy version is more than this behind the current one are not served."""
    window: int = Field(default=20_000, ge=1)
    """Sampling is uniform over the newest ``window`` items of a store."""


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
    vllm_args: list[str] = Field(default_factory=list)
    """More command-line options for vLLM's server, passed as given (e.g. ``["--enforce-eager"]``)."""
    max_prompt_tokens: int = Field(default=2048, ge=16)
    """Longer prompts are rejected with 400."""
    max_loaded_adapters: int = Field(default=32, ge=1)
    """Embedded server: adapter names loaded at once (a publish keeps 3 roles x 3 versions, the
    evaluator 3 more); a load beyond it is refused with 400 until one is unloaded."""
    prefix_cache_mb: int = Field(default=256, ge=0)
    """Embedded server: memory for the KV of shared prompt prefixes (0 turns the cache off). vLLM:
    0 passes ``--no-enable-prefix-caching``, else ``--enable-prefix-caching`` (its automatic prefix
    caching, sized by its KV cache)."""
    priority_hold_s: float = Field(default=0.0, ge=0)
    """Embedded server: a request waits while one of a lower ``priority`` (the evaluator's, ``eval.priority``)
    is running, for at most this long, instead of joining the batch whenever it has room (0, vLLM's
    priority scheduling). On one CPU core a joining row is not free: its prefill stops every running row,
    and an actor's turns-form conversation re-prefilled after a publish is ~1,400 tokens (~4 s). Held, the
    actors' calls wait out an evaluation (the server's time is the same, the evaluation no longer shares
    it): keep it well under the clients' ``request_timeout_s``."""
    max_new_tokens: int = Field(default=256, ge=1)
    """Upper bound on ``max_tokens`` per request."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Embedded server, fused forward (the one it runs Llama-family models on; any other model runs on
    transformers' forward in ``model.dtype``): weights and KV-cache dtype. ``auto``: bfloat16 where the
    CPU multiplies bf16 in hardware (avx512_bf16/AMX), else float32. The residual stream, norms,
    softmax, LoRA and logits stay float32 either way."""
    request_timeout_s: float = Field(default=120.0, gt=0)
    """Client timeout for one HTTP request."""

    @model_validator(mode="after")
    def _hold_under_timeout(self) -> "InferenceConfig":
        if self.priority_hold_s and self.priority_hold_s >= self.request_timeout_s:
            raise ValueError(
                f"inference.priority_hold_s ({self.priority_hold_s:g}) must be under inference.request_timeout_s "
                f"({self.request_timeout_s:g}): a held request would time out before it is admitted"
            )
        return self
