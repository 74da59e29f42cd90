"""Decoding constrained to a list of choices (vLLM's ``structured_outputs: {"choice": [...]}``).

The embedded server's form of it: the choices' token ids in a trie; at each step a sequence may
only take a token that continues some choice along what it generated so far, or end (an
end-of-sequence token) where a choice is complete. Under greedy decoding the output is the choice
the model's own next-token preferences lead to; when the unconstrained greedy output is already a
choice the two are the same (every step's argmax is allowed). Reported logprobs stay the model's
raw ones, as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from comap_async.wire.inference_client import MAX_CHOICES

MAX_CHOICE_CHARS = 512


class ChoiceTrie:
    """The token-id prefixes of a set of choices; a node's ``None`` key marks a complete choice."""

    def __init__(self, choice_ids: Iterable[Sequence[int]], end_ids: Iterable[int]) -> None:
        self.root: dict[Any, Any] = {}
        self.end_ids = sorted(set(end_ids))
        if not self.end_ids:
            raise ValueError("decoding to a list of choices needs the model's end-of-sequence token")
        for ids in choice_ids:
            node = self.root
            for tok in ids:
                node = node.setdefault(tok, {})
            node[None] = True

    def _node(self, generated: Sequence[int]) -> dict[Any, Any] | None:
        """Where ``generated`` leads in the trie (None once it left it)."""
        node = self.root
        for tok in generated:
            node = node.get(tok)
            if node is None:
                return None
        return node

    def _next(self, node: dict[Any, Any]) -> list[int]:
        out = [t for t in node if t is not None]
        if None in node:
            out.extend(self.end_ids)
        return out

    def allowed(self, generated: Sequence[int]) -> list[int]:
        """The tokens a sequence that generated ``generated`` may take next ([] once it left the trie,
        which the engine never lets it do)."""
        node = self._node(generated)
        return [] if node is None else self._next(node)

    def forced(self, generated: Sequence[int], k: int) -> list[int]:
        """The next tokens (at most ``k``) the choices leave no alternative to after ``generated``: each
        the only allowed one, up to and including a sole end-of-sequence token."""
        node = self._node(generated)
        out: list[int] = []
        while node is not None and len(out) < k:
            nxt = self._next(node)
            if len(nxt) != 1:
                break
            out.append(nxt[0])
            node = node.get(nxt[0])  # None after an end token: nothing follows a complete choice
        return out


def parse_choices(body: dict[str, Any]) -> tuple[str, ...] | None:
    """The ``structured_outputs.choice`` list of a request body (None without one); raises ValueError
    with a one-line message for anything the embedded server does not support."""
    spec = body.get("structured_outputs")
    if spec is None:
        if "guided_choice" in body:
            raise ValueError("'guided_choice' was removed in vLLM 0.12: send structured_outputs={'choice': [...]}")
        return None
    if not isinstance(spec, dict):
        raise ValueError("'structured_outputs' must be an object")
    other = sorted(k for k, v in spec.items() if k != "choice" and v is not None)
    if other:
        raise ValueError(f"the embedded server supports only structured_outputs.choice, not {', '.join(other)}")
    choice = spec.get("choice")
    if (
        not isinstance(choice, list)
        or not choice
        or len(choice) > MAX_CHOICES
        or not all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in choice)
    ):
        raise ValueError(
            f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty strings "
            f"of at most {MAX_CHOICE_CHARS} characters"
        )
    return tuple(dict.fromkeys(choice))
