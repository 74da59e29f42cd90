"""The learner's batches: sequences packed into rows for one forward pass (:func:`pack`), and
micro-batches cut by token budget (:func:`chunk_by_tokens`). The dense reference batches of the test
oracle are tests/fixtures/reference_path.py's ``collate``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from learner.batches import Seq


@dataclass
class Packed:
    """Sequences packed into rows for one forward pass, with the positions that carry a loss.

    A *unit* is one prompt and the targets that continue it (the world model's CE target
    ``s_next`` and its rollout ``s_hat_exec`` share the prompt ``(s, a_exec)``): the prompt is in
    the row once, each target attends to the prompt and to itself only, and its position ids
    continue the prompt's, so every target sees exactly the sequence ``prompt + target`` it
    would see alone. Units are packed first-fit by decreasing length into rows as wide as the
    longest unit; a row's units do not see each other (a block-diagonal mask).

    Per target token ``k`` (in the order of the sequences given to :func:`pack`): ``rows[k]``,
    ``cols[k]``: the position whose output predicts it; ``targets[k]``: the token; ``owner[k]``:
    its sequence's index. ``first[i]`` is the index of sequence i's first target token (its
    ``cols`` is the position before the target: the reflection's decision position).
    """

    input_ids: torch.Tensor  # [R, W]
    position_ids: torch.Tensor  # [R, W]
    attention_mask: torch.Tensor  # [R, 1, W, W] bool, True = may attend
    rows: torch.Tensor  # [N]
    cols: torch.Tensor  # [N]
    targets: torch.Tensor  # [N]
    owner: torch.Tensor  # [N]
    first: list[int]
    counts: list[int]
    change: torch.Tensor | None  # [N] bool: is target token k a change token (None: no sequence has flags)
    tokens: int  # the sequences' own tokens (sum of their lengths, as the reference computation counts them)
    layout: list[
        list[Unit]
    ]  # per row, its units: what ``attention_mask`` says, for learner.peft_model.packed_attention


@dataclass
class Unit:
    """Where one unit lies in its row: the prompt at ``[offset, offset + prompt)``, then each
    target (branch) ``(start, length, mask)``; ``mask`` [length, start + length - offset] says which
    of the keys from ``offset`` on the branch's queries see (the prompt, and itself causally)."""

    offset: int
    prompt: int
    branches: list[tuple[int, int, torch.Tensor]]


def _units_share_prompt(unit: Sequence[Seq]) -> bool:
    head = unit[0].ids[: unit[0].start]
    return all(s.start == unit[0].start and s.ids[: s.start] == head for s in unit)


def unit_length(unit: Sequence[Seq]) -> int:
    """Positions a unit takes in its row: the prompt once, then each target (:func:`pack`)."""
    return unit[0].start + sum(s.n_target for s in unit)


def first_fit(lengths: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
    """(row, column) of each unit of ``lengths``, and the number of rows: first-fit by decreasing
    length into rows as wide as the longest unit (:func:`pack`'s layout, computed without tensors so
    that the padding of a batch can be counted without building it)."""
    width = max(lengths)
    free: list[int] = []  # room left in each row
    placed: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if row is None:
            row = len(free)
            free.append(width)
        placed[i] = (row, width - free[row])
        free[row] -= lengths[i]
    return placed, len(free)


def pack(units: Sequence[Sequence[Seq]], pad_id: int, device: str | torch.device = "cpu") -> Packed:
    """Pack ``units`` (each a list of sequences with the same prompt) into rows; see :class:`Packed`.

    Only a sequence's target tokens ``ids[start: start + n_target]`` are placed: later tokens
    (a rollout longer than its teacher's) carry no loss and, the model being causal, change
    nothing before them.
    """
    seqs = [s for u in units for s in u]
    for u in units:
        if not u or not _units_share_prompt(u):
            raise ValueError("every sequence of a unit must have the same prompt")
        if u[0].start < 1:
            raise ValueError("a sequence needs at least one prompt token before its target")
    lengths = [unit_length(u) for u in units]
    width = max(lengths)
    placed, n_rows = first_fit(lengths)
    ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    pos = torch.zeros((n_rows, width), dtype=torch.long)
    segment = torch.full((n_rows, width), -1, dtype=torch.long)  # which unit a position holds (-1: padding)
    branch = torch.zeros((n_rows, width), dtype=torch.long)  # 0: the prompt, k: the unit's k-th target
    rows, cols, targets, owner, change, first, counts = [], [], [], [], [], [], []
    layout: list[list[Unit]] = [[] for _ in range(n_rows)]
    k = 0
    for u_idx, (unit, (r, c)) in enumerate(zip(units, placed)):
        p = unit[0].start
        layout[r].append(Unit(c, p, []))
        ids[r, c : c + p] = torch.tensor(unit[0].ids[:p])
        pos[r, c : c + p] = torch.arange(p)
        segment[r, c : c + p] = u_idx
        at = c + p
        for b, s in enumerate(unit, start=1):
            n = s.n_target
            ids[r, at : at + n] = torch.tensor(s.ids[p : p + n])
            pos[r, at : at + n] = torch.arange(p, p + n)
            segment[r, at : at + n] = u_idx
            branch[r, at : at + n] = b
            first.append(len(targets))
            # target token j is predicted by the position before it: the prompt's last for j = 0
            keep = s.loss if s.loss is not None else [True] * n
            counts.append(sum(keep))
            before = [c + p - 1] + list(range(at, at + n - 1))
            flags = s.change if s.change is not None else [False] * n
            for j in (j for j in range(n) if keep[j]):
                rows.append(r)
                cols.append(before[j])
                targets.append(s.ids[p + j])
                owner.append(k)
                change.append(flags[j])
            seen = torch.zeros((n, at + n - c), dtype=torch.bool)
            seen[:, :p] = True
            seen[:, at - c :] = torch.ones((n, n), dtype=torch.bool).tril()
            layout[r][-1].branches.append((at, n, seen.to(device)))
            k += 1
            at += n
    same = (segment.unsqueeze(2) == segment.unsqueeze(1)) & (segment.unsqueeze(2) >= 0)
    visible = (branch.unsqueeze(1) == 0) | (branch.unsqueeze(2) == branch.unsqueeze(1))
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = same & visible & causal
    mask |= torch.eye(width, dtype=torch.bool)  # padding sees itself: no row of the softmax is empty
    return Packed(
        input_ids=ids.to(device),
        position_ids=pos.to(device),
        attention_mask=mask.unsqueeze(1).to(device),
        rows=torch.tensor(rows, device=device),
        cols=torch.tensor(cols, device=device),
        targets=torch.tensor(targets, device=device),
        owner=torch.tensor(owner, device=device),
        first=first,
        counts=counts,
        change=torch.tensor(change, device=device) if any(s.change is not None for s in seqs) else None,
        tokens=sum(len(s.ids) for s in seqs),
        layout=[sorted(units_of_row, key=lambda u: u.offset) for units_of_row in layout],
    )


def chunk_by_tokens(budget: int, units: list, length: Any) -> list[list]:
    """``units`` in groups of at most ``budget`` tokens (``learner.chunk_tokens``; longest first, so a
    chunk's rows are alike); one group when it is 0."""
    if budget <= 0:
        return [units]
    chunks: list[list] = []
    size = 0
    for unit in sorted(units, key=length, reverse=True):
        n = length(unit)
        if not chunks or size + n > budget:
            chunks.append([])
            size = 0
        chunks[-1].append(unit)
        size += n
    return chunks
