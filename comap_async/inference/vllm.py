"""Start vLLM's OpenAI server from the same config as the embedded server (``comap serve --backend vllm``).

The command is ``python -m vllm.entrypoints.openai.api_server`` (not ``vllm serve``: the CPU build
in its own virtualenv may lack a working ``vllm`` console script) with LoRA enabled and runtime
LoRA updating on (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` enables ``/v1/load_lora_adapter``).
The base model is served under ``model.name_or_path`` so clients use the same model names against
both backends, and ``--generation-config vllm`` keeps the request defaults independent of the
model's generation_config.json, as in the embedded server.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

VLLM_PYTHON_ENV = "COMAP_VLLM_PYTHON"
VLLM_CPU_KV_CACHE_GB = 2
"""vLLM on a CPU only (``VLLM_CPU_KVCACHE_SPACE``, ignored by its GPU backend): GiB of KV cache, unless the
environment sets it. Without it vLLM's CPU backend takes ~92% of the host's memory (measured: 22 GB of 24)."""
_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed --max-lora-rank values


MAX_LORAS = 12
"""vLLM's ``--max-loras``, adapters in one batch: a run's 3 roles in 2 versions while actors move to a new
one, plus the evaluator's and one ``comap eval``'s copies (3 each); a request naming a 13th waits."""


def max_lora_rank(r: int) -> int:
    for allowed in _RANKS:
        if r <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {r} exceeds vLLM's largest --max-lora-rank ({_RANKS[-1]})")


def find_vllm_python(explicit: str | None = None) -> str:
    """The interpreter that has vLLM: ``--vllm-python``, ``$COMAP_VLLM_PYTHON``, or this one."""
    candidate = explicit or os.environ.get(VLLM_PYTHON_ENV)
    if candidate:
        path = shutil.which(candidate) or candidate
        if not Path(path).is_file():
            raise FileNotFoundError(f"vLLM python {candidate!r} not found")
        return path
    if importlib.util.find_spec("vllm") is None:
        raise FileNotFoundError(
            "vLLM is not installed in this interpreter: install it (GPU: `pip install vllm`; CPU: see "
            f"docs/inference.md, 'vLLM on this CPU') or point ${VLLM_PYTHON_ENV} / --vllm-python "
            "at the python of its virtualenv"
        )
    return sys.executable


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[int] | None:
    """The GPU ids ``CUDA_VISIBLE_DEVICES`` gives this server (``comap procfile`` sets it per line);
    None where it is unset, empty or not a list of ids (UUIDs): the server's GPUs are then not known."""
    value = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES", "").strip()
    try:
        return [int(x) for x in value.split(",")] if value else None
    except ValueError:
        return None


def build_command(
    cfg: Any,
    model_path: str,
    python: str,
    lora_modules: dict[str, str] | None = None,
    extra: list[str] | None = None,
    gpus: Sequence[int] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment additions) for vLLM's OpenAI server on ``gpus`` (None: not known, any of
    ``inference.gpus``; :func:`visible_gpus`)."""
    inf, lr = cfg.inference, cfg.learner
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--served-model-name",
        cfg.model.name_or_path,
        "--host",
        inf.host,
        "--port",
        str(inf.port),
        "--dtype",
        cfg.model.dtype,
        "--seed",
        str(cfg.run.seed),
        "--max-model-len",
        str(inf.max_prompt_tokens + inf.max_new_tokens),
        "--max-num-seqs",
        str(inf.max_batch_size),
        "--generation-config",
        "vllm",
        "--enable-lora",
        "--max-lora-rank",
        str(max_lora_rank(lr.lora_r)),
        "--max-loras",
        str(MAX_LORAS),
        "--max-cpu-loras",
        str(max(MAX_LORAS, inf.max_loaded_adapters)),
        "--tensor-parallel-size",
        str(inf.tensor_parallel),
    ]
    # a step's draft and reflection share the policy's prompt up to the draft: vLLM reuses that
    # prefix's KV across requests of one adapter (on by default in recent vLLM; said here so the
    # one knob, prefix_cache_mb 0, turns it off on both backends)
    argv.append("--enable-prefix-caching" if inf.prefix_cache_mb > 0 else "--no-enable-prefix-caching")
    if cfg.eval.priority:
        # vLLM refuses a request's priority unless it schedules by priority (the evaluator's calls go first)
        argv += ["--scheduling-policy", "priority"]
    # on a card the learner trains on too, vLLM must not take its default 0.9 of it, whoever started the server
    share = cfg.vllm_memory_share(gpus)
    if share is not None:
        argv += ["--gpu-memory-utilization", str(share)]
    if inf.admin_token:
        # vLLM's key guards every /v1 route, not only the admin ones; the client sends it on all requests
        argv += ["--api-key", inf.admin_token]
    for name, path in (lora_modules or {}).items():
        argv += ["--lora-modules", f"{name}={path}"]
    argv += [*inf.vllm_args, *(extra or [])]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # an explicit environment setting wins
        env["VLLM_CPU_KVCACHE_SPACE"] = str(VLLM_CPU_KV_CACHE_GB)
    return argv, env


def exec_vllm(
    cfg: Any,
    python: str | None = None,
    lora_modules: dict[str, str] | None = None,
    extra: list[str] | None = None,
    log: Any = None,
) -> None:
    """Replace this process with vLLM's server (signals from honcho/systemd then reach vLLM directly)."""
    from comap_async.models import resolve_model

    model_path = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
    argv, env = build_command(cfg, model_path, find_vllm_python(python), lora_modules, extra, visible_gpus())
    if log:
        log.info("serve.vllm", argv=" ".join(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, {**os.environ, **env})
