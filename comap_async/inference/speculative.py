"""Speculative decoding from prompt lookup (the engine's ``speculative_tokens``): the proposals and the verify step.

Most of what the roles generate is already in their prompts: the EMA teacher is shown the real next
observation and writes it again; a reflection's final action repeats the draft; the world model's
answer reuses the room's and objects' names from the state. The tokens that followed the most
recent earlier occurrence of a sequence's last few tokens are a cheap guess at its next ones; the
engine checks the guess in one forward pass (:meth:`SpeculativeSteps._verify_step`) and keeps what the model
itself would have produced, so the output is the same as decoding one token a step.

vLLM's ``ngram`` speculative method is the same idea (``prompt_lookup_max``/``min``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from comap_async.inference.token_sampling import sample_step

FORCED_CHOICE_TOKENS = 4
"""The embedded server's ``forced_tokens``: a row decoded to a list of choices (``structured_outputs.choice``,
the actors' admissible commands) runs the tokens its choices leave no alternative to (after "take apple 1",
" from countertop 1" when the apple is nowhere else) in one verify step with its last token, up to this many,
instead of one decode step each; the output is the same (each is the only token allowed). vLLM has no
counterpart (SGLang's jump-forward decoding is the same idea)."""

NGRAM_SIZES = (4, 3)
"""The suffix lengths looked up, longest first. Shorter ones propose more often and are confirmed less
often, and on this project's CPUs an unconfirmed token costs about as much as a decode step's row (~4.8
against ~9 ms of a step's fixed cost a row): ``benchmarks/speculative_acceptance.py`` replays a run's
outputs and models the decode cost. Over co-evolution outputs of trained adapters (an ALFWorld run's
warm-up version / a ScienceWorld run's CoMap fork), modelled cost against decoding without speculation,
4 tokens at most: (4, 3) 0.79 / 0.72, (3, 2) 0.80 / 0.76, (4, 3, 2, 1) 0.81 / 0.76; 8 tokens at most 0.85 / 0.73."""


class NgramIndex:
    """Where each n-gram of a token sequence last ended, kept up to date as tokens are appended.

    The n-grams ending at the sequence's last token are indexed only when the next token arrives, so
    a lookup of the current suffix finds an *earlier* occurrence, never the suffix itself.
    """

    def __init__(self, tokens: Iterable[int], sizes: tuple[int, ...] = NGRAM_SIZES) -> None:
        self.tokens: list[int] = list(tokens)
        self.last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        for end in range(len(self.tokens) - 1):
            self._index(end)

    def _index(self, end: int) -> None:
        toks = self.tokens
        for n, table in self.last.items():
            if end + 1 >= n:
                table[tuple(toks[end + 1 - n : end + 1])] = end

    def append(self, token: int) -> None:
        if self.tokens:
            self._index(len(self.tokens) - 1)
        self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix
        found (empty when none of the sizes' suffixes occurred before, or ``k`` is 0)."""
        toks = self.tokens
        if k <= 0:
            return []
        for n, table in self.last.items():
            if len(toks) < n:
                continue
            end = table.get(tuple(toks[len(toks) - n :]))
            if end is not None:
                return toks[end + 1 : end + 1 + k]
        return []


def next_budget(most: int, confirmed: int) -> int:
    """A row's next proposal budget after a check that confirmed ``confirmed`` of its tokens: twice that,
    at least 1, at most ``most`` (the engine's ``speculative_tokens``), so failing guesses cost little."""
    return max(1, min(most, 2 * confirmed))


Proposer = Callable[[Any, int], list[int]]
"""``(sequence, k)`` -> up to ``k`` tokens the sequence may go on with (the engine checks them)."""


def ngram_proposal(seq: Any, k: int) -> list[int]:
    """The engine's proposer: :meth:`NgramIndex.propose` over the sequence's prompt and output, indexed
    at its first verify step and kept up to date by the engine as tokens are appended."""
    if seq.ngrams is None:
        seq.ngrams = NgramIndex(seq.prompt_ids + seq.out_ids)
    return seq.ngrams.propose(k)


def allowed_tokens(rows: list[Any]) -> list[list[int] | None] | None:
    """Each row's allowed next tokens (its choice constraint), None when no row is constrained."""
    if all(s.constraint is None for s in rows):
        return None
    return [None if s.constraint is None else s.constraint.allowed(s.out_ids) for s in rows]


class SpeculativeSteps:
    """The engine's speculative decode step (mixed into :class:`~comap_async.inference.engine.Engine`,
    whose state it uses: the running rows, the batch cache, ``_forward``, ``_append``, ``_finish``,
    ``_step_failed``, ``_end_step``)."""

    def _proposal(self, seq: Any) -> list[int]:
        """Tokens the sequence's prompt and output suggest it goes on with, within its token budget less
        one (the verify step always adds the model's own next token). A choice-constrained row proposes
        the tokens its choices force (``forced_tokens`` at most; each the only one allowed, so always
        confirmed), the others those prompt lookup finds (``speculative_tokens``)."""
        used = len(seq.prompt_ids) + len(seq.out_ids)
        room = min(seq.params.max_tokens - len(seq.out_ids), self.max_model_len - used)
        if seq.constraint is not None:
            k = min(self.forced_tokens, room - 1)
            return seq.constraint.forced(seq.out_ids, k) if k > 0 else []
        budget = self.speculative_tokens if seq.proposal_budget is None else seq.proposal_budget
        k = min(budget, room - 1)
        if k <= 0:
            return []
        return self.propose(seq, k)

    def _verify_step(self, proposals: list[list[int]], joining: list[Any] = ()) -> None:
        """One forward over each row's last token and its proposed ones, then each row's tokens sampled
        position by position as a decode step would (same parameters, generator and constraint) while
        they confirm the proposal: a row gains its confirmed tokens plus the model's next one. The
        keys and values of what was not confirmed stay in the cache as masked columns. The ``joining``
        prompts are prefilled in the same forward."""
        t0 = time.perf_counter()
        self._last_busy = time.monotonic()
        rows = self._running
        width = 1 + max(len(p) for p in proposals)
        ids, positions, real, first = [], [], [], []
        for i, (seq, prop) in enumerate(zip(rows, proposals)):
            last = len(seq.prompt_ids) + len(seq.out_ids) - 1
            ids.append([seq.out_ids[-1], *prop] + [seq.out_ids[-1]] * (width - 1 - len(prop)))
            # padding columns repeat the last real position; the forward leaves them out
            positions.append([last + min(c, len(prop)) for c in range(width)])
            first.append(len(real))  # where row i's logits start among the real positions'
            real.extend(range(i * width, i * width + 1 + len(prop)))
        try:
            mask = self._cache.extend_mask(width)
            self.stats.count_columns(mask)
            logits = self._forward(
                torch.tensor(ids, dtype=torch.long),
                mask,
                torch.tensor(positions, dtype=torch.long),
                self._cache,
                [s.slot for s in rows],
                real=torch.tensor(real, dtype=torch.long),
                prefills=joining,
            )
        except Exception as exc:
            self._step_failed(exc, rows)
            return
        confirmed = [0] * len(rows)
        finished: set[int] = {i for i, s in enumerate(rows) if s.cancelled}
        for i in finished:
            self._finish(rows[i], "abort")
        active = [i for i in range(len(rows)) if i not in finished]
        for col in range(width):
            if not active:
                break
            steps = sample_step(
                logits[[first[i] + col for i in active]],
                [rows[i].params for i in active],
                [rows[i].generator for i in active],
                self._default_gen,
                allowed_tokens([rows[i] for i in active]),
            )
            going_on = []
            for i, step in zip(active, steps):
                if self._append(rows[i], step):
                    finished.add(i)
                elif col < len(proposals[i]) and step.token == proposals[i][col]:
                    confirmed[i] += 1
                    going_on.append(i)
            active = going_on
        start = mask.shape[1] - width
        st = self.stats
        for i, n in enumerate(confirmed):
            mask[i, start + 1 + n :] = 0  # the row's last token and its confirmed ones stay
            if rows[i].constraint is not None:
                st.forced_tokens += n
            elif proposals[i]:
                rows[i].proposal_budget = next_budget(self.speculative_tokens, n)
                st.proposed_tokens += len(proposals[i])
                st.accepted_tokens += n
        st.verify_steps += 1
        self._end_step(rows, [i for i in range(len(rows)) if i not in finished], t0, joining)
