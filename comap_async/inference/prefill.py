"""Admitting waiting sequences and prefilling their prompts: alone, or in the running rows' decode-step forward.

A forward on this CPU pays a fixed price whatever its tokens (the weights read from memory, ~20 small ops
a layer): ~50 ms for a decode step of 4 rows of SmolLM2-135M, about what 20 prompt tokens cost. A prompt
prefilled in a forward of its own, right before the decode step that it joins, pays it twice. With
``mixed_step_tokens`` the joining prompts ride in the decode step's forward instead (each part attends
over its own cache; :meth:`~comap_async.inference.fused.FusedLlama.forward_parts`), as vLLM's scheduler
mixes prefills into decode batches. Only the fused forward can; transformers' forward prefills alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from comap_async.inference.kvcache import BatchCache, room_for
from comap_async.inference.speculative import allowed_tokens
from comap_async.inference.token_sampling import sample_step

MIXED_STEP_TOKENS = 2048
"""The embedded server's ``mixed_step_tokens`` (fused forward): joining prompts whose uncached parts add up to at
most this many tokens are prefilled in the same forward as the running rows' next decode step (and as each
other), so the weights are read once for all of them; a longer one is prefilled on its own first. Like vLLM's
mixed prefill-and-decode batches, without chunking."""


@dataclass(eq=False)
class Prefill:
    """A sequence's prompt, ready for its forward: what the prefix cache served is in ``cache`` already."""

    seq: Any
    """The :class:`~comap_async.inference.engine.Sequence`."""
    cache: BatchCache
    cached: int
    """Prompt tokens the prefix cache served (their keys and values are in ``cache``)."""
    gen: int
    """The slot's generation at the lookup (:attr:`Sequence.cache_gen`)."""
    lookup_seconds: float
    logits: torch.Tensor | None = None
    seconds: float = 0.0
    """Its forward's time, or its tokens' share of a forward shared with a decode step or other prompts."""

    @property
    def computed(self) -> int:
        return len(self.seq.prompt_ids) - self.cached

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input_ids``, ``positions`` and ``mask`` of the prompt's part after the cached prefix."""
        prompt, n = self.seq.prompt_ids, len(self.seq.prompt_ids)
        ids = torch.tensor([prompt[self.cached :]], dtype=torch.long)
        return ids, torch.arange(self.cached, n).unsqueeze(0), torch.ones(1, n, dtype=torch.long)


class PrefillSteps:
    """The engine's admission and prefill (mixed into :class:`~comap_async.inference.engine.Engine`, whose
    state it uses: the queue, the running rows, the batch cache, the prefix cache, ``_forward``, ``_append``,
    ``_finish``)."""

    def _admissible(self, joining: list[Prefill] = ()) -> Any:
        """The next waiting sequence to admit (called under ``_cond``), taken off the queue: the first in
        priority order, except that with ``priority_hold_s`` one whose priority is above a running row's
        waits until it has waited that long (then the longest waiting such one goes). ``joining``: sequences
        admitted already, counted as running."""
        if not self._waiting:
            return None
        if self.priority_hold_s > 0 and (self._running or joining):
            best = min(s.priority for s in [*self._running, *(p.seq for p in joining)])
            if self._waiting[0].priority > best:
                now = time.monotonic()
                aged = [w for w in self._waiting if now - w.t_submit >= self.priority_hold_s]
                if not aged:
                    return None
                seq = min(aged, key=lambda w: w.t_submit)
                self._waiting.remove(seq)
                return seq
        return self._waiting.popleft()

    def _admit(self) -> list[Prefill]:
        """Admit waiting sequences while the batch has room. A prompt whose uncached part fits in what is
        left of ``mixed_step_tokens`` is returned, to be prefilled in the next step's forward; any other is
        prefilled now, on its own."""
        joining: list[Prefill] = []
        budget = self.mixed_step_tokens
        while len(self._running) + len(joining) < self.max_batch_size:
            with self._cond:
                seq = self._admissible(joining)
                if seq is None:
                    break
                self.stats.waiting = len(self._waiting)
            if seq.cancelled:
                self._finish(seq, "abort")
                continue
            try:
                prefill = self._lookup(seq)
                if prefill.computed <= budget:
                    budget -= prefill.computed
                    joining.append(prefill)
                    continue
                self._prefill_alone(prefill)
            except Exception as exc:  # one bad sequence (e.g. out of memory on a huge prompt) fails alone
                self._prefill_failed(seq, exc)
        self.stats.running = len(self._running)
        return joining

    def _prefill_failed(self, seq: Any, exc: Exception) -> None:
        if self.log:
            self.log.exception("engine.prefill_failed", prompt_tokens=len(seq.prompt_ids))
        seq.error = exc
        self._finish(seq, "error")

    def _prefill_alone(self, p: Prefill) -> None:
        t0 = time.perf_counter()
        ids, positions, mask = p.inputs()
        p.logits = self._forward(ids, mask, positions, p.cache, [p.seq.slot], logits_to_keep=1)
        p.seconds = time.perf_counter() - t0
        self._prefilled(p)

    def _lookup(self, seq: Any) -> Prefill:
        """The sequence's prompt with what the prefix cache holds of it already in a cache of its own."""
        t0 = time.perf_counter()
        self._last_busy = time.monotonic()
        cache = self._new_cache()
        gen = seq.cache_gen = self.slots.generation.get(seq.slot, 0)
        done, layers = 0, None
        if self.prefix is not None:  # room for the prompt's computed part and its first tokens: no relayout
            room = room_for(len(seq.prompt_ids))
            done, layers = self.prefix.lookup(seq.slot, gen, seq.prompt_ids, self.key_dim, room)
        if layers is not None:
            for layer, (k, v) in zip(cache.layers, layers):
                layer._set(k, v, done)
        return Prefill(seq, cache, done, gen, time.perf_counter() - t0)

    def _prefill_together(self, joining: list[Prefill]) -> None:
        """The joining prompts' forward when no row is decoding: one forward for all of them."""
        first, rest = joining[0], joining[1:]
        t0 = time.perf_counter()
        try:
            ids, positions, mask = first.inputs()
            first.logits = self._forward(ids, mask, positions, first.cache, [first.seq.slot], prefills=rest)
        except Exception:  # left to :meth:`_join`, which prefills each alone (and fails only a bad one)
            if self.log:
                self.log.exception("engine.shared_prefill_failed", prompts=len(joining))
            for p in joining:
                p.logits = None
            return
        first.seconds = time.perf_counter() - t0 - sum(p.seconds for p in rest)

    def _join(self, joining: list[Prefill]) -> None:
        """The joining prompts after their shared forward: each takes its first token and a row. One whose
        forward failed (with the batch it joined, or beside other prompts) is prefilled again on its own."""
        for p in joining:
            try:
                if p.logits is None:
                    self._prefill_alone(self._lookup(p.seq))
                else:
                    self.stats.mixed_prefills += 1
                    self._prefilled(p)
            except Exception as exc:
                self._prefill_failed(p.seq, exc)
        self.stats.running = len(self._running)

    def _prefilled(self, p: Prefill) -> None:
        """A prompt whose forward has run: its keys and values go to the prefix cache, its first token is
        sampled, and it joins the running batch (unless that token finished it)."""
        t0 = time.perf_counter()
        seq, cache = p.seq, p.cache
        prompt, n = seq.prompt_ids, len(seq.prompt_ids)
        cache.mask = torch.ones(1, n, dtype=torch.long)
        if self.prefix is not None:
            self.prefix.store(
                seq.slot, p.gen, prompt, [(layer.keys, layer.values) for layer in cache.layers], p.cached, self.key_dim
            )
            self.prefix.hits += p.cached
        self.stats.prefill_seconds += p.lookup_seconds + p.seconds + time.perf_counter() - t0
        self.stats.prompt_tokens += n
        by = self.stats.computed_by_adapter
        by[seq.adapter] = by.get(seq.adapter, 0) + p.computed
        step = sample_step(p.logits, [seq.params], [seq.generator], self._default_gen, allowed_tokens([seq]))[0]
        p.logits = None
        seq.t_first = time.monotonic()
        if not self._append(seq, step):
            self._cache.merge(cache)
            self._running.append(seq)
