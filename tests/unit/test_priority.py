"""Process priority: actors and the evaluator yield the CPU to the learner."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from comap_async.config import load_config
from comap_async.priority import lower_priority, niceness


def _niceness_after(code: str) -> int:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_lower_priority_raises_niceness_and_children_inherit_it():
    base = os.nice(0)
    code = (
        "import os, subprocess, sys; from comap_async.priority import lower_priority; lower_priority(3); "
        "print(subprocess.run([sys.executable, '-c', 'import os; print(os.nice(0))'], capture_output=True, "
        "text=True).stdout.strip())"
    )
    assert _niceness_after(code) == min(19, base + 3)


def test_zero_leaves_priority_alone_and_negative_is_refused():
    base = os.nice(0)
    assert lower_priority(0) == base
    with pytest.raises(ValueError, match="only lower"):
        lower_priority(-1)


def test_beside_a_cpu_learner_actors_and_evaluator_yield_to_it_beside_a_gpu_one_nobody_does():
    cpu = load_config("configs/local.yaml", [])
    assert niceness(cpu, "actor") == 5 and niceness(cpu, "evaluator") == 10
    gpu = load_config("configs/alfworld-qwen3-4b.yaml", [])
    assert gpu.learner.device != "cpu"
    assert niceness(gpu, "actor") == 0 and niceness(gpu, "evaluator") == 0
