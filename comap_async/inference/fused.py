"""A fused forward pass for Llama-family decoders: the embedded server's fast path on CPU.

A decode step of a 135M model spends little time in arithmetic and much in dispatch: transformers'
forward plus peft's LoRA wrappers run ~100 small ops per layer, seven separate projections, and an
attention kernel tuned for long prompts. This forward reads the same weights, fused and in the
inference dtype (bf16 on CPUs with bf16 instructions, where a small-batch GEMM runs about twice as
fast as in fp32), with

* one GEMM for q, k and v and one for gate and up, weights stored ``[in, out]``;
* the residual stream, norms, rotary embedding and softmax in fp32, so bf16 only rounds the GEMM
  inputs and the KV cache;
* LoRA as two small fp32 GEMMs per projection over the adapters present in the batch: a step's
  rows gather their adapters once per batch composition (the "dense-active" matrices, cached until
  a row joins or leaves or a slot's weights change) instead of one gather and ``bmm`` per layer;
* attention written out for grouped queries (a 1-token query needs no flash kernel).

It shares the engine's KV cache (:class:`BatchCache`) and the LoRA stacks that the slot manager
keeps in sync with peft, so adapters load exactly as on the reference path. Architectures it does
not know (biases, sliding windows, per-head norms) are refused by :func:`fused_support`, and the
server then runs transformers' forward.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from comap_async.inference.lora_stack import LoraStacks

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# projections reading the same input, applied with one A and one B GEMM per layer
GROUPS = (
    ("qkv", ("q_proj", "k_proj", "v_proj")),
    ("o", ("o_proj",)),
    ("gu", ("gate_proj", "up_proj")),
    ("down", ("down_proj",)),
)
_FUSED_TYPES = {"llama"}


def fused_support(model: torch.nn.Module) -> str | None:
    """None when the fused forward reproduces this model; otherwise why not (for the log)."""
    cfg = model.config.get_text_config()
    kind = getattr(cfg, "model_type", None)
    if kind not in _FUSED_TYPES:
        return f"model_type {kind!r} (the fused forward knows {sorted(_FUSED_TYPES)})"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "attention or MLP biases"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    return None


class Weight:
    """A frozen ``[out, in]`` weight, prepacked for oneDNN where torch has it.

    Streaming a decode step's weights is the bound here, and an unpacked GEMM reorders its weight on
    every call: prepacked, a batch-8 GEMM reads weights at about twice the rate (12 vs 6.8 GB/s in
    bf16 on this project's CPUs; ``benchmarks/serve_batching.py --breakdown`` measures it).
    """

    def __init__(self, w: torch.Tensor, dtype: torch.dtype, batch_hint: int) -> None:
        self.dense = w.detach().to(dtype).contiguous()
        self.nbytes = self.dense.numel() * self.dense.element_size()
        self.packed = None
        if torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.dense, batch_hint)
            except (RuntimeError, AttributeError):  # a torch built without these ops: the plain GEMM
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [None], "")
        return F.linear(x, self.dense)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, transformers' ``x * cos + rotate_half(x) * sin`` in three ops.

    ``x`` ``[B, T, H, D]``; cos and ``sin_signed`` (sin with its first half negated) ``[B, T, 1, D]``.
    """
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), dim=-1), sin_signed)


def attention_bias(mask: torch.Tensor, new_tokens: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive bias ``[B, 1, 1, T, N]``: padding columns (mask 0) and future tokens get the dtype's minimum.

    Finite on purpose: a padding query sees no real key, and an all ``-inf`` row would make NaN keys
    and values that a later ``0 * NaN`` spreads into real rows.
    """
    b, n = mask.shape
    allowed = mask.bool()[:, None, :]  # [B, 1, N]
    if new_tokens > 1:
        j = torch.arange(n)
        t = torch.arange(new_tokens).unsqueeze(1)
        allowed = allowed & (j <= n - new_tokens + t)  # [B, T, N]
    else:
        allowed = allowed.expand(b, 1, n)
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias[:, None, None]


def attend(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention -> ``[B*T, Hq*D]``.

    ``q`` ``[B, T, Hq, D]`` already scaled; ``keys_t`` ``[B, Hkv, D, N]`` (a transposed cache), ``values``
    ``[B, Hkv, N, D]``; ``bias`` ``[B*Hkv, G*T, W]`` (:func:`attention_bias` expanded, in q's dtype) over
    the last ``W`` columns, every query seeing all the columns before them (a prompt with no padding: its
    causal corner), or None when every query sees every column.
    Query head ``h`` reads key/value head ``h // G`` (G = Hq / Hkv), as in transformers. Scores
    are rounded to q's dtype by the GEMM; the softmax accumulates in fp32 whatever its input.
    """
    b, t, hq, d = q.shape
    hkv, n = keys_t.shape[1], keys_t.shape[-1]
    g = hq // hkv
    qh = q.reshape(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b * hkv, g * t, d)
    if bias is not None and bias.shape[-1] == n:
        scores = torch.baddbmm(bias, qh, keys_t.reshape(b * hkv, d, n))
    else:  # the columns every query sees need no bias copied into the scores first
        scores = torch.bmm(qh, keys_t.reshape(b * hkv, d, n))
        if bias is not None:
            scores[..., n - bias.shape[-1] :].add_(bias)
    out = torch.bmm(torch.softmax(scores, dim=-1), values.reshape(b * hkv, n, d))
    return out.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b * t, hq * d)


class _Layer:
    def __init__(self, layer: Any, dtype: torch.dtype, batch_hint: int, q_scale: float) -> None:
        self.linears = {}
        for name in PROJECTIONS:
            module = getattr(layer.self_attn if name in PROJECTIONS[:4] else layer.mlp, name)
            # peft may already have wrapped it: the stacks are keyed by the wrapped base Linear
            self.linears[name] = getattr(module, "base_layer", module)
        w = {name: lin.weight for name, lin in self.linears.items()}
        self.widths = {name: lin.out_features for name, lin in self.linears.items()}
        # scaling q here spares the attention a multiply per step (the LoRA q rows get it too)
        self.wqkv = Weight(torch.cat([w["q_proj"] * q_scale, w["k_proj"], w["v_proj"]]), dtype, batch_hint)
        self.wo = Weight(w["o_proj"], dtype, batch_hint)
        self.wgu = Weight(torch.cat([w["gate_proj"], w["up_proj"]]), dtype, batch_hint)
        self.wdown = Weight(w["down_proj"], dtype, batch_hint)
        self.norm_in = layer.input_layernorm.weight.detach().float()
        self.norm_post = layer.post_attention_layernorm.weight.detach().float()
        self.eps_in = layer.input_layernorm.variance_epsilon
        self.eps_post = layer.post_attention_layernorm.variance_epsilon


class FusedLlama:
    """Forward passes over copies of a Llama model's weights; call only from the engine thread."""

    def __init__(
        self, model: torch.nn.Module, stacks: LoraStacks | None, dtype: torch.dtype, batch_hint: int = 8
    ) -> None:
        reason = fused_support(model)
        if reason is not None:
            raise ValueError(f"the fused forward does not support this model: {reason}")
        cfg = model.config.get_text_config()
        inner = model.model
        self.dtype = dtype
        self.stacks = stacks
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.inter = cfg.intermediate_size
        self.scale = self.head_dim**-0.5
        self.embed = inner.embed_tokens.weight.detach()
        self.rotary = inner.rotary_emb
        self.layers = [_Layer(layer, dtype, batch_hint, self.scale) for layer in inner.layers]
        self.norm = inner.norm.weight.detach().float()
        self.norm_eps = inner.norm.variance_epsilon
        self.lm_head = Weight(model.lm_head.weight, dtype, batch_hint)
        self._dense: OrderedDict[tuple, list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]]] = OrderedDict()

    @property
    def lora_targets(self) -> frozenset[int]:
        """Ids of the base Linear modules whose LoRA this forward applies (for ``SlotManager.fused_targets``)."""
        return frozenset(id(lin) for layer in self.layers for lin in layer.linears.values())

    @property
    def weight_bytes(self) -> int:
        """Bytes one decode step streams from memory for the weights (layers and LM head)."""
        ws = [w for lay in self.layers for w in (lay.wqkv, lay.wo, lay.wgu, lay.wdown)] + [self.lm_head]
        return sum(w.nbytes for w in ws)

    # ------------------------------------------------------------------ LoRA
    def _lora(self, token_rows: torch.Tensor | None) -> "LoraBatch | None":
        """The LoRA of this forward's adapters (``token_rows``: each token's stack row, 0 = the base model),
        or None when every token is on the base model."""
        if token_rows is None or self.stacks is None:
            return None
        active = sorted(set(token_rows.unique().tolist()) - {0})
        if not active:
            return None
        stacks = self.stacks
        with stacks.lock:
            key = stacks.key(active)
            dense = self._dense.get(key)
            if dense is None:
                dense = self._dense[key] = self._build_dense(active, stacks.rank)
                while len(self._dense) > 8:
                    self._dense.popitem(last=False)
            else:
                self._dense.move_to_end(key)
            r = stacks.rank
        if len(active) == 1 and bool((token_rows != 0).all()):
            return LoraBatch(dense, None)  # one adapter on every token: nothing to mask
        # column block i of a group's A (r columns) belongs to active slot i
        onehot = (token_rows.unsqueeze(1) == torch.tensor(active).unsqueeze(0)).float()
        return LoraBatch(dense, onehot.repeat_interleave(r, dim=1))

    def _build_dense(self, active: list[int], r: int) -> list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]]:
        """Per layer and group: (A ``[in, k*n*r]``, block-diagonal B ``[k*n*r, out]``, k) over the active slots.

        Projections that read the same input share one A GEMM and one B GEMM; the zero blocks of B
        cost less than the extra ops of one GEMM pair per projection.
        """
        idx = torch.tensor(active, dtype=torch.long)
        nr = len(active) * r
        out = []
        for layer in self.layers:
            groups = {}
            for group, names in GROUPS:
                widths = [layer.widths[name] for name in names]
                stacks = [self.stacks.by_base.get(id(layer.linears[name])) for name in names]
                present = [(i, st) for i, st in enumerate(stacks) if st is not None]
                if not present:
                    continue
                a_cols, b = [], torch.zeros(len(present) * nr, sum(widths))
                for j, (i, st) in enumerate(present):
                    a = st.a.index_select(0, idx).float()  # [n, in, r]
                    a_cols.append(a.permute(1, 0, 2).reshape(a.shape[1], nr))
                    bi = st.b.index_select(0, idx).float().reshape(nr, widths[i])
                    if names[i] == "q_proj":
                        bi = bi * self.scale
                    start = sum(widths[:i])
                    b[j * nr : (j + 1) * nr, start : start + widths[i]] = bi
                groups[group] = (torch.cat(a_cols, dim=1).contiguous(), b, len(present))
            out.append(groups)
        return out

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
        rows: torch.Tensor | None,
        last_only: bool = True,
        real: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` (fp32) of each row's last token; keys/values are appended to ``cache``.

        ``input_ids``/``positions`` ``[B, T]``; ``mask`` ``[B, N]`` covers the cached and new tokens;
        ``rows``: each row's LoRA stack row (0 = base model) or None when every row is on the base.
        ``last_only`` False: the logits of every position, ``[B*T, vocab]``; with ``real`` (indices into
        the flattened ``[B*T]`` positions) of those positions only, ``[len(real), vocab]``: the others
        (a verify step's padding) are left out of every matrix product and get zero keys and values.
        """
        return self.forward_parts([Part(input_ids, positions, mask, cache, rows, last_only, real)])[0]

    @torch.inference_mode()
    def forward_parts(self, parts: list["Part"]) -> list[torch.Tensor]:
        """One forward over several batches, each with its own KV cache (the running batch's decode step
        and the prompts joining it): every projection is one GEMM over all their tokens, so the weights
        are read once; attention stays within each part. Returns each part's logits as :meth:`forward`."""
        for p in parts:
            if not getattr(p.cache, "transposed", False):
                raise ValueError("the fused forward needs a BatchCache(transposed=True)")
        wd, d, half = self.dtype, self.head_dim, self.head_dim // 2
        hkv, g = self.kv_heads, self.heads // self.kv_heads
        flat_ids, flat_pos, token_rows, sizes = [], [], [], []
        for p in parts:
            b, t = p.input_ids.shape
            ids, pos = p.input_ids.reshape(-1), p.positions.reshape(-1)
            rows = None if p.rows is None else p.rows.repeat_interleave(t)
            if p.real is not None:
                ids, pos = ids.index_select(0, p.real), pos.index_select(0, p.real)
                rows = None if rows is None else rows.index_select(0, p.real)
            flat_ids.append(ids)
            flat_pos.append(pos)
            token_rows.append(torch.zeros(ids.numel(), dtype=torch.long) if rows is None else rows)
            sizes.append(ids.numel())
        ids, pos = torch.cat(flat_ids), torch.cat(flat_pos)
        h = F.embedding(ids, self.embed).float()
        cos_all, sin_all = self.rotary(h.unsqueeze(0), pos.unsqueeze(0))
        cos_all = cos_all[0].to(wd)
        sin_all = torch.cat((-sin_all[0, :, :half], sin_all[0, :, half:]), dim=-1).to(wd)
        per_part, start = [], 0  # rotary tables, attention bias and token range of each part
        for p, n in zip(parts, sizes):
            cos, sin = cos_all[start : start + n], sin_all[start : start + n]
            if p.real is None:
                cos, sin = cos.view(*p.input_ids.shape, -1), sin.view(*p.input_ids.shape, -1)
            b, t = p.input_ids.shape
            # no padding (a prompt, or rows of one length): only the new tokens' causal corner is masked
            mask = p.mask[:, -t:] if bool(p.mask.all()) else p.mask
            bias = None
            if t > 1 or mask.shape[1] > 1:
                width = mask.shape[1]
                bias = attention_bias(mask, t, wd).expand(b, hkv, g, t, width).reshape(b * hkv, g * t, width)
            per_part.append((cos.unsqueeze(-2), sin.unsqueeze(-2), bias, start, start + n))
            start += n
        lora = self._lora(torch.cat(token_rows) if any(p.rows is not None for p in parts) else None)
        hidden, qs, kvs = h.shape[-1], self.q_size, self.kv_size
        for i, layer in enumerate(self.layers):
            xf = F.rms_norm(h, (hidden,), layer.norm_in, layer.eps_in)
            qkv = layer.wqkv(xf.to(wd))  # the q rows of the weight carry the 1/sqrt(head_dim) scale
            if lora is not None:
                lora.apply(qkv, xf, i, "qkv")
            outs = []
            for p, (cos, sin, bias, s, e) in zip(parts, per_part):
                part_qkv = qkv[s:e]
                b, t = p.input_ids.shape
                if p.real is None:
                    qk = rotate(part_qkv[:, : qs + kvs].view(b, t, -1, d), cos, sin)
                    v = part_qkv[:, qs + kvs :].view(b, t, hkv, d).transpose(1, 2)
                else:  # rotated per real token, then laid out [B, T] with zeros at the padding
                    qk_real = rotate(part_qkv[:, : qs + kvs].view(-1, self.heads + hkv, d), cos, sin)
                    qk = qk_real.new_zeros(b * t, self.heads + hkv, d).index_copy_(0, p.real, qk_real)
                    qk = qk.view(b, t, -1, d)
                    v_real = part_qkv[:, qs + kvs :].reshape(-1, kvs)
                    v = v_real.new_zeros(b * t, kvs).index_copy_(0, p.real, v_real)
                    v = v.view(b, t, hkv, d).transpose(1, 2)
                keys_t, values = p.cache.layers[i].update(qk[:, :, self.heads :].transpose(1, 2), v)
                a = attend(qk[:, :, : self.heads], keys_t, values, bias)
                outs.append(a if p.real is None else a.index_select(0, p.real))
            a = outs[0] if len(outs) == 1 else torch.cat(outs)
            o = layer.wo(a)
            if lora is not None:
                lora.apply(o, a.float(), i, "o")
            h.add_(o)
            xf = F.rms_norm(h, (hidden,), layer.norm_post, layer.eps_post)
            gu = layer.wgu(xf.to(wd))
            if lora is not None:
                lora.apply(gu, xf, i, "gu")
            act = F.silu(gu[:, : self.inter]).mul_(gu[:, self.inter :])
            down = layer.wdown(act)
            if lora is not None:
                lora.apply(down, act.float(), i, "down")
            h.add_(down)
        keep, counts = [], []
        for p, (_, _, _, s, e) in zip(parts, per_part):
            if p.last_only and p.real is None:
                b, t = p.input_ids.shape
                keep.append(torch.arange(s + t - 1, e, t))
            else:
                keep.append(torch.arange(s, e))
            counts.append(keep[-1].numel())
        if sum(counts) != h.shape[0]:
            h = h.index_select(0, torch.cat(keep))
        h = F.rms_norm(h, (h.shape[-1],), self.norm, self.norm_eps)
        logits = self.lm_head(h.to(wd)).float()
        return list(logits.split(counts))


@dataclass
class Part:
    """One batch of a fused forward (:meth:`FusedLlama.forward_parts`), with :meth:`FusedLlama.forward`'s arguments."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    cache: Any
    rows: torch.Tensor | None
    last_only: bool = True
    real: torch.Tensor | None = None


class LoraBatch:
    """One forward's LoRA: the active adapters' dense matrices and which rows use which (``onehot``)."""

    def __init__(
        self, dense: list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]], onehot: torch.Tensor | None
    ) -> None:
        self.dense = dense
        self.masks = {} if onehot is None else {k: onehot.repeat(1, k) if k > 1 else onehot for k in (1, 2, 3)}

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> None:
        """``out += ((x @ A) * mask) @ B`` for this layer's group (x in fp32, out in any dtype)."""
        mats = self.dense[layer].get(group)
        if mats is None:
            return
        a, b, k = mats
        xa = x @ a
        if self.masks:
            xa.mul_(self.masks[k])
        out.add_(xa @ b)
