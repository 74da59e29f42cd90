"""``comap procfile``: the Procfile of a GPU host, from the config's device plan.

``inference.gpus`` (one vLLM server per ``inference.tensor_parallel`` of them, on consecutive
ports from ``inference.port``) and ``learner.gpus`` (several: ``torchrun``, one data-parallel rank
per GPU) say where each process runs; every process
gets its ``CUDA_VISIBLE_DEVICES`` and the list of inference endpoints, so nothing else has to be
edited by hand. A learner GPU that also serves inference gets a vLLM server that leaves room for
it (``--gpu-memory-utilization 0.45`` unless ``inference.gpu_memory_utilization`` says otherwise;
decided by ``CoMapConfig.vllm_memory_share``, which a ``comap serve`` started by hand applies too).

    comap procfile --config configs/alfworld-qwen3-4b.yaml > Procfile.gpu
    honcho start -f Procfile.gpu
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comap_async.config import ConfigError


@dataclass(frozen=True)
class Process:
    name: str
    gpus: tuple[int, ...]
    """``CUDA_VISIBLE_DEVICES`` (empty: no GPU, the variable is set empty so nothing grabs one)."""
    command: str
    overrides: tuple[str, ...] = ()


def plan(cfg: Any) -> list[Process]:
    """The processes of one host: broker, one vLLM server per group of inference GPUs, the learner,
    an actor and the evaluator. ConfigError when the plan cannot be run."""
    inf, lc = cfg.inference, cfg.learner
    if not inf.gpus:
        raise ConfigError(
            "inference.gpus is empty: list the GPU ids that serve inference (e.g. [0, 1, 2]); "
            "without GPUs use the repository's Procfile"
        )
    if len(set(inf.gpus)) != len(inf.gpus):
        raise ConfigError(f"inference.gpus lists a GPU twice: {inf.gpus}")
    if len(inf.gpus) % inf.tensor_parallel:
        raise ConfigError(
            f"inference.gpus ({len(inf.gpus)}) is not a multiple of inference.tensor_parallel "
            f"({inf.tensor_parallel}): every server needs the same number of GPUs"
        )
    if inf.backend != "vllm":
        raise ConfigError("comap procfile plans vLLM servers: set inference.backend: vllm")
    if lc.gpus and not lc.device.startswith("cuda"):
        raise ConfigError(f"learner.gpus is set but learner.device is {lc.device!r}: set learner.device: cuda")
    groups = [tuple(inf.gpus[i : i + inf.tensor_parallel]) for i in range(0, len(inf.gpus), inf.tensor_parallel)]
    endpoints = [f"http://{_client_host(inf.host)}:{inf.port + i}" for i in range(len(groups))]
    wired = f"inference.endpoints={_list(endpoints)}"
    procs = [Process("broker", (), "comap broker")]
    for i, group in enumerate(groups):
        extra = [f"inference.port={inf.port + i}"]
        share = cfg.vllm_memory_share(group)
        if share is not None and inf.gpu_memory_utilization is None:  # said on the line: the Procfile shows it
            extra.append(f"inference.gpu_memory_utilization={share}")
        procs.append(Process(f"inference{i}", group, "comap serve --backend vllm", tuple(extra)))
    # several learner GPUs: data parallel, one torchrun rank per GPU (learner/distributed.py)
    learner = (
        f"torchrun --standalone --nproc-per-node {len(lc.gpus)} -m comap_async learner"
        if len(lc.gpus) > 1
        else "comap learner"
    )
    procs.append(Process("learner", tuple(lc.gpus), learner, (wired,)))
    procs.append(Process("actor", (), "comap actor", (wired,)))
    procs.append(Process("evaluator", (), "comap evaluator", (wired,)))
    return procs


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _list(items: list[str]) -> str:
    return "[" + ",".join(f'"{x}"' for x in items) + "]"


def render(procs: list[Process], config: str | None, overrides: list[str]) -> str:
    """Procfile text: one line per process (honcho runs each through a shell)."""
    lines = []
    for p in procs:
        words = [*shlex.split(p.command), *(["--config", config] if config else [])]
        for o in (*overrides, *p.overrides):
            words += ["--set", o]
        env = f"CUDA_VISIBLE_DEVICES={','.join(map(str, p.gpus))} COMAP_LOG_JSON=${{COMAP_LOG_JSON:-0}}"
        lines.append(f"{p.name}: {env} exec {shlex.join(words)}")
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from comap_async.cli import add_config_arguments

    add_config_arguments(p)
    p.add_argument("--out", type=Path, default=None, help="write the Procfile here (default: print it)")


def run(args: argparse.Namespace) -> int:
    from comap_async.config import load_config

    cfg = load_config(args.config, args.overrides)
    text = render(plan(cfg), args.config, list(args.overrides))
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out}: honcho start -f {args.out}")
    return 0
