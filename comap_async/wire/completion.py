"""The inference API's completion responses as typed objects (OpenAI's completions shape: the embedded
server's and vLLM's), readable by key too for callers that treat them as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class _Fields:
    """Read access by key too (``resp["choices"][0]["text"]``, ``.get``), for callers that treat responses as JSON."""

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


@dataclass
class Logprobs(_Fields):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


@dataclass
class Choice(_Fields):
    index: int
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: Logprobs | None = None


@dataclass
class Completion(_Fields):
    id: str
    model: str
    choices: list[Choice]
    usage: dict[str, Any]
    endpoint: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def text(self) -> str:
        return self.choices[0].text

    @classmethod
    def from_json(cls, body: dict[str, Any], endpoint: str = "") -> "Completion":
        choices = []
        for c in body.get("choices") or []:
            lp = c.get("logprobs")
            logprobs = (
                Logprobs(
                    lp.get("tokens") or [],
                    lp.get("token_logprobs") or [],
                    lp.get("top_logprobs") or [],
                    lp.get("text_offset") or [],
                )
                if lp
                else None
            )
            choices.append(
                Choice(
                    c.get("index", len(choices)),
                    c.get("text", ""),
                    c.get("finish_reason"),
                    c.get("stop_reason"),
                    logprobs,
                )
            )
        return cls(body.get("id", ""), body.get("model", ""), choices, body.get("usage") or {}, endpoint, body)
