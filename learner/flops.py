"""Model FLOPs and padding of the learner's micro-batches: the arithmetic behind
``benchmarks/gpu_learner_fit.py --mfu`` (pure functions, tested in tests/unit/test_mfu.py).

**Model FLOPs of LoRA fine-tuning on a frozen base.** A matmul of a token with a weight of ``n``
parameters is ``2n`` FLOPs. The forward pass is ``2N`` per token. The backward pass computes the
gradient with respect to the activations (``2N``, to reach the adapters of lower layers) but not the
frozen weights' own gradients (the ``2N`` a full fine-tune adds), so a trained token is ``4N``, not the
``6N`` of full training. The adapters (``N_lora``, one role's) are trained: ``6 N_lora``. Attention has no
weights: its score and value matmuls are ``4 L d_attn T`` per token forward (``L`` layers, ``d_attn``
= heads x head_dim, ``T`` the sequence the token attends over) and twice that backward, ``12 L d_attn T``
in all, counted over the whole sequence as in PaLM's appendix B (a causal kernel computes about half).
Per trained token::

    4 N + 6 N_lora + 12 L d_attn T      (+ 4 d V at a position projected onto the vocabulary)

and ``2 N + 2 N_lora + 4 L d_attn T (+ 2 d V)`` per token of a pass without backward (the EMA teacher's).
``N`` counts the decoder layers' matmul weights only: the embedding lookup is no matmul, and the fast
path projects onto the vocabulary (``d x V``) only the positions that predict a target token, so the
head is counted there. ``T`` is the length of the token's *unit* (a prompt and the targets that continue
it, :func:`learner.packing.pack`): packed units do not attend to each other. Only real tokens count:
padding positions are computed by the card but are not model FLOPs, and neither is the forward that
activation checkpointing recomputes (MFU, not hardware FLOPs utilisation).

**MFU** = model FLOPs per second / (GPUs x the card's dense bf16 peak). **Padding share** = padded
positions / all positions of the rows a pass computes (rows x width).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Dense (no 2:4 sparsity) bf16 tensor-core peaks, TFLOPS, from NVIDIA's datasheets. Matched in order
# against torch.cuda.get_device_name(), so the more specific names come first.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200", 989.0),  # the H100's GH100 die, faster memory; GH200 too
    ("A100", 312.0),
    ("L40S", 362.0),
)


def card_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a card named as ``torch.cuda.get_device_name()`` does (None: not in the table)."""
    for key, peak in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


# Qwen3's published configurations (config.json of Qwen/Qwen3-4B and Qwen/Qwen3-8B) and a tiny model of the
# same architecture, as transformers config fields (``ModelDims.from_shape``; benchmarks/gpu_learner_fit.py
# builds random models of them)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
}


@dataclass(frozen=True)
class ModelDims:
    """What the FLOPs count needs of a decoder: its matmul weights and attention width."""

    layers: int
    hidden: int
    attn_width: int  # heads x head_dim (Qwen3-4B: 32 x 128 = 4096, wider than its 2560 hidden size)
    vocab: int
    params: int  # the decoder layers' matmul weights (N)
    lora_params: int  # one adapter's (N_lora): one role is trained per pass

    @classmethod
    def from_shape(cls, shape: dict[str, Any], lora_r: int) -> "ModelDims":
        """From a transformers config's fields (``hidden_size``, ``num_hidden_layers``, ...), with LoRA of
        rank ``lora_r`` on every linear layer of the decoder (``target_modules: all-linear``)."""
        h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
        heads, kv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
        # (in, out) of q, k, v, o, gate, up, down
        linears = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h), (h, i), (h, i), (i, h)]
        return cls(
            layers=layers,
            hidden=h,
            attn_width=heads * d,
            vocab=shape["vocab_size"],
            params=layers * sum(a * b for a, b in linears),
            lora_params=layers * sum(lora_r * (a + b) for a, b in linears),
        )


@dataclass(frozen=True)
class Pass:
    """One forward pass (with its backward unless ``backward`` is False) over packed units."""

    name: str
    backward: bool
    lengths: tuple[int, ...]  # each unit's positions (its prompt once, then its targets)
    projected: int  # positions projected onto the vocabulary (the target tokens that carry a loss)


def pass_flops(p: Pass, dims: ModelDims) -> float:
    """Model FLOPs of one pass (see the module's docstring)."""
    tokens = sum(p.lengths)
    attention = 4 * dims.layers * dims.attn_width * sum(n * n for n in p.lengths)
    head = 2 * dims.hidden * dims.vocab * p.projected
    forward = 2 * dims.params * tokens + 2 * dims.lora_params * tokens + attention + head
    if not p.backward:
        return float(forward)
    # backward: activations' gradients through every matmul (as much as the forward, twice for attention's
    # two operand-only matmuls) and the adapters' weight gradients; the frozen weights get none
    backward = 2 * dims.params * tokens + 4 * dims.lora_params * tokens + 2 * attention + head
    return float(forward + backward)


def flops_per_token(dims: ModelDims, seq: int, backward: bool = True) -> float:
    """Model FLOPs of one token of a ``seq``-token sequence, head excluded: ``4N + 6 N_lora + 12 L d_attn T``
    trained, ``2N + 2 N_lora + 4 L d_attn T`` forward only."""
    return pass_flops(Pass("one", backward, (seq,), 0), dims) / seq


def mfu(flops: float, seconds: float, peak_tflops: float, gpus: int = 1) -> float:
    """Model FLOPs utilisation: ``flops`` done in ``seconds`` against ``gpus`` cards of ``peak_tflops``."""
    return flops / seconds / (gpus * peak_tflops * 1e12)


@dataclass(frozen=True)
class Padding:
    real: int  # positions holding a unit's token
    computed: int  # rows x width, summed over the passes
    dense: int  # the same units one to a row, each row as wide as the pass's longest (no packing)

    @property
    def share(self) -> float:
        return (self.computed - self.real) / self.computed if self.computed else 0.0

    @property
    def dense_share(self) -> float:
        return (self.dense - self.real) / self.dense if self.dense else 0.0


def padding(passes: Iterable[Pass]) -> Padding:
    """Real and computed positions of ``passes`` as :func:`learner.packing.pack` lays them out."""
    from learner.packing import first_fit

    real = computed = dense = 0
    for p in passes:
        if not p.lengths:
            continue
        width = max(p.lengths)
        _, rows = first_fit(p.lengths)
        real += sum(p.lengths)
        computed += rows * width
        dense += len(p.lengths) * width
    return Padding(real, computed, dense)


def micro_batch_passes(trainer: Any, micro_batch: dict[str, list[dict[str, Any]]]) -> list[Pass]:
    """The passes :meth:`learner.trainer.Trainer.train_step` runs over one micro-batch
    (``learner.chunk_tokens``' chunks each their own pass): the world model's EMA teacher (forward only),
    the world model and the policy. Built from the trainer's own units; nothing runs on the model."""
    from learner.packing import chunk_by_tokens, unit_length

    cfg, enc = trainer.cfg, trainer.encoder
    if cfg.policy_wm_aux > 0:
        raise ValueError("the count follows the learner's step without policy_wm_aux")
    counters = (enc.truncated, enc.demo_actions)  # encoding here must not show in the next step's metrics
    passes: list[Pass] = []
    batch = trainer.micro_batch(micro_batch)
    units = batch.world_model.units
    for chunk in chunk_by_tokens(cfg.chunk_tokens, units, lambda u: u.length) if units else []:
        teachers = [u.teacher for u in chunk if u.teacher is not None]
        if teachers:
            passes.append(Pass("wm_teacher", False, tuple(unit_length([t]) for t in teachers), _loss(teachers)))
        seqs = [s for u in chunk for s in u.seqs]
        passes.append(Pass("wm", True, tuple(u.length for u in chunk), _loss(seqs)))
    samples = batch.policy_samples()
    for chunk in chunk_by_tokens(cfg.chunk_tokens, samples, lambda sample: sample.length) if samples else []:
        seqs = [sample.seq for sample in chunk]
        passes.append(Pass("policy", True, tuple(unit_length([s]) for s in seqs), _loss(seqs)))
    enc.truncated, enc.demo_actions = counters
    return passes


def _loss(seqs: Sequence[Any]) -> int:
    return sum(s.n_loss for s in seqs)
