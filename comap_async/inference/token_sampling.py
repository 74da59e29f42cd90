"""Sampling parameters of a completion request (validated like vLLM's) and per-step sampling.

Logprobs are the model's raw log-softmax, before temperature and top-p/top-k, as vLLM reports them
by default: the actor's ``p_revise`` must be the policy's probability, not the sampler's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from comap_async.config.base import PRIORITY_MAX, PRIORITY_MIN
from comap_async.inference.choices import parse_choices

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_N = 16


class RequestError(ValueError):
    """A client mistake: becomes an HTTP 4xx with this message (and ``param`` when one field is at fault)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.err_type = err_type or {
            400: "BadRequestError",
            401: "AuthenticationError",
            404: "NotFoundError",
            413: "BadRequestError",
            503: "ServiceUnavailableError",
        }.get(status, "BadRequestError")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1: disabled (vLLM accepts both)."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    n: int
    params: SamplingParams
    return_tokens_as_token_ids: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    choices: tuple[str, ...] | None = None
    """``structured_outputs.choice``: the output is exactly one of these (:mod:`.choices`)."""
    constraint: Any = None
    """The choices' :class:`~comap_async.inference.choices.ChoiceTrie`, built once the server tokenized them."""
    priority: int = 0
    """vLLM's ``priority`` field: lower is admitted first (:attr:`~comap_async.inference.engine.Sequence.priority`)."""


def _number(
    body: dict,
    key: str,
    default: Any,
    kind: type,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise RequestError(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=key)
    if value != value or value in (float("inf"), float("-inf")):
        raise RequestError(f"'{key}' must be finite, got {value!r}", param=key)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise RequestError(f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {value}", param=key)
    if hi is not None and value > hi:
        raise RequestError(f"'{key}' must be <= {hi}, got {value}", param=key)
    return kind(value)


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be true or false, got {value!r}", param=key)
    return value


def _prompts(raw: Any) -> list[str | list[int]]:
    """OpenAI accepts a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw:
        if all(isinstance(p, str) for p in raw):
            return list(raw)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            return [list(raw)]
        if all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in raw
        ):
            return [list(p) for p in raw]
    raise RequestError("'prompt' must be a non-empty string, list of strings, or list of token ids", param="prompt")


def parse_completion_request(body: Any, max_new_tokens: int) -> CompletionRequest:
    """Validate a ``/v1/completions`` JSON body; raises :class:`RequestError` with a message."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    if "prompt" not in body:
        raise RequestError("'prompt' is required", param="prompt")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {model!r}", param="model")
    if body.get("stream") is not None and not isinstance(body.get("stream"), bool):
        raise RequestError("'stream' must be true or false", param="stream")
    if body.get("echo"):
        raise RequestError("'echo' is not supported by the embedded server", param="echo")
    if body.get("suffix"):
        raise RequestError("'suffix' is not supported", param="suffix")
    best_of = body.get("best_of")
    if best_of not in (None, 1, body.get("n", 1)):
        raise RequestError("'best_of' other than n is not supported", param="best_of")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise RequestError("'stop' must be a non-empty string or a list of at most 16 non-empty strings", param="stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise RequestError("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int):
            raise RequestError(
                f"'logprobs' must be an integer (top-k alternatives), got {logprobs!r}", param="logprobs"
            )
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise RequestError(f"'logprobs' must be between 0 and {MAX_LOGPROBS}, got {logprobs}", param="logprobs")
    top_k = _number(body, "top_k", 0, int, -1)
    try:
        choices = parse_choices(body)
    except ValueError as exc:
        raise RequestError(str(exc), param="structured_outputs") from None
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"'seed' must be an integer, got {seed!r}", param="seed")
    params = SamplingParams(
        max_tokens=_number(body, "max_tokens", 16, int, 1, max_new_tokens),
        temperature=_number(body, "temperature", 1.0, float, 0.0, 100.0),
        top_p=_number(body, "top_p", 1.0, float, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k == -1 else top_k,
        seed=seed,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_flag(body, "ignore_eos", False),
        logprobs=logprobs,
        include_stop_str_in_output=_flag(body, "include_stop_str_in_output", False),
        skip_special_tokens=_flag(body, "skip_special_tokens", True),
    )
    if choices is not None and params.ignore_eos:
        raise RequestError("structured_outputs.choice ends at a complete choice: drop 'ignore_eos'", param="ignore_eos")
    return CompletionRequest(
        model=model,
        prompts=_prompts(body["prompt"]),
        n=_number(body, "n", 1, int, 1, MAX_N),
        params=params,
        return_tokens_as_token_ids=_flag(body, "return_tokens_as_token_ids", False),
        choices=choices,
        priority=_number(body, "priority", 0, int, PRIORITY_MIN, PRIORITY_MAX),
    )


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed % (1 << 63))
    return g


@dataclass
class StepOutput:
    token: int
    logprob: float
    top: list[tuple[int, float]]
    """The ``k`` most likely tokens and their logprobs (empty when logprobs were not requested)."""


def sample_step(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
    allowed: list[list[int] | None] | None = None,
) -> list[StepOutput]:
    """Pick one token per row of ``logits`` ``[batch, vocab]`` with each row's own sampling parameters.

    ``allowed``: per row, the only tokens it may take (decoding to a list of choices), or None; the
    reported logprobs stay the unmasked model's.
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    if allowed is not None and any(a is not None for a in allowed):
        logits = logits.clone()
        for i, ids in enumerate(allowed):
            if ids is not None:
                keep = logits[i, ids]
                logits[i] = float("-inf")
                logits[i, ids] = keep
    tokens: list[int] = [0] * len(params)
    nucleus: list[int] = []
    for i, p in enumerate(params):
        if p.temperature == 0:
            tokens[i] = int(torch.argmax(logits[i]))
        elif p.top_p < 1.0 or p.top_k > 0:
            nucleus.append(i)
        else:
            g = generators[i] if generators[i] is not None else default_generator
            tokens[i] = _draw(torch.softmax(logits[i] / p.temperature, dim=-1), g)
    if nucleus:
        gens = [generators[i] if generators[i] is not None else default_generator for i in nucleus]
        picked = sample_top(logits[nucleus], [params[i] for i in nucleus], gens)
        for i, tok in zip(nucleus, picked):
            tokens[i] = tok
    kmax = max((p.logprobs or 0) for p in params)
    top_vals = top_ids = None
    if kmax > 0:
        top_vals, top_ids = torch.topk(logprobs, kmax, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    chosen = logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
    out = []
    for i, p in enumerate(params):
        k = p.logprobs or 0
        top = list(zip(top_ids[i][:k], top_vals[i][:k])) if k and top_ids is not None else []
        out.append(StepOutput(tokens[i], chosen[i], top))
    return out


def sample_top(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator], candidates: int = 256
) -> list[int]:
    """Top-p / top-k sampling of each row from its ``candidates`` most likely tokens.

    Sorting the whole vocabulary per row (49k entries for SmolLM2) cost ~4 ms a row, more than the
    batch-8 decode step itself. The nucleus is a prefix of the tokens sorted by probability, so when
    the top ``candidates`` already hold ``top_p`` of the mass (or ``top_k`` <= ``candidates``) it lies
    among them; such rows are sampled from one batched ``topk``. The draw is :func:`_draw`'s over the
    kept tokens in vocabulary order: one uniform number per row, the same distribution and the same
    token for the same number as the full sort. Other rows (a flat distribution) take the full sort.
    """
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    scaled = logits / temps
    k = min(scaled.shape[1], max(candidates, max(p.top_k for p in params)))
    vals, idx = torch.topk(scaled, k, dim=-1)  # descending
    probs = torch.exp(vals - torch.logsumexp(scaled, dim=-1, keepdim=True))  # under the full softmax
    cum_before = torch.cumsum(probs, dim=-1) - probs
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).unsqueeze(1)
    keep = cum_before < top_p
    keep[:, 0] = True  # the most likely token is always kept
    rank = torch.arange(k).unsqueeze(0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else k for p in params]).unsqueeze(1)
    keep &= rank < top_k
    covered = ((probs.sum(dim=-1, keepdim=True) >= top_p) | (top_k < k)).squeeze(1).tolist()
    order = torch.argsort(idx, dim=-1)  # the kept tokens in vocabulary order, as _draw's CDF runs
    ids = idx.gather(1, order)
    cdf = torch.cumsum((probs * keep).gather(1, order), dim=-1)
    u01 = torch.cat([torch.rand(1, generator=g, dtype=cdf.dtype) for g in generators])
    pos = torch.searchsorted(cdf, (u01 * cdf[:, -1]).unsqueeze(1), right=True).clamp(max=k - 1)
    picked = ids.gather(1, pos).squeeze(1).tolist()
    for i, ok in enumerate(covered):
        if not ok:  # the nucleus reaches past the candidates: sort the whole row (the draw above is unused)
            p = params[i]
            row = _filter_top(scaled[i], p.top_k, p.top_p)
            picked[i] = _draw(torch.softmax(row, dim=-1), generators[i], u01=u01[i : i + 1])
    return picked


def _draw(probs: torch.Tensor, g: torch.Generator, u01: torch.Tensor | None = None) -> int:
    # Inverse-CDF sampling: one uniform number per row (``u01`` when the caller drew it already).
    # torch.multinomial draws an exponential per vocabulary entry (49k for SmolLM2), ~1 ms per row.
    cdf = torch.cumsum(probs, dim=0)
    u = (torch.rand(1, generator=g, dtype=cdf.dtype) if u01 is None else u01) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)


def _filter_top(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(row, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k > 0:
        remove[top_k:] = True
    if top_p < 1.0:
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        cum = torch.cumsum(probs, dim=-1) - probs
        remove |= cum >= top_p
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(row).scatter_(0, order, sorted_logits)
