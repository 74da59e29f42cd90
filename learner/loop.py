"""The learner process: fetch batches, learn, publish, checkpoint; phases warmup -> reflect_init -> coevolve.

Act / learn / get-batch are kept apart: a :class:`learner.prefetch.Prefetcher` task keeps micro-batches queued
from the broker while the learn step runs in a worker thread, so the model waits on the network
only when there is no data (and says so). Each micro-batch carries the phase it was fetched for;
one left in the queue when the phase changes is dropped (``learner/phase_dropped``), never
trained under the next phase. Everything needed to continue — adapters, optimizer,
schedule, RNG, phase, adapter version — is in the checkpoint; a restarted learner resumes there.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comap_async.config import CoMapConfig
from comap_async.heap import resident_gb
from comap_async.method.fingerprint import check_method
from comap_async.method.phases import coevolve_shares, first_phase, phase_spec
from comap_async.method.routing import world_model_frozen
from comap_async.run_files import append_run_config, write_run_ablation
from comap_async.waiting import cancel_and_wait, until_stopped, wait_until_answers
from comap_async.wire.messages import COEVOLVE, REFLECT_INIT, WARMUP
from learner.phases import PhaseControl
from learner.prefetch import AHEAD, Prefetcher
from learner.step_thread import step_or_stop
from learner.threads import QuietWatch

LIVE_CHECK_S = 5.0
"""How often the learner checks that every endpoint still serves the registry's adapters."""


@dataclass
class LearnerState:
    phase: str = WARMUP
    version: int = 0
    phase_start: int = 0
    round_episodes: int = 0  # episodes written when the current round started (rounds schedule)
    phase_budget: int | None = None  # the phase's step budget when sized by data (its spec's epochs)
    phase_seconds: float = 0.0  # training time spent in the phase (its spec's max_minutes)
    tokens_total: int = 0  # tokens trained since the run began: wall-clock throughput (async vs rounds)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


async def wait_for_servers(inference: Any, endpoints: list[str], log: Any, stop: asyncio.Event) -> bool:
    """Wait until every inference endpoint answers its health check; False when ``stop`` came first."""
    for url in endpoints:
        answered = await wait_until_answers(
            f"inference {url}", lambda u=url: inference.health(endpoint=u), log, stop, "learner.waiting"
        )
        if answered is None:
            return False
    return True


def shares_gpu_with_inference(cfg: CoMapConfig) -> list[int]:
    """The GPUs the learner (on CUDA) would share with an inference server (``learner.gpus`` in
    ``inference.gpus``)."""
    return cfg.shared_gpus() if cfg.learner.device.startswith("cuda") else []


async def wait_before_loading(cfg: CoMapConfig, log: Any) -> bool:
    """On a card an inference server shares, wait for every server's health before the learner puts
    its weights there: vLLM sizes its KV cache at start from the memory it sees in use (its profile
    run), and a learner's weights loaded meanwhile are counted as vLLM's own, leaving its cache about
    nothing (the 8B config). Healthy, a server has finished that. False when stopped while waiting."""
    from comap_async.wire.inference_client import InferenceClient

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    inference = InferenceClient.from_config(cfg)
    try:
        log.info("learner.waiting_for_shared_gpu", gpus=shares_gpu_with_inference(cfg))
        return await wait_for_servers(inference, list(cfg.inference.endpoints), log, stop)
    finally:
        await inference.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


class Learner(PhaseControl):
    def __init__(self, cfg: CoMapConfig, log: Any) -> None:
        import torch

        from comap_async.models import load_model_and_tokenizer, resolve_model
        from comap_async.prompts import Prompts
        from learner.batches import Encoder
        from learner.distributed import DataParallel
        from learner.paw import paw_entropy
        from learner.peft_model import build_peft_model
        from learner.trainer import Trainer

        self.cfg, self.log = cfg, log
        lc = cfg.learner
        torch.set_num_threads(cfg.model.torch_threads)
        torch.manual_seed(cfg.run.seed)
        # under torchrun: one rank of data-parallel training (before the model: it picks the GPU)
        self.dp = DataParallel.from_env(lc.device)
        self.leader = self.dp is None or self.dp.leader
        # a rank's card by its index (cuda:1), never the thread-dependent current device a bare "cuda" means
        device = self.dp.device if self.dp is not None else lc.device
        path = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
        base, tok = load_model_and_tokenizer(path, cfg.model.dtype, device)
        model = build_peft_model(
            base, lc.lora_r, lc.lora_alpha, lc.lora_dropout, lc.target_modules, lc.gradient_checkpointing
        )
        prompts = Prompts.for_model(path, cfg)
        encoder = Encoder.for_learner(tok, prompts, lc)
        self.trainer = Trainer(model, encoder, lc, device, method=cfg.method)
        self.trainer.paw_entropy = paw_entropy(cfg)
        self.trainer.ablation = cfg.method.ablation
        if self.dp is not None:
            from comap_async.wire.messages import ROLES
            from learner.peft_model import adapter_parameters

            self.trainer.data_parallel = self.dp
            self.dp.sync_parameters([p for role in ROLES for _, p in adapter_parameters(model, role)])
            self.log = log.bind(rank=self.dp.rank)
        first = first_phase(cfg)
        self.state = LearnerState(phase=first)
        self.trainer.scheduler.enter(self.state.phase, self.state.phase_start, self.state.phase_budget)
        self.run_dir = cfg.run.dir
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.adapter_root = cfg.adapter_root
        self.writer = None
        self.stop = asyncio.Event()
        self.actors_quiet = QuietWatch()  # a phase's own threads: the actors idle (learner/threads.py)
        self.history: list[dict[str, Any]] = []  # per-step metrics and ``phase`` of this process (tests, eval)
        self.step_thread: threading.Thread | None = None
        self.live: dict[str, Any] = {}  # the registry last announced or read: what actors ask the servers for
        self._publishing = asyncio.Lock()  # a publish's loads and unloads never interleave with a reload

    # ------------------------------------------------------------------ persistence
    def resume(self) -> bool:
        from learner.checkpoint import latest, load_checkpoint

        path = latest(self.ckpt_dir)
        if path is None:
            return False
        extra = load_checkpoint(path, self.trainer)
        self.state = LearnerState(**extra["state"])
        self.trainer.scheduler.enter(self.state.phase, self.state.phase_start, self.state.phase_budget)
        self.log.info("learner.resumed", checkpoint=str(path), step=self.trainer.step, **self.state.as_dict())
        return True

    def checkpoint(self, pin: bool = False) -> None:
        from learner.checkpoint import save_checkpoint

        if not self.leader:  # every rank holds the same weights: rank 0 writes them
            return
        path = save_checkpoint(self.ckpt_dir, self.trainer, {"state": self.state.as_dict()}, pin=pin)
        self.log.info("learner.checkpoint", path=str(path), step=self.trainer.step)

    def scalars(self, metrics: dict[str, float]) -> None:
        if not self.leader:
            return
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, self.trainer.step)

    async def publish(self, inference: Any, broker: Any, metrics: dict[str, float] | None = None) -> dict[str, Any]:
        from learner.checkpoint import pinned_steps
        from learner.publish import publish_adapters

        self.state.version += 1
        if not self.leader:  # rank 0 publishes the weights every rank holds
            return {}
        async with self._publishing:
            finished, result = await until_stopped(
                publish_adapters(
                    self.trainer.model,
                    self.state.version,
                    self.state.phase,
                    self.trainer.step,
                    root=self.adapter_root,
                    inference=inference,
                    endpoints=list(self.cfg.inference.endpoints),
                    broker=broker,
                    log=self.log,
                    metrics=metrics,
                    keep_steps=pinned_steps(self.ckpt_dir),
                    ablation=self.cfg.method.ablation,
                ),
                self.stop,
            )
            if finished:
                self.live = result.get("registry") or self.live
        if not finished:
            # shutting down (the servers may already be gone): an unannounced version is never used,
            # and the next start reloads whatever the registry names
            self.log.info("learner.publish_abandoned", version=self.state.version)
            return {}
        check_method(self.cfg, (result.get("registry") or {}).get("method"), "the broker")  # it may have restarted
        return {k: v for k, v in result.items() if k.startswith("learner/")}

    async def reload_live_adapters(self, inference: Any, registry: dict[str, Any]) -> None:
        """Load the registry's adapters from the adapter root into every endpoint.

        After a restart of the inference servers, actors must find exactly the versions the
        registry names; the files are the published ones, so nothing changes for them. A server
        that kept running already lists them and is left as it is.
        """
        from learner.publish import PUBLISH_RETRY, load_everywhere

        for role, name in (registry.get("adapters") or {}).items():
            path = self.adapter_root / name
            if not path.is_dir():
                self.log.warning("learner.live_adapter_missing", role=role, adapter=name, path=str(path))
                continue
            await load_everywhere(
                inference,
                list(self.cfg.inference.endpoints),
                name,
                path,
                PUBLISH_RETRY,
                self.log,
                reload=True,
            )
        self.log.info("learner.live_adapters_reloaded", adapters=registry.get("adapters"))

    async def keep_live_adapters_served(self, inference: Any) -> None:
        """Every :data:`LIVE_CHECK_S`, reload the live adapters into an endpoint that no longer lists
        them. A server restarted on its own (by a supervisor, after an OOM kill) comes back serving
        none, and every actor request naming them fails (404) until the next publish, minutes away on
        a GPU host; a restarted learner reloads them at its start, this covers the server alone."""
        while not self.stop.is_set():
            await asyncio.sleep(LIVE_CHECK_S)
            names = set((self.live.get("adapters") or {}).values())
            for endpoint in self.cfg.inference.endpoints if names else ():
                try:
                    if names <= set(await inference.models(endpoint=endpoint)):
                        continue
                    async with self._publishing:  # the registry read under the lock is the one published last
                        self.log.info("learner.live_adapters_missing", endpoint=endpoint)
                        await self.reload_live_adapters(inference, self.live)
                    break  # the reload went to every endpoint
                except Exception as exc:  # noqa: BLE001 - a server still down is tried again next round
                    self.log.info("learner.live_adapters_unchecked", endpoint=endpoint, error=str(exc)[:200])

    async def run(self, max_steps: int | None = None) -> int:
        from comap_async.wire.broker_client import BrokerClient
        from comap_async.wire.inference_client import InferenceClient

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        resumed = self.resume()
        lc = self.cfg.learner
        # what this run is: CoMap itself ([]) or the ablations switched on (comap compare reads it)
        if self.leader:
            write_run_ablation(self.run_dir, self.cfg.method.ablation, self.cfg.method_switches)
            append_run_config(self.run_dir, self.cfg.model_dump(mode="json"), self.trainer.step, self.state.phase)
        if self.cfg.method.ablation:
            self.log.info("learner.ablation", active=self.cfg.method.ablation)
        async with BrokerClient.from_config(self.cfg) as broker:
            inference = InferenceClient.from_config(self.cfg)
            watcher: asyncio.Task | None = None
            try:
                registry = await wait_until_answers(
                    "broker", broker.get_registry, self.log, self.stop, "learner.waiting"
                )
                if registry is None:
                    return 0
                check_method(self.cfg, registry.get("method"), "the broker")
                await wait_for_servers(inference, self.cfg.inference.endpoints, self.log, self.stop)
                live = int((registry.get("versions") or {}).get("policy", 0))
                if live > 0 and self.leader:
                    await self.reload_live_adapters(inference, registry)
                # new versions are numbered above anything announced, even after an older checkpoint
                self.state.version = max(self.state.version, live)
                self.live = registry
                if self.leader:  # rank 0 publishes, so it keeps what it published served
                    watcher = asyncio.create_task(self.keep_live_adapters_served(inference))
                if not resumed and registry.get("phase") != self.state.phase and self.leader:
                    await broker.announce(
                        self.state.phase,
                        registry.get("versions", {}),
                        registry.get("adapters", {}),
                        0,
                    )
                if self.state.phase == WARMUP:
                    await self.wait_for_demos(broker)
                shares = dict(coevolve_shares(self.cfg))  # only co-evolution mixes stores
                rank = self.dp.rank if self.dp is not None else 0  # each rank samples its own micro-batches
                prefetch = Prefetcher(
                    broker,
                    self.state,
                    lc.batch_size,
                    AHEAD,
                    self.cfg.run.seed + 7919 * rank,
                    self.log,
                    shares,
                    self.cfg.method.ablation,
                    {REFLECT_INIT: {"reflections": phase_spec(lc, REFLECT_INIT).batch_size}},
                )
                task = asyncio.create_task(prefetch.run())
                try:
                    await self._train(prefetch, task, inference, broker, max_steps)
                finally:
                    await cancel_and_wait([task])
                    self.checkpoint()
            finally:
                if watcher is not None:
                    await cancel_and_wait([watcher])
                await inference.close()
                if self.writer is not None:
                    self.writer.close()
                if self.dp is not None:  # equal on every rank, or data parallelism is broken
                    self.log.info("learner.rank_done", step=self.trainer.step, weights=self.weights_digest())
        return 0

    def weights_digest(self) -> str:
        """A digest of the trained adapters' weights (ranks compare theirs in the log)."""
        import hashlib

        h = hashlib.sha256()
        for params in self.trainer.role_params.values():
            for p in params:
                h.update(p.detach().float().cpu().numpy().round(5).tobytes())
        return h.hexdigest()[:16]

    async def _train(
        self, prefetch: Prefetcher, task: asyncio.Task, inference: Any, broker: Any, max_steps: int | None
    ) -> None:
        lc = self.cfg.learner
        start = self.trainer.step
        reflections_ready = False
        while not self.stop.is_set() and (max_steps is None or self.trainer.step - start < max_steps):
            if self.state.phase == REFLECT_INIT and not reflections_ready:
                reflections_ready = await self.wait_for_reflections(broker) is not None
                continue  # re-checks stop
            if (
                lc.schedule == "rounds"
                and self.state.phase == COEVOLVE
                and (self.trainer.step - self.state.phase_start) % lc.publish_every == 0
            ):
                await self.wait_for_round(broker)
            micro = []
            dropped = 0
            t_wait = time.monotonic()
            while len(micro) < lc.grad_accum and not self.stop.is_set():
                getter = asyncio.ensure_future(prefetch.queue.get())
                stopper = asyncio.ensure_future(self.stop.wait())
                done, _ = await asyncio.wait({getter, stopper, task}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if task in done:
                    getter.cancel()
                    task.result()  # the prefetcher died: raise its error here instead of hanging
                if getter in done:
                    mb = getter.result()
                    if mb.phase == self.state.phase:
                        micro.append(mb.stores)
                    else:  # fetched before the phase changed: its stores and filters are the old phase's
                        dropped += 1
                else:
                    getter.cancel()
            if len(micro) < lc.grad_accum:
                break
            data_wait = time.monotonic() - t_wait
            phase = self.state.phase
            threads = await self.follow_threads(phase, broker)
            self.trainer.freeze_wm = world_model_frozen(self.cfg, phase)
            metrics = await self._step_or_stop(micro)
            if metrics is None:  # SIGTERM during a step: checkpoint the last completed one, now
                break
            metrics["learner/data_wait_s"] = data_wait
            metrics["learner/torch_threads"] = threads
            metrics["learner/phase_dropped"] = dropped
            rss = resident_gb()
            if rss is not None:
                metrics["learner/rss_gb"] = rss
            self.state.phase_seconds += metrics.get("learner/step_s", 0.0)
            self.state.tokens_total += int(metrics.get("learner/tokens", 0))
            metrics["learner/tokens_total"] = self.state.tokens_total
            step = self.trainer.step
            nxt = self.next_phase() if self.leader else None
            if self.dp is not None:  # rank 0's schedule, and its shutdown, on every rank
                nxt, leader_stops = self.dp.follow((nxt, self.stop.is_set()))
                if leader_stops:
                    self.stop.set()
            if self.stop.is_set():  # the step completed as SIGTERM came: keep it, skip the publish
                break
            if nxt is not None:
                self.log.info("learner.phase", old=self.state.phase, new=nxt, step=step)
                self.state.phase, self.state.phase_start = nxt, step
                self.state.phase_budget, self.state.phase_seconds = None, 0.0
                self.trainer.scheduler.enter(nxt, step)
                if nxt == COEVOLVE:  # the world model's teacher begins here (the paper: after warm-up)
                    self.trainer.start_teacher()
                metrics.update(await self.publish(inference, broker, metrics))
                published = True
            # a budget's last step is published too (``--max-steps``: a fork's end), also when a phase began
            # inside the budget and the phase's cadence does not fall on it
            elif (step - self.state.phase_start) % self._publish_every() == 0 or (
                max_steps is not None and step - start == max_steps
            ):
                metrics.update(await self.publish(inference, broker, metrics))
                published = True
            else:
                published = False
            # every publish is also a checkpoint: a learner killed after announcing version N resumes
            # with version N's weights, not behind the adapters the actors are already using
            if published or step % lc.checkpoint_every == 0:
                # a phase's first checkpoint is kept for good: `comap fork --version` of it redoes the
                # phase (reflection-mode initialisation with other switches) from the same warm-up
                self.checkpoint(pin=nxt is not None)
            self.scalars(metrics)
            self.history.append({**metrics, "phase": phase})
            self.log.info(
                "learner.step",
                step=step,
                phase=phase,
                version=self.state.version,
                **{k: float(f"{v:.4g}") for k, v in metrics.items() if "/" in k},
            )

    async def _step_or_stop(self, micro: list) -> dict[str, float] | None:
        """One step in a daemon thread; None when ``stop`` comes first (:mod:`learner.step_thread`)."""
        return await step_or_stop(self, micro)


def run_learner(cfg: CoMapConfig, log: Any, max_steps: int | None = None) -> int:
    import os
    import sys

    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    if shares_gpu_with_inference(cfg) and not asyncio.run(wait_before_loading(cfg, log)):
        return 0  # stopped before the servers were up: nothing was loaded, nothing to save
    learner = Learner(cfg, log)
    code = asyncio.run(learner.run(max_steps))
    if learner.dp is not None:
        learner.dp.close()
    thread = learner.step_thread
    if thread is not None and thread.is_alive():
        thread.join(3.0)  # an abandoned step stops at its next micro-batch
        if thread.is_alive():
            # still inside one long torch op: finalising the interpreter under it aborts the process;
            # the checkpoint and the logs are written, so leave now
            log.info("learner.exit_during_step")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code
