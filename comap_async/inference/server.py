"""The embedded inference server as a process: load the model, start the engine, serve the routes of
:mod:`comap_async.inference.openai_api` until SIGTERM."""

from __future__ import annotations

import asyncio
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from aiohttp import web

from comap_async.inference.adapters import SPARE_ADAPTER_SLOTS
from comap_async.inference.engine import Engine
from comap_async.inference.openai_api import ServerState, build_app, prompt_chars_bound
from comap_async.inference.prefill import MIXED_STEP_TOKENS
from comap_async.inference.speculative import FORCED_CHOICE_TOKENS
from comap_async.prompts import ChatTemplate

Forward = Literal["fused", "transformers"]


def build_fused(model: Any, slots: Any, inf: Any, log: Any = None, forward: Forward | None = None) -> Any:
    """The fused forward where it supports the model's architecture (the Llama family: about 3x the
    decode rate of transformers' forward on CPU, docs/benchmarks.md), else None: transformers' forward
    with peft's LoRA layers. ``forward`` decides instead (the tests and benchmarks that compare the two);
    ``fused`` on a model it does not support is a ValueError."""
    from comap_async.inference.fused import FusedLlama, fused_support
    from comap_async.models import inference_dtype

    if forward == "transformers":
        return None
    reason = fused_support(model)
    if reason is not None:
        if forward == "fused":
            raise ValueError(f"the fused forward does not support this model: {reason}")
        if log:
            log.info("serve.forward", forward="transformers", reason=reason)
        return None
    fused = FusedLlama(model, slots.stacks, inference_dtype(inf.dtype), batch_hint=inf.max_batch_size)
    slots.fused_targets = fused.lora_targets
    if log:
        log.info(
            "serve.forward",
            forward="fused",
            dtype=str(fused.dtype).removeprefix("torch."),
            weight_mb=round(fused.weight_bytes / 2**20),
        )
    return fused


def create_state(cfg: Any, log: Any = None, forward: Forward | None = None) -> ServerState:
    """Load the model and start the engine (blocking, seconds); ``forward``: as for :func:`build_fused`."""
    import torch

    from comap_async.inference.adapters import SlotManager
    from comap_async.inference.layout import prepare_for_inference
    from comap_async.inference.slot_registry import AdapterRegistry
    from comap_async.models import load_model_and_tokenizer, resolve_model

    torch.set_num_threads(cfg.model.torch_threads)
    path = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
    model, tok = load_model_and_tokenizer(path, cfg.model.dtype)
    prepare_for_inference(model)
    from peft import LoraConfig

    lr = cfg.learner
    spare = LoraConfig(r=lr.lora_r, lora_alpha=lr.lora_alpha, lora_dropout=0.0, target_modules=lr.target_modules)
    inf = cfg.inference
    slots = SlotManager(model, spare, spares=SPARE_ADAPTER_SLOTS)
    fused = build_fused(model, slots, inf, log, forward)
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 1 << 30
    max_model_len = min(max_pos, inf.max_prompt_tokens + inf.max_new_tokens)
    from comap_async.inference.prefix import PREFIX_CACHE_BLOCK, PrefixCache

    engine = Engine(
        model,
        tok,
        slots,
        max_batch_size=inf.max_batch_size,
        max_model_len=max_model_len,
        seed=cfg.run.seed,
        log=log,
        prefix_cache=(PrefixCache(PREFIX_CACHE_BLOCK, inf.prefix_cache_mb << 20) if inf.prefix_cache_mb else None),
        fused=fused,
        forced_tokens=FORCED_CHOICE_TOKENS,
        priority_hold_s=inf.priority_hold_s,
        mixed_step_tokens=MIXED_STEP_TOKENS,
    )
    engine.start()
    engine.call(slots.fill_spares).result()
    executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="comap-io")
    root = cfg.adapter_root
    root.mkdir(parents=True, exist_ok=True)
    registry = AdapterRegistry(
        engine, slots, root, cfg.model.name_or_path, executor, log, max_loaded=inf.max_loaded_adapters
    )
    return ServerState(
        engine=engine,
        registry=registry,
        tokenizer=tok,
        base_name=cfg.model.name_or_path,
        model_path=str(path),
        max_prompt_tokens=inf.max_prompt_tokens,
        max_new_tokens=inf.max_new_tokens,
        max_model_len=max_model_len,
        executor=executor,
        admin_token=inf.admin_token,
        log=log,
        chat_template=ChatTemplate.from_model_dir(path),
        max_prompt_chars=prompt_chars_bound(tok, inf.max_prompt_tokens),
    )


async def serve(
    cfg: Any,
    log: Any = None,
    initial_adapters: dict[str, str] | None = None,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    forward: Forward | None = None,
) -> None:
    """Run until SIGTERM/SIGINT (or ``stop`` is set); ``forward``: as for :func:`build_fused`."""
    loop = asyncio.get_running_loop()
    state = await loop.run_in_executor(None, create_state, cfg, log, forward)
    for name, p in (initial_adapters or {}).items():
        await state.registry.load(name, p)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its sequences
    runner = web.AppRunner(build_app(state), access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, cfg.inference.host, cfg.inference.port, reuse_address=True)
    await site.start()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (in-process tests): ``stop`` is used
            pass
    if log:
        log.info(
            "serve.ready",
            url=f"http://{cfg.inference.host}:{cfg.inference.port}",
            model=state.base_name,
            adapter_root=str(state.registry.root),
            max_batch_size=state.engine.max_batch_size,
        )
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        if log:
            log.info("serve.stopping")
        await runner.cleanup()
        await loop.run_in_executor(None, state.engine.stop)
        state.executor.shutdown(wait=False)


def run_server(
    cfg: Any, log: Any = None, initial_adapters: dict[str, str] | None = None, forward: Forward | None = None
) -> int:
    asyncio.run(serve(cfg, log, initial_adapters, forward=forward))
    return 0
