"""LoRA adapters of the embedded server: safe paths, file reading, and peft adapter slots.

Public adapter names (``policy-v3``) map to internal peft adapter *slots* (``s7``). A request is
bound to a slot when it arrives and keeps it until it finishes, so reloading a name in place never
changes the weights under a running request: the new version goes into another slot and the old
slot is recycled once its last request is done.

Publishing must be fast (the learner publishes every few minutes and actors should switch at
once), but peft's ``add_adapter`` builds a module per target layer (~200 ms for SmolLM2
all-linear). So the server keeps *spare* slots built ahead of time with the learner's LoRA
config; loading an adapter with that shape only copies tensors into a spare (~10 ms), off the
engine thread because no request can be using a spare. Other shapes take the slow path on the
engine thread, between decode steps.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from comap_async.inference.token_sampling import RequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
BASE = "__base__"  # peft's name for "no adapter" in a mixed batch
SPARE_ADAPTER_SLOTS = 7
"""LoRA slots the server builds ahead with the learner's adapter shape, so loading a published adapter only
copies tensors (~10-50 ms); each costs one adapter's memory (~20 MB for SmolLM2 r=8). 7 covers a publish
(policy, wm, wm_teacher) and the evaluator's copies of the same version, which it loads a few seconds later,
plus one: with 4, the evaluator's third load took the slow path (2.3 s) while the spares were being rebuilt.
The versions a publish replaces return to the pool when the learner unloads them."""
_A, _B = ".lora_A.weight", ".lora_B.weight"


def resolve_adapter_dir(root: Path, lora_path: Any) -> Path:
    """``lora_path`` (absolute, or relative to ``root``) -> the real directory, which must lie inside ``root``."""
    if not isinstance(lora_path, str) or not lora_path.strip():
        raise RequestError("'lora_path' must be a non-empty string", param="lora_path")
    if "\x00" in lora_path:
        raise RequestError("'lora_path' contains a NUL byte", param="lora_path")
    path = Path(lora_path)
    if ".." in path.parts:
        raise RequestError("'lora_path' must not contain '..'", param="lora_path")
    real_root = root.expanduser().resolve()
    # resolve() follows every symlink on the way, so a link that points outside the root is caught here
    real = (path if path.is_absolute() else real_root / path).resolve()
    if real != real_root and real_root not in real.parents:
        raise RequestError(
            f"'lora_path' {lora_path!r} is outside the adapter root {str(real_root)!r}", param="lora_path"
        )
    if not real.is_dir():
        raise RequestError(
            f"adapter directory {lora_path!r} does not exist in the adapter root", status=404, param="lora_path"
        )
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        f = (real / name).resolve()
        if real_root not in f.parents:
            raise RequestError(f"{name} of {lora_path!r} links outside the adapter root", param="lora_path")
        if not f.is_file():
            raise RequestError(
                f"{lora_path!r} is not a peft LoRA adapter: {name} is missing (only safetensors adapters are loaded)",
                param="lora_path",
            )
    return real


@dataclass
class AdapterFiles:
    path: Path
    config: Any  # peft.LoraConfig
    tensors: dict[str, torch.Tensor]

    def modules(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """module path -> (A, B) when the file holds plain LoRA A/B pairs only, else None."""
        pairs: dict[str, list] = {}
        for key, t in self.tensors.items():
            if key.endswith(_A):
                pairs.setdefault(key[: -len(_A)], [None, None])[0] = t
            elif key.endswith(_B):
                pairs.setdefault(key[: -len(_B)], [None, None])[1] = t
            else:
                return None
        if any(a is None or b is None for a, b in pairs.values()):
            return None
        return {k: (a, b) for k, (a, b) in pairs.items()}

    @property
    def scaling(self) -> float:
        c = self.config
        return c.lora_alpha / (math.sqrt(c.r) if c.use_rslora else c.r)


def read_adapter(path: Path) -> AdapterFiles:
    """Read a peft ``save_pretrained`` directory (run in a worker thread: file I/O off the event loop)."""
    from peft import LoraConfig
    from safetensors.torch import load

    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise RequestError(f"{path.name}/{CONFIG_FILE} is not readable JSON: {exc}", param="lora_path") from None
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        raise RequestError(
            f"{path.name}: only LoRA adapters are supported (peft_type={raw.get('peft_type')!r})"
            if isinstance(raw, dict)
            else f"{path.name}/{CONFIG_FILE} is not a JSON object",
            param="lora_path",
        )
    try:
        config = LoraConfig.from_pretrained(str(path))
        # load() of the file's bytes, not load_file(): safetensors 0.8's load_file keeps two Python ints
        # per tensor alive for good (~23 KB per SmolLM2 adapter load, for a server that loads three a publish)
        tensors = load((path / WEIGHTS_FILE).read_bytes())
    except Exception as exc:  # peft and safetensors raise many types for bad files; all mean "bad adapter"
        raise RequestError(
            f"{path.name} is not a valid LoRA adapter: {type(exc).__name__}: {exc}", param="lora_path"
        ) from None
    if not tensors:
        raise RequestError(f"{path.name}/{WEIGHTS_FILE} holds no tensors", param="lora_path")
    bad = next((k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    if bad is not None:  # it would load, and every output it touches would be NaN
        raise RequestError(f"{path.name}: tensor {bad} holds non-finite values", param="lora_path")
    return AdapterFiles(path, config, tensors)


class SlotManager:
    """peft adapter slots of one base model.

    Structural changes (``new_spare``, ``add_slow``, ``delete``) must run on the engine thread between
    forward passes; ``fill_spare`` may run on any thread because the slot it writes is unused.
    """

    def __init__(self, model: torch.nn.Module, spare_config: Any | None, spares: int = 2) -> None:
        self.base = model
        # the base model's module names, read once here: later walks of the wrapped model would race
        # with the engine thread's adds and deletes
        self._module_names = tuple(n for n, _ in model.named_modules() if n)
        self.peft: Any | None = None
        self.spare_config = spare_config
        self.spare_target = spares if spare_config is not None else 0
        self.spares: list[str] = []
        self._lock = threading.Lock()
        self._counter = 0
        self._spare_modules: dict[str, Any] = {}
        self._shape: dict[str, tuple[frozenset, frozenset]] = {}
        # bumped whenever a slot's weights change: keys of the prompt-prefix KV cache include it
        self.generation: dict[str, int] = {}
        self._generations = 0
        self.step_adapters: list[str] | None = None
        from comap_async.inference.lora_stack import LoraStacks

        self.stacks = LoraStacks(capacity=spares + 8)
        self.stacked = True  # False once an adapter needs peft's own forward (DoRA, LoRA bias, embeddings)
        # With the fused forward on: ids of the base Linear modules it applies LoRA to. It reads the
        # stacks only, so an adapter with any other target would be silently ignored: it is refused.
        self.fused_targets: frozenset[int] | None = None

    # ------------------------------------------------------------ engine-thread operations
    @property
    def forward_model(self) -> torch.nn.Module:
        return self.peft.base_model.model if self.peft is not None else self.base

    def _new_name(self) -> str:
        self._counter += 1
        return f"s{self._counter}"

    def _bump(self, slot: str) -> None:
        with self._lock:
            self._generations += 1
            self.generation[slot] = self._generations

    def _add(self, name: str, config: Any) -> None:
        was_stacked = self.stacked
        self._add_module(name, config)
        if self.fused_targets is None:
            return
        outside = [key for key, m in self._modules_of(name).items() if id(m.base_layer) not in self.fused_targets]
        if outside or not self.stacked:
            self.stacked = was_stacked
            self._drop(name)
            what = f"targets {outside[0]}" if outside else "needs LoRA biases or a non-Linear target"
            raise RequestError(
                f"this adapter {what}, which the fused forward (this model's) does not apply: its LoRA must "
                "target the decoder layers' linear projections (learner.target_modules)",
                param="lora_path",
            )

    def _add_module(self, name: str, config: Any) -> None:
        if self.peft is None:
            from peft import get_peft_model

            self.peft = get_peft_model(self.base, config, adapter_name=name)
            self.peft.eval()
        else:
            self.peft.add_adapter(name, config)
        self.peft.requires_grad_(False)
        self._hook_new_layers()
        if getattr(config, "use_dora", False) or getattr(config, "lora_bias", False):
            self.stacked = False
        self.stacks.assign(name)
        self.stacks.sync(name)
        self._bump(name)
        # Shapes are recorded here, on the engine thread: walking the modules from another thread
        # could race with a later add/delete.
        mods = self._modules_of(name)
        self._shape[name] = (frozenset(mods), frozenset(m.lora_A[name].weight.shape[0] for m in mods.values()))

    def begin_step(self, adapters: list[str]) -> None:
        """Per-row adapters of the next forward pass (engine thread)."""
        if self.peft is None:
            return
        self.step_adapters = adapters
        self.stacks.step_rows = self.stacks.rows_for(adapters, BASE) if self.stacked else None

    def end_step(self) -> None:
        self.step_adapters = None
        self.stacks.step_rows = None

    def _hook_new_layers(self) -> None:
        from peft.tuners.lora import LoraLayer
        from peft.tuners.lora.layer import Linear as LoraLinear

        # Each LoRA layer gets the current step's per-row adapters from this manager instead of
        # through peft's `adapter_names=` argument, whose forward hook walks all modules and
        # re-registers hooks on every call (several ms per decode step).
        def inject(module, args, kwargs):
            if self.step_adapters is not None:
                kwargs["adapter_names"] = self.step_adapters
            return args, kwargs

        def peft_forward(orig):
            def run(x, *args, **kwargs):
                if self.step_adapters is not None:
                    kwargs["adapter_names"] = self.step_adapters
                return orig(x, *args, **kwargs)

            return run

        for module in self.peft.modules():
            if not isinstance(module, LoraLayer) or getattr(module, "_comap_hooked", False):
                continue
            module._comap_hooked = True
            if type(module) is LoraLinear:
                self.stacks.attach(module, peft_forward(module.forward), lambda: self.stacked)
            else:
                self.stacked = False
                module.register_forward_pre_hook(inject, with_kwargs=True)

    def new_spare(self) -> str | None:
        """Build one spare slot; None when the pool filled up meanwhile (a retired slot given back from
        the event loop while this one was being built): the new one is dropped, the pool stays at its size."""
        name = self._new_name()
        self._add(name, self.spare_config)
        if not self._spare_modules:
            self._spare_modules = self._modules_of(name)
        with self._lock:
            room = len(self.spares) < self.spare_target
            if room:
                self.spares.append(name)
        if not room:
            self._drop(name)
            return None
        return name

    def fill_spares(self, most: int | None = None) -> None:
        """Build spares up to the pool's size, or ``most`` of them."""
        built = 0
        while len(self.spares) < self.spare_target and (most is None or built < most):
            self.new_spare()
            built += 1

    def _modules_of(self, slot: str) -> dict[str, Any]:
        prefix = "base_model.model."
        return {
            prefix + n if not n.startswith(prefix) else n: m
            for n, m in self.peft.named_modules()
            if hasattr(m, "lora_A") and slot in m.lora_A
        }

    def add_slow(self, files: AdapterFiles) -> str:
        """Create a slot with the adapter's own config and load its weights (any LoRA shape peft supports)."""
        from peft import set_peft_model_state_dict

        if getattr(files.config, "use_dora", False):
            # peft cannot put DoRA adapters in a mixed-adapter batch (and vLLM does not serve DoRA)
            raise RequestError(f"{files.path.name} is a DoRA adapter: not supported, use plain LoRA", param="lora_path")
        name = self._new_name()
        try:
            self._add(name, files.config)
        except Exception as exc:  # peft raises ValueError/KeyError/... when targets do not exist in this model
            self._drop(name)
            raise RequestError(f"{files.path.name} does not fit the base model: {exc}", param="lora_path") from None
        try:
            result = set_peft_model_state_dict(self.peft, files.tensors, adapter_name=name)
        except Exception as exc:  # e.g. size mismatch: the slot must not stay behind
            self._drop(name)
            raise RequestError(
                f"{files.path.name} does not fit the base model: {str(exc)[:500]}", param="lora_path"
            ) from None
        unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k and f".{name}." in k]
        if unexpected or missing:
            self._drop(name)
            what = (
                f"has weights for modules the base model lacks, e.g. {unexpected[0]}"
                if unexpected
                else f"has no weights for {len(missing)} of the modules its config targets, e.g. {missing[0]} "
                "(it would act as the base model there)"
            )
            raise RequestError(f"{files.path.name} {what}", param="lora_path")
        self.stacks.sync(name)
        self._bump(name)
        return name

    def _drop(self, name: str) -> None:
        self._shape.pop(name, None)
        with self._lock:
            # slot names are never reused: an entry kept here would outlive its slot, one per slot built
            self.generation.pop(name, None)
        self.stacks.release(name)
        if self.peft is not None and name in self.peft.peft_config:
            self.peft.delete_adapter(name)

    def delete(self, slot: str) -> None:
        with self._lock:
            if slot in self.spares:
                self.spares.remove(slot)
        self._drop(slot)

    # ------------------------------------------------------------ any-thread operations
    def take_spare(self) -> str | None:
        with self._lock:
            return self.spares.pop() if self.spares else None

    def give_back(self, slot: str) -> bool:
        """Return a retired slot to the spare pool if it has exactly the spare shape and the pool has room."""
        if self.spare_config is None or self.peft is None or not self._spare_shaped(slot):
            return False
        with self._lock:
            if len(self.spares) >= self.spare_target or slot in self.spares:
                return False
            self.spares.append(slot)
            return True

    def _spare_shaped(self, slot: str) -> bool:
        # A slot with extra target modules would keep stale weights there after a refill: exact match only.
        shape = self._shape.get(slot)
        return shape is not None and shape == (frozenset(self._spare_modules), frozenset([self.spare_config.r]))

    def _targets_spare_modules(self, config: Any) -> bool:
        """Whether ``config`` targets exactly the spare slots' modules of the base model. Filling a spare
        copies tensors only, so without this an adapter whose ``target_modules`` name no module (or
        other modules) would load as if it named the spare's."""
        spare = {k.removeprefix("base_model.model.") for k in self._spare_modules}
        targets = config.target_modules
        plain = not getattr(config, "layers_to_transform", None) and not getattr(config, "exclude_modules", None)
        if plain and isinstance(targets, (list, set, tuple, frozenset)) and set(targets) == spare:
            return True  # peft saves the module names it adapted: the learner's adapters, without a walk
        if not isinstance(targets, (str, list, set, tuple, frozenset)) or targets == "all-linear":
            return False  # peft expands these against the model itself: the slow path
        from peft.tuners.tuners_utils import check_target_module_exists

        return {n for n in self._module_names if check_target_module_exists(config, n)} == spare

    def fill_spare(self, slot: str, files: AdapterFiles) -> bool:
        """Copy the adapter's tensors into an unused spare slot; False when it has another shape or variant."""
        c = files.config
        if getattr(c, "use_dora", False) or getattr(c, "lora_bias", False):
            return False
        if getattr(c, "alpha_pattern", None) or getattr(c, "rank_pattern", None):
            return False
        mods = files.modules()
        if mods is None or set(mods) != set(self._spare_modules):
            return False
        if not self._targets_spare_modules(c):
            return False  # the slow path lets peft check the config (a target matching nothing is refused there)
        for key, (a, b) in mods.items():
            m = self._spare_modules[key]
            if m.lora_A[slot].weight.shape != a.shape or m.lora_B[slot].weight.shape != b.shape:
                return False
        scaling = files.scaling
        with torch.no_grad():
            for key, (a, b) in mods.items():
                m = self._spare_modules[key]
                m.lora_A[slot].weight.copy_(a)
                m.lora_B[slot].weight.copy_(b)
                m.scaling[slot] = scaling
        self.stacks.sync(slot)
        self._bump(slot)
        return True
