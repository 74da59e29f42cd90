"""Continuous batching over one transformers model with many LoRA adapters, on a dedicated thread.

The engine thread owns the model. Each iteration it (1) runs queued adapter operations, so weights
only change between forward passes; (2) admits waiting sequences up to ``max_batch_size``, their
prompts prefilled each with its own KV cache (no padding inside a prompt), in the decode step's
forward or alone (:mod:`comap_async.inference.prefill`), then merged into the running batch's cache;
(3) runs one decode step for the whole batch, rows of different adapters together, or a verify step
when a row's prompt suggests how it goes on (``speculative_tokens``) or its choices force its next
tokens (``forced_tokens``) (:mod:`comap_async.inference.speculative`). A sequence leaves the batch as
soon as it finishes, and a newcomer takes its row at the next step, so short and long requests do not
wait for each other.

Everything crossing threads goes through ``submit`` (a condition-guarded deque), ``call`` (a queue
of functions returning ``concurrent.futures.Future``) and each sequence's ``on_done`` callback.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from comap_async.heap import release_freed_memory
from comap_async.inference.adapters import BASE, SlotManager
from comap_async.inference.fused import FusedLlama, Part
from comap_async.inference.kvcache import BatchCache
from comap_async.inference.prefill import Prefill, PrefillSteps
from comap_async.inference.prefix import PrefixCache
from comap_async.inference.speculative import NgramIndex, Proposer, SpeculativeSteps, allowed_tokens, ngram_proposal
from comap_async.inference.token_sampling import SamplingParams, StepOutput, sample_step
from comap_async.models import kv_cache_argument


@dataclass(eq=False)
class Sequence:
    """One generated choice. Output fields are written by the engine thread only."""

    prompt_ids: list[int]
    params: SamplingParams
    slot: str = BASE
    adapter: str = ""
    """The requested adapter's name without its version (:func:`adapter_family`): the per-adapter counters' label."""
    on_done: Callable[["Sequence"], None] | None = None
    on_token: Callable[["Sequence"], None] | None = None
    """Called on the engine thread after each generated token (streaming); it must only schedule work."""
    generator: torch.Generator | None = None
    constraint: Any = None
    """A :class:`~comap_async.inference.choices.ChoiceTrie`: the tokens it may take (None: any)."""
    priority: int = 0
    """Admission order, as vLLM's priority scheduling: lower first, arrival order within one priority. A
    running row is not preempted (a call here decodes tens of tokens, so a row frees within a second).
    With the engine's ``priority_hold_s``, a sequence also waits while one of a lower priority runs."""
    out_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: BaseException | None = None
    cancelled: bool = False
    t_submit: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    ngrams: NgramIndex | None = None
    """Prompt and output indexed for speculative proposals (built at the first verify step it joins)."""
    proposal_budget: int | None = None
    """Most tokens to propose next (None: ``speculative_tokens``; then
    :func:`~comap_async.inference.speculative.next_budget` of what the last verify step confirmed)."""
    cache_gen: int | None = None
    """Its slot's generation when it was prefilled: at its end its output's keys and values join the
    prefix cache only if the slot's weights are still the ones that computed them."""


def enqueue(waiting: deque[Sequence], seq: Sequence) -> None:
    """Put ``seq`` behind every waiting sequence of its priority or a lower one (:attr:`Sequence.priority`)."""
    if not waiting or waiting[-1].priority <= seq.priority:
        waiting.append(seq)  # the common case: every request at one priority
        return
    waiting.insert(next(i for i, w in enumerate(waiting) if w.priority > seq.priority), seq)


@dataclass
class EngineStats:
    steps: int = 0
    step_seconds: float = 0.0
    prefill_seconds: float = 0.0
    """Time prefilling prompts: a prompt prefilled in a decode step's forward counts its tokens' share of it."""
    batch_rows: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    failed: int = 0
    running: int = 0
    waiting: int = 0
    computed_by_adapter: dict[str, int] = field(default_factory=dict)
    """Prompt tokens computed (not served by the prefix cache), by :attr:`Sequence.adapter`: which role's
    prompts the cache misses (a role whose prompt is re-rendered every step shows here)."""
    generated_by_adapter: dict[str, int] = field(default_factory=dict)
    """Tokens generated, by :attr:`Sequence.adapter`: which role's outputs the decode steps are spent on."""
    mixed_prefills: int = 0
    """Prompts prefilled in the same forward as a decode step or other prompts (``mixed_step_tokens``)."""
    verify_steps: int = 0
    """Decode steps that checked proposed tokens (counted in ``steps`` too)."""
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    """Proposed tokens the model's own choice confirmed: each is a decode step saved."""
    forced_tokens: int = 0
    """Tokens a choice-constrained row's choices forced, run in a verify step with the row's last one."""
    attended_columns: int = 0
    """Rows times KV-cache columns over decode and verify steps: what their attention reads."""
    real_columns: int = 0
    """The unmasked ones among them (the rest are rows' left padding and unconfirmed proposals)."""

    def count_columns(self, mask: torch.Tensor) -> None:
        self.attended_columns += mask.numel()
        self.real_columns += int(mask.sum())


BATCH_WAIT_MS = 5.0
"""How long the batcher waits for more requests before it starts a batch from an idle engine."""
TRIM_EVERY_S = 10.0
"""How often the engine thread hands the allocator's freed pages back (``comap_async/heap.py``): batches
of changing shapes fragment the heap as the learner's steps do; a trim costs milliseconds."""


class Engine(SpeculativeSteps, PrefillSteps):
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        slots: SlotManager,
        *,
        max_batch_size: int = 8,
        batch_wait_ms: float = BATCH_WAIT_MS,
        max_model_len: int = 4096,
        seed: int = 0,
        log: Any = None,
        prefix_cache: PrefixCache | None = None,
        fused: FusedLlama | None = None,
        speculative_tokens: int = 0,
        forced_tokens: int = 0,
        proposer: Proposer = ngram_proposal,
        priority_hold_s: float = 0.0,
        mixed_step_tokens: int = 0,
    ) -> None:
        self.model, self.tokenizer, self.slots = model, tokenizer, slots
        # the fused forward keeps keys transposed in its KV cache; transformers' forward cannot read them
        self.fused = fused
        self.key_dim = 3 if fused is not None else 2
        self.cache_arg = kv_cache_argument(slots.forward_model)
        self.speculative_tokens = speculative_tokens
        self.forced_tokens = forced_tokens
        self.propose = proposer
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.max_model_len = max_model_len
        self.log = log
        self.stats = EngineStats()
        self.prefix = prefix_cache
        self.priority_hold_s = priority_hold_s
        # only the fused forward runs several batches with their own caches in one forward
        self.mixed_step_tokens = mixed_step_tokens if fused is not None else 0
        self.num_layers = model.config.get_text_config().num_hidden_layers
        eos = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos_ids)
        self._default_gen = torch.Generator().manual_seed(seed)
        self._token_str: dict[int, str] = {}
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._ops: deque[tuple[Callable[[], Any], concurrent.futures.Future, bool]] = deque()
        self._running: list[Sequence] = []
        self._cache = self._new_cache(rows=max_batch_size)
        self._stop = False
        self.idle_delay_s = 1.0
        self._last_busy = time.monotonic()
        self._last_trim = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="comap-engine", daemon=True)
        self.fatal: BaseException | None = None

    # ---------------------------------------------------------------- public, any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def submit(self, seqs: list[Sequence]) -> None:
        with self._cond:
            for seq in seqs:
                enqueue(self._waiting, seq)
            self.stats.waiting = len(self._waiting)
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any], idle: bool = False) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between forward passes (``idle``: only when nothing is decoding)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._ops.append((fn, fut, idle))
            self._cond.notify_all()
        return fut

    def token_str(self, token_id: int) -> str:
        s = self._token_str.get(token_id)
        if s is None:
            s = self._token_str[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    was_idle = not self._running
                    with self._cond:
                        while not self._stop and not self._waiting and not self._runnable_ops(was_idle) and was_idle:
                            self._cond.wait(timeout=0.25)
                        idle = was_idle and not self._waiting
                        if self._stop:
                            self._fail_all(RuntimeError("the inference engine is shutting down"))
                            for _, fut, _ in self._ops:
                                fut.cancel()
                            self._ops.clear()
                            break
                        ops = self._take_ops(idle)
                    if ops:
                        # adapter weights made here are written later from other threads (spare refills),
                        # which inference tensors forbid
                        with torch.inference_mode(False):
                            for fn, fut, _ in ops:
                                self._run_op(fn, fut)
                    if was_idle and self._waiting and self.batch_wait_s > 0:
                        # let a burst of concurrent requests arrive so they start decoding together
                        time.sleep(self.batch_wait_s)
                    joining = self._admit()
                    if self._running:
                        self._decode_step(joining)
                    elif joining:
                        self._prefill_together(joining)
                    self._join(joining)
                    if time.monotonic() - self._last_trim >= TRIM_EVERY_S:
                        release_freed_memory()
                        self._last_trim = time.monotonic()
        except BaseException as exc:  # the thread must not die silently: /health reports it
            self.fatal = exc
            if self.log:
                self.log.exception("engine.fatal")
            self._fail_all(exc)
            raise

    def _quiet(self, idle: bool) -> bool:
        # Idle-only work (building spare adapter slots, ~0.2-0.4 s) waits for a quiet spell, so it does
        # not land between a publish and the first requests for the new version.
        return idle and time.monotonic() - self._last_busy >= self.idle_delay_s

    def _runnable_ops(self, idle: bool) -> bool:
        quiet = self._quiet(idle)
        return any(quiet or not only_idle for _, _, only_idle in self._ops)

    def _take_ops(self, idle: bool) -> list:
        quiet = self._quiet(idle)
        taken = [op for op in self._ops if quiet or not op[2]]
        for op in taken:
            self._ops.remove(op)
        return taken

    @staticmethod
    def _run_op(fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as exc:  # handed to the caller through the future
            fut.set_exception(exc)

    def _new_cache(self, rows: int = 1) -> BatchCache:
        """A cache of ``rows`` rows once reallocated: the running batch's holds the largest batch, a prefill's one."""
        return BatchCache(self.num_layers, transposed=self.fused is not None, rows_hint=rows)

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: BatchCache,
        adapters: list[str],
        real: torch.Tensor | None = None,
        prefills: list[Prefill] = (),
        **kw: Any,
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` of each row's last position, or with ``real`` (indices into the flattened
        ``[B*T]`` positions) of those positions, ``[len(real), vocab]`` (the fused forward computes no other).
        ``prefills`` (fused forward only) are computed in the same forward: each gets its logits and its
        tokens' share of the time."""
        if self.fused is not None:
            t0 = time.perf_counter()
            parts = [self._part(input_ids, positions, mask, cache, adapters, real)]
            parts += [self._part(*p.inputs(), p.cache, [p.seq.slot]) for p in prefills]
            logits = self.fused.forward_parts(parts)
            if prefills:
                seconds = time.perf_counter() - t0
                tokens = [len(real) if real is not None else input_ids.numel(), *(p.computed for p in prefills)]
                for p, part_logits, n in zip(prefills, logits[1:], tokens[1:]):
                    p.logits, p.seconds = part_logits, seconds * n / sum(tokens)
            return logits[0]
        self.slots.begin_step(adapters)
        try:
            out = self.slots.forward_model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self.cache_arg: cache},
                **kw,
            )
        finally:
            self.slots.end_step()
        if real is not None:
            return out.logits.reshape(-1, out.logits.shape[-1]).index_select(0, real)
        return out.logits[:, -1, :]

    def _part(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: BatchCache,
        adapters: list[str],
        real: torch.Tensor | None = None,
    ) -> Part:
        rows = self.slots.stacks.rows_for(adapters, BASE) if self.slots.peft is not None else None
        return Part(input_ids, positions, mask, cache, rows, real=real)

    def _decode_step(self, joining: list[Prefill] = ()) -> None:
        """One token for every running row (or a verify step, :mod:`~comap_async.inference.speculative`),
        the ``joining`` prompts prefilled in the same forward."""
        if self.speculative_tokens or self.forced_tokens:
            proposals = [self._proposal(s) for s in self._running]
            if any(proposals):
                self._verify_step(proposals, joining)
                return
        t0 = time.perf_counter()
        self._last_busy = time.monotonic()
        rows = self._running
        ids = torch.tensor([[s.out_ids[-1]] for s in rows], dtype=torch.long)
        positions = torch.tensor([[len(s.prompt_ids) + len(s.out_ids) - 1] for s in rows], dtype=torch.long)
        try:
            mask = self._cache.extend_mask()
            self.stats.count_columns(mask)
            logits = self._forward(ids, mask, positions, self._cache, [s.slot for s in rows], prefills=joining)
            steps = sample_step(
                logits,
                [s.params for s in rows],
                [s.generator for s in rows],
                self._default_gen,
                allowed_tokens(rows),
            )
        except Exception as exc:
            self._step_failed(exc, rows)
            return
        keep: list[int] = []
        for i, (seq, step) in enumerate(zip(rows, steps)):
            if seq.cancelled:
                self._finish(seq, "abort")
            elif not self._append(seq, step):
                keep.append(i)
        self._end_step(rows, keep, t0, joining)

    def _step_failed(self, exc: Exception, rows: list[Sequence]) -> None:
        """A failed decode or verify step poisons the shared cache: fail this batch, keep serving."""
        if self.log:
            self.log.exception("engine.step_failed", batch=len(rows))
        self._fail_all(exc)

    def _end_step(self, rows: list[Sequence], keep: list[int], t0: float, joining: list[Prefill] = ()) -> None:
        """After a decode or verify step: only the ``keep`` rows stay in the batch; the step is counted (less
        the ``joining`` prompts' share of its forward)."""
        if len(keep) != len(rows):
            if self.prefix is not None:
                self._store_outputs(rows, keep)
            self._running = [rows[i] for i in self._cache.select(keep)]
        st = self.stats
        st.steps += 1
        st.batch_rows += len(rows)
        st.running = len(self._running)
        st.step_seconds += time.perf_counter() - t0 - sum(p.seconds for p in joining)

    def _store_outputs(self, rows: list[Sequence], keep: list[int]) -> None:
        """Keep the keys and values of what the leaving rows generated in the prefix cache: a conversation's
        next turn repeats the reply, so its prefill starts after it instead of at the prompt's last full block.
        Every token but the last has its keys and values in the batch cache (the last was never fed back)."""
        kept, block = set(keep), self.prefix.block
        for i, seq in enumerate(rows):
            if i in kept or seq.finish_reason not in ("stop", "length") or len(seq.out_ids) < 2:
                continue
            if seq.cache_gen != self.slots.generation.get(seq.slot, 0):
                continue  # the slot's weights changed meanwhile
            tokens = seq.prompt_ids + seq.out_ids[:-1]
            start = len(seq.prompt_ids) // block * block
            if len(tokens) // block * block <= start:
                continue  # no new full block
            columns = self._cache.mask[i].nonzero().squeeze(1)
            if columns.numel() != len(tokens):  # the row's real columns are its tokens; else leave it out
                continue
            columns = columns[start:]
            layers = [
                (layer.keys[i : i + 1].index_select(layer.kdim, columns), layer.values[i : i + 1, :, columns])
                for layer in self._cache.layers
            ]
            self.prefix.store(seq.slot, seq.cache_gen, tokens, layers, start, self.key_dim, offset=start)

    def _append(self, seq: Sequence, step: StepOutput) -> bool:
        """Record one token; True when the sequence has finished (and was handed back)."""
        p = seq.params
        tok = step.token
        seq.out_ids.append(tok)
        if seq.ngrams is not None:
            seq.ngrams.append(tok)
        seq.token_logprobs.append(step.logprob)
        if p.logprobs is not None:
            seq.top_logprobs.append(step.top)
        self.stats.generated_tokens += 1
        by = self.stats.generated_by_adapter
        by[seq.adapter] = by.get(seq.adapter, 0) + 1
        if seq.on_token is not None:
            try:
                seq.on_token(seq)
            except Exception:  # a broken callback must not take the engine down
                if self.log:
                    self.log.exception("engine.callback_failed")
        reason: str | None = None
        if tok in self.eos_ids and not p.ignore_eos:
            reason = "stop"
        elif tok in p.stop_token_ids:
            reason, seq.stop_reason = "stop", tok
        elif p.stop and self._hit_stop(seq):
            reason = "stop"
        elif len(seq.out_ids) >= p.max_tokens or len(seq.prompt_ids) + len(seq.out_ids) >= self.max_model_len:
            reason = "length"
        if reason is None:
            return False
        self._finish(seq, reason)
        return True

    def _hit_stop(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.out_ids, skip_special_tokens=seq.params.skip_special_tokens)
        best: tuple[int, str] | None = None
        for s in seq.params.stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        seq.text = text[: i + len(s)] if seq.params.include_stop_str_in_output else text[:i]
        seq.stop_reason = s
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.ngrams = None
        if not isinstance(seq.stop_reason, str):  # a stop string already set the truncated text
            seq.text = self.tokenizer.decode(seq.out_ids, skip_special_tokens=seq.params.skip_special_tokens)
        if reason == "error":
            self.stats.failed += 1
        else:
            self.stats.finished += 1
        if seq.on_done is not None:
            try:
                seq.on_done(seq)
            except Exception:  # a broken callback must not take the engine down; it is a bug, so log it
                if self.log:
                    self.log.exception("engine.callback_failed")

    def _fail_all(self, exc: BaseException, waiting: bool = False) -> None:
        rows, self._running = self._running, []
        if waiting or self._stop or self.fatal is not None:
            with self._cond:
                rows += list(self._waiting)
                self._waiting.clear()
        self._cache = self._new_cache(rows=self.max_batch_size)
        for seq in rows:
            seq.error = exc
            self._finish(seq, "error")
        self.stats.running = 0
