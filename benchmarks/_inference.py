"""Shared helpers of the inference benchmarks: a real ``comap serve`` subprocess and LoRA adapter files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from comap_async.ports import free_port  # noqa: E402 - the repo must be on sys.path first
from experiments.system import stop_group  # noqa: E402


def wait_healthy(
    proc: subprocess.Popen, url: str, timeout_s: float, poll_s: float, exited: Any, timed_out: str
) -> None:
    """Poll ``url`` until it answers; RuntimeError(``exited()``) if ``proc`` ends first, TimeoutError
    (``timed_out``) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(exited())
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(timed_out) from None
            time.sleep(poll_s)


@contextmanager
def served(
    overrides: list[str],
    adapter_root: Path,
    log_path: Path,
    timeout_s: float = 180,
    env: dict | None = None,
    forward: str | None = None,
):
    """Yield the URL of a healthy ``comap serve`` started with these ``--set`` overrides (``forward``: the
    embedded server on that forward, ``fused`` or ``transformers``, instead of the one it decides)."""
    port = free_port()
    serve = ["-m", "comap_async", "serve"] if forward is None else [__file__, "--forward", forward]
    args = [
        sys.executable,
        *serve,
        "--set",
        f"inference.port={port}",
        "--set",
        f"inference.adapter_root={adapter_root}",
    ]
    for o in overrides:
        args += ["--set", o]
    env = {
        **os.environ,
        "COMAP_LOG_JSON": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(
            proc,
            url + "/health",
            timeout_s,
            0.3,
            lambda: f"server exited ({proc.returncode}):\n{log_path.read_text()[-2000:]}",
            f"{url} did not come up; log: {log_path}",
        )
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


@dataclass
class BrokerPorts:
    actor: int
    learner: int
    http: int
    run_root: Path

    def overrides(self) -> list[str]:
        """The config overrides a client of this broker needs."""
        return [
            f"run.root={self.run_root}",
            "run.name=t",
            f"broker.actor_port={self.actor}",
            f"broker.learner_port={self.learner}",
            f"broker.http_port={self.http}",
        ]


@contextmanager
def broker_running(run_root: Path, overrides: list[str], log_dir: Path, timeout_s: float = 30):
    """A ``comap broker`` on free ports (run name ``t`` under ``run_root``), healthy; yields its ports."""
    ports = BrokerPorts(free_port(), free_port(), free_port(), run_root)
    sets = sum((["--set", o] for o in [*ports.overrides(), *overrides]), [])
    proc = start_comap("broker", ["broker", *sets], {**os.environ, "COMAP_LOG_JSON": "1"}, log_dir)
    try:
        wait_healthy(
            proc,
            f"http://127.0.0.1:{ports.http}/healthz",
            timeout_s,
            0.1,
            lambda: f"broker exited ({proc.returncode}); log: {log_dir / 'broker.log'}",
            f"broker not healthy after {timeout_s} s; log: {log_dir / 'broker.log'}",
        )
        yield ports
    finally:
        stop_group(proc, 30)


def write_random_adapters(model_dir: str, root: Path, names: list[str], r: int = 8, scale: float = 0.02) -> list[Path]:
    """peft ``save_pretrained`` adapters (r, alpha=2r, all-linear) with random non-zero B, one base load."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", lora_dropout=0.0))
    out = []
    for i, name in enumerate(names):
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * scale)
        model.save_pretrained(str(root / name))
        out.append(root / name)
    return out


@dataclass
class FusedSetup:
    """The default model in-process with its fused forward and random adapters loaded in LoRA slots."""

    tokenizer: Any
    slots: Any
    fused: Any
    adapters: list[str]
    """The adapters' slot names, in the order asked."""


def fused_setup(config: Any, names: list[str], batch_hint: int = 8) -> FusedSetup:
    """``config``'s model (``inference.dtype``) with a fused forward and one random adapter of the learner's
    LoRA shape per name, one thread (``benchmarks/decode_breakdown.py``, ``benchmarks/mixed_step.py``)."""
    import tempfile

    import torch
    from peft import LoraConfig

    from comap_async.inference.adapters import SlotManager, read_adapter
    from comap_async.inference.fused import FusedLlama
    from comap_async.inference.layout import prepare_for_inference
    from comap_async.models import inference_dtype, load_model_and_tokenizer, resolve_model

    torch.set_num_threads(1)
    model_dir = resolve_model(config.model.name_or_path, config.model.cache_dir)
    model, tok = load_model_and_tokenizer(model_dir, config.model.dtype)
    prepare_for_inference(model)
    lc = config.learner
    slots = SlotManager(
        model,
        LoraConfig(r=lc.lora_r, lora_alpha=lc.lora_alpha, lora_dropout=0.0, target_modules=lc.target_modules),
        spares=0,
    )
    fused = FusedLlama(model, slots.stacks, inference_dtype(config.inference.dtype), batch_hint=batch_hint)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_random_adapters(model_dir, Path(tmp), names, r=lc.lora_r)
        adapters = [slots.add_slow(read_adapter(path)) for path in paths]
    return FusedSetup(tok, slots, fused, adapters)


def start_comap(name: str, args: list[str], env: dict, log_dir: Path) -> subprocess.Popen:
    """``python -m comap_async ARGS`` in its own session, output appended to ``log_dir/NAME.log``."""
    log = open(log_dir / f"{name}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "comap_async", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )


def serve_on(argv: list[str]) -> int:
    """``python benchmarks/_inference.py --forward fused|transformers [comap serve's arguments]``: ``comap serve``
    on the named forward (the server decides it from the model otherwise)."""
    import argparse

    from comap_async.inference import cli

    p = argparse.ArgumentParser()
    p.add_argument("--forward", choices=["fused", "transformers"], required=True)
    cli.add_arguments(p)
    args = p.parse_args(argv)
    return cli.run(args, forward=args.forward)


def stored_transitions(http_port: int) -> int:
    """Transitions the broker has written (its ``/stats``)."""
    import json

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/stats", timeout=10) as r:
        return json.loads(r.read())["stores"]["transitions"]["written"]


if __name__ == "__main__":
    sys.exit(serve_on(sys.argv[1:]))
