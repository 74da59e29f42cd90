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
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comap_async.config import CoMapConfig
from comap_async.heap import release_freed_memory, resident_gb
from comap_async.method.fingerprint import check_method
from comap_async.method.routing import after_warmup, first_phase, world_model_frozen
from comap_async.run_files import append_run_config, write_run_ablation
from comap_async.waiting import cancel_and_wait, until_stopped, wait_until_answers
from comap_async.wire.messages import COEVOLVE, REFLECT_INIT, WARMUP
from learner.prefetch import Prefetcher
from learner.schedule import phase_bce_weight
from learner.threads import QUIET_STORE, QuietWatch, own_threads, phase_threads


@dataclass
class LearnerState:
    phase: str = WARMUP
    version: int = 0
    phase_start: int = 0
    round_episodes: int = 0  # episodes written when the current round started (rounds schedule)
    phase_budget: int | None = None  # the phase's step budget when sized by data (warmup_epochs)
    phase_seconds: float = 0.0  # training time spent in the phase (warmup_max_minutes)
    tokens_total: int = 0  # tokens trained since the run began: wall-clock throughput (async vs rounds)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Learner:
    def __init__(self, cfg: CoMapConfig, log: Any) -> None:
        import torch

        from comap_async.models import load_model_and_tokenizer, resolve_model
        from comap_async.prompts import Prompts
        from learner.batches import Encoder
        from learner.distributed import DataParallel
        from learner.peft_model import build_peft_model
        from learner.trainer import Trainer

        self.cfg, self.log = cfg, log
        lc = cfg.learner
        torch.set_num_threads(cfg.model.torch_threads)
        torch.manual_seed(cfg.run.seed)
        # under torchrun: one rank of data-parallel training (before the model: it picks the GPU)
        self.dp = DataParallel.from_env(lc.device)
        self.leader = self.dp is None or self.dp.leader
        path = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
        base, tok = load_model_and_tokenizer(path, cfg.model.dtype, lc.device)
        model = build_peft_model(
            base, lc.lora_r, lc.lora_alpha, lc.lora_dropout, lc.target_modules, lc.gradient_checkpointing
        )
        prompts = Prompts.for_model(path, cfg)
        encoder = Encoder.for_learner(tok, prompts, lc)
        self.trainer = Trainer(model, encoder, lc, lc.device)
        self.trainer.ablation = cfg.ablation
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

    # ------------------------------------------------------------------ phases
    def next_phase(self) -> str | None:
        """The phase to switch to after this step, or None to stay."""
        lc, s, step = self.cfg.learner, self.state, self.trainer.step
        limit = {WARMUP: lc.warmup_max_minutes, REFLECT_INIT: lc.reflect_init_max_minutes}.get(s.phase)
        out_of_time = limit is not None and s.phase_seconds >= 60 * limit
        if s.phase == WARMUP and (step - s.phase_start >= (s.phase_budget or lc.warmup_steps) or out_of_time):
            return after_warmup(self.cfg)
        if s.phase == REFLECT_INIT and (
            step - s.phase_start >= (s.phase_budget or lc.reflect_init_steps) or out_of_time
        ):
            return COEVOLVE
        return None

    def _publish_every(self) -> int:
        """Steps between publishes in the current phase (never in warm-up unless configured)."""
        lc = self.cfg.learner
        if self.state.phase == WARMUP:
            return lc.warmup_publish_every or 1 << 62
        return lc.publish_every

    async def publish(self, inference: Any, broker: Any, metrics: dict[str, float] | None = None) -> dict[str, Any]:
        from learner.checkpoint import pinned_steps
        from learner.publish import publish_adapters

        self.state.version += 1
        if not self.leader:  # rank 0 publishes the weights every rank holds
            return {}
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
                retries=self.cfg.inference.retries,
                metrics=metrics,
                keep_steps=pinned_steps(self.ckpt_dir),
                ablation=self.cfg.ablation.active,
            ),
            self.stop,
        )
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
        registry names; the files are the published ones, so nothing changes for them.
        """
        from learner.publish import load_everywhere

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
                self.cfg.inference.retries,
                self.log,
                inplace=True,
            )
        self.log.info("learner.live_adapters_reloaded", adapters=registry.get("adapters"))

    async def wait_for_store(self, broker: Any, store: str, key: str, need: int, event: str) -> int | None:
        """Poll the broker's stats until ``stores[store][key] >= need`` (one log line per 10 s);
        returns the value reached, or None when stopping."""
        last = 0.0
        while not self.stop.is_set():
            have = (await broker.get_stats())["stores"][store][key]
            if have >= need:
                return have
            if time.monotonic() - last > 10:
                self.log.info(event, store=store, have=have, need=need)
                last = time.monotonic()
            await asyncio.sleep(1.0)
        return None

    @property
    def global_batch(self) -> int:
        """Samples one optimizer step trains on, over every rank (a budget's unit)."""
        lc = self.cfg.learner
        return lc.batch_size * lc.grad_accum * (self.dp.world if self.dp is not None else 1)

    @property
    def reflect_init_batch(self) -> int:
        """Reflection samples per micro-batch of reflection-mode initialisation."""
        lc = self.cfg.learner
        return lc.reflect_init_batch_size or lc.batch_size

    def follow_budget(self, phase: str) -> None:
        """Enter ``phase`` with the step budget just sized from the broker's counts, rank 0's on every
        rank (the ranks read the counts at slightly different moments)."""
        if self.dp is not None:
            self.state.phase_budget = self.dp.follow(self.state.phase_budget)
        self.trainer.scheduler.enter(phase, self.state.phase_start, self.state.phase_budget)

    async def follow_threads(self, phase: str, broker: Any) -> int:
        """Set the phase's torch threads (:func:`~learner.threads.phase_threads`) before a step; returns
        them. A phase's own threads wait until its store (episodes, labels) has stopped growing for a while."""
        import torch

        quiet = True
        if own_threads(self.cfg, phase) is not None:
            written = (await broker.get_stats())["stores"][QUIET_STORE[phase]]["written"]
            # keyed by phase: a new phase's store starts its own window, whatever its count
            quiet = self.actors_quiet.update((phase, written), time.monotonic())
        threads = phase_threads(self.cfg, phase, quiet)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
            self.log.info("learner.threads", phase=phase, threads=threads)
        return threads

    async def wait_for_demos(self, broker: Any) -> None:
        """Warm-up starts once the broker holds ``warmup_min_demos`` demonstrations."""
        demos = await self.wait_for_store(
            broker, "demos", "count", self.cfg.learner.warmup_min_demos, "learner.waiting_for_demos"
        )
        lc = self.cfg.learner
        if demos is not None and lc.warmup_epochs is not None and self.state.phase_budget is None:
            # sized by the data there is when training starts: later demonstrations only add variety
            self.state.phase_budget = max(lc.warmup_steps, math.ceil(lc.warmup_epochs * demos / self.global_batch))
            self.follow_budget(WARMUP)
            self.log.info("learner.warmup_budget", demos=demos, epochs=lc.warmup_epochs, steps=self.state.phase_budget)

    async def wait_for_reflections(self, broker: Any) -> int | None:
        """``reflect_init`` trains once the broker holds ``reflect_init_min_samples`` reflection
        samples: the actors start labelling them only when the phase is announced. With
        ``reflect_init_epochs`` the phase's budget is then sized by the samples held."""
        lc = self.cfg.learner
        have = await self.wait_for_store(
            broker, "reflections", "count", lc.reflect_init_min_samples, "learner.waiting_for_reflections"
        )
        if have is not None and lc.reflect_init_epochs is not None and self.state.phase_budget is None:
            per_step = self.global_batch // lc.batch_size * self.reflect_init_batch
            self.state.phase_budget = max(lc.reflect_init_steps, math.ceil(lc.reflect_init_epochs * have / per_step))
            self.follow_budget(REFLECT_INIT)
            self.log.info(
                "learner.reflect_init_budget",
                samples=have,
                epochs=lc.reflect_init_epochs,
                steps=self.state.phase_budget,
            )
        return have

    async def wait_for_round(self, broker: Any) -> None:
        """``rounds`` schedule: block until the actors finished ``rounds_episodes`` new episodes."""
        need = self.state.round_episodes + self.cfg.learner.rounds_episodes
        written = await self.wait_for_store(broker, "episodes", "written", need, "learner.waiting_for_round")
        if written is not None:
            self.state.round_episodes = written

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
            write_run_ablation(self.run_dir, self.cfg.ablation.active, self.cfg.method_switches)
            append_run_config(self.run_dir, self.cfg.model_dump(mode="json"), self.trainer.step, self.state.phase)
        if self.cfg.ablation.active:
            self.log.info("learner.ablation", active=self.cfg.ablation.active)
        async with BrokerClient.from_config(self.cfg) as broker:
            inference = InferenceClient.from_config(self.cfg)
            try:
                registry = await wait_until_answers(
                    "broker", broker.get_registry, self.log, self.stop, "learner.waiting"
                )
                if registry is None:
                    return 0
                check_method(self.cfg, registry.get("method"), "the broker")
                for url in self.cfg.inference.endpoints:
                    await wait_until_answers(
                        f"inference {url}",
                        lambda u=url: inference.health(endpoint=u),
                        self.log,
                        self.stop,
                        "learner.waiting",
                    )
                live = int((registry.get("versions") or {}).get("policy", 0))
                if live > 0 and self.leader:
                    await self.reload_live_adapters(inference, registry)
                # new versions are numbered above anything announced, even after an older checkpoint
                self.state.version = max(self.state.version, live)
                if not resumed and registry.get("phase") != self.state.phase and self.leader:
                    await broker.announce(
                        self.state.phase,
                        registry.get("versions", {}),
                        registry.get("adapters", {}),
                        0,
                    )
                if self.state.phase == WARMUP:
                    await self.wait_for_demos(broker)
                shares = {
                    "transitions": lc.wm_anchor_share,
                    "reflections": lc.reflect_init_share,
                    "imagined": lc.imagined_share,
                }
                rank = self.dp.rank if self.dp is not None else 0  # each rank samples its own micro-batches
                prefetch = Prefetcher(
                    broker,
                    self.state,
                    lc.batch_size,
                    lc.prefetch,
                    self.cfg.run.seed + 7919 * rank,
                    self.log,
                    shares,
                    self.cfg.ablation,
                    {REFLECT_INIT: {"reflections": self.reflect_init_batch}},
                )
                task = asyncio.create_task(prefetch.run())
                try:
                    await self._train(prefetch, task, inference, broker, max_steps)
                finally:
                    await cancel_and_wait([task])
                    self.checkpoint()
            finally:
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
            self.trainer.bce_weight = phase_bce_weight(lc, phase)
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
            elif (step - self.state.phase_start) % self._publish_every() == 0:
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
        """Run one step in a daemon thread; None when ``stop`` comes first.

        A step of the default model on one CPU core takes tens of seconds and honcho sends SIGKILL
        5 s after SIGTERM, so shutdown cannot wait for it: the step is told to abandon at its next
        micro-batch, and the checkpoint (taken under the trainer's update lock) holds the last
        completed step. A daemon thread does not keep the exiting process alive.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def hand_back(settle: Any) -> None:
            if loop.is_closed():
                return  # the step was abandoned and the loop has finished: nobody waits for it
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:
                if not loop.is_closed():  # closed between the check and the call is the same case
                    raise

        def work() -> None:
            try:
                result = self.trainer.train_step(micro)
                release_freed_memory()  # the step's activations, freed in this thread's arena
            except BaseException as exc:  # handed to the event loop, which raises it in _train
                # bound now: Python unbinds ``exc`` when the except block ends, before the loop runs this
                hand_back(lambda err=exc: done.done() or done.set_exception(err))
            else:
                hand_back(lambda: done.done() or done.set_result(result))

        self.step_thread = threading.Thread(target=work, name="learner-step", daemon=True)
        self.step_thread.start()
        stopper = asyncio.ensure_future(self.stop.wait())
        finished, _ = await asyncio.wait({done, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if done in finished:
            return done.result()
        self.trainer.abort = True
        done.add_done_callback(lambda f: f.exception())  # an abandoned step's StepAborted is expected
        self.log.info("learner.step_abandoned", step=self.trainer.step + 1)
        return None


def run_learner(cfg: CoMapConfig, log: Any, max_steps: int | None = None) -> int:
    import os
    import sys

    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
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
