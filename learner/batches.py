"""Turn stored records into token tensors for each loss (the get-batch step, kept apart from learning).

Prompts come from ``comap_async.prompts`` (the same strings the actors sent to the inference
server); a target is tokenised on its own and appended, exactly as generation continues a prompt.
An over-long prompt loses tokens from its middle: the head (chat header, system prompt, task)
and the tail (current observation, admissible commands, the question) stay, the oldest history
goes; the target always survives. It is counted (``truncated``, logged as ``learner/truncated``
per step): ``learner.max_seq_len`` should cover the longest prompts (see configs/local.yaml).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from comap_async.prompts import Prompts, reflection_target
from learner.losses import IGNORE

KEEP_HEAD = 128  # kept from a truncated prompt's start: header + system prompt + task are 49-83 SmolLM2 tokens


@dataclass
class Seq:
    ids: list[int]
    start: int  # index of the first target token
    n_target: int
    change: list[bool] | None = None  # per target token: is it a change token (world-model CE only)


def change_token_flags(target_ids: Sequence[int], before_ids: Collection[int]) -> list[bool]:
    """Which target tokens are *change tokens*: tokens of the real next observation that do not
    occur in the observation before the action (``before_ids``).

    The world model's CE on ``s'`` is dominated by tokens it can copy from the state it was
    shown (``On the countertop 1, you see ...`` repeats what was there); the NLL on the other
    tokens (``wm/change_nll``, DESIGN.md section 9) follows what it predicts about the action's
    effect. A proxy on token ids, not on facts: cheap enough to log at every step.
    """
    before = set(before_ids)
    return [t not in before for t in target_ids]


@dataclass
class Encoder:
    tokenizer: Any
    prompts: Prompts
    max_seq_len: int

    def __post_init__(self) -> None:
        self.truncated = 0  # prompts cut to fit max_seq_len since the trainer last read it
        self.eos = self.tokenizer.eos_token or ""
        keep = self._ids(" KEEP")
        revise = self._ids(" REVISE")
        if not keep or not revise or keep[0] == revise[0]:
            raise ValueError("the tokenizer does not separate ' KEEP' and ' REVISE' at their first token")
        self.keep_id, self.revise_id = keep[0], revise[0]

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def seq(self, prompt: str, target: str, add_eos: bool = True) -> Seq:
        p = self._ids(prompt)
        t = self._ids(target + (self.eos if add_eos else ""))
        t = t[: max(1, self.max_seq_len // 2)]  # a runaway target must not push the prompt out entirely
        room = self.max_seq_len - len(t)
        if len(p) > room:
            self.truncated += 1
            head = min(KEEP_HEAD, room // 2)
            p = p[:head] + p[len(p) - (room - head):] if room > 0 else []
        return Seq(p + t, len(p), len(t))

    # ------------------------------------------------------------ per role
    def world_model_ce(self, r: dict[str, Any]) -> Seq:
        s = self.seq(self.prompts.world_model(r["s"], r["a_exec"]), r["s_next"])
        # the end-of-text token is never a change token; records without ``o`` count every token
        before = self._ids(r.get("o") or "") + ([self.tokenizer.eos_token_id] if self.eos else [])
        s.change = change_token_flags(s.ids[s.start: s.start + s.n_target], before)
        return s

    def world_model_rollout(self, r: dict[str, Any]) -> tuple[Seq, Seq] | None:
        """Student and teacher sequences over the stored student rollout ``s_hat_exec`` (None if empty)."""
        if not r.get("s_hat_exec", "").strip():
            return None
        student = self.seq(self.prompts.world_model(r["s"], r["a_exec"]), r["s_hat_exec"], add_eos=False)
        teacher = self.seq(self.prompts.teacher(r["s"], r["a_exec"], r["s_next"]), r["s_hat_exec"], add_eos=False)
        n = min(student.n_target, teacher.n_target)
        return Seq(student.ids, student.start, n), Seq(teacher.ids, teacher.start, n)

    def draft(self, r: dict[str, Any]) -> Seq:
        return self.seq(self.prompts.draft(r["s"]), r["target"])

    def reflection(self, r: dict[str, Any]) -> Seq:
        decision = "REVISE" if int(r["y"]) == 1 else "KEEP"
        return self.seq(self.prompts.reflect(r["s"], r["a_draft"], r["s_bar"]), reflection_target(decision, r["target"]))


def collate(seqs: list[Seq], pad_id: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Left-padded ``input_ids``, ``attention_mask``, ``position_ids``, ``labels`` (targets only),
    and each row's target span (``starts`` are positions in the padded row).

    Left padding puts every target in the last positions of its row, so the model computes the
    vocabulary projection only for the last ``keep`` positions (:func:`logits_window`): with a
    49k vocabulary that projection would otherwise dominate the learner's memory.
    """
    width = max(len(s.ids) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    starts = []
    for i, s in enumerate(seqs):
        pad = width - len(s.ids)
        ids[i, pad:] = torch.tensor(s.ids)
        attn[i, pad:] = 1
        start = pad + s.start
        labels[i, start: start + s.n_target] = ids[i, start: start + s.n_target]
        starts.append(start)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    out = {
        "input_ids": ids.to(device), "attention_mask": attn.to(device), "position_ids": positions.to(device),
        "labels": labels.to(device), "starts": torch.tensor(starts, device=device),
        "lengths": torch.tensor([s.n_target for s in seqs], device=device),
    }
    if any(s.change is not None for s in seqs):  # labels of the change tokens only (-100 elsewhere)
        change = labels.clone()
        for i, (s, start) in enumerate(zip(seqs, starts)):
            keep = torch.tensor(s.change if s.change is not None else [False] * s.n_target, dtype=torch.bool)
            change[i, start: start + s.n_target][~keep] = IGNORE
        out["change_labels"] = change.to(device)
    return out


def logits_window(batch: dict[str, torch.Tensor]) -> int:
    """How many final positions need logits: from the one predicting the earliest target token on."""
    width = batch["input_ids"].shape[1]
    return int(width - batch["starts"].min().item() + 1)
