"""Process priority: actors and the evaluator yield the CPU to the learner."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from comap_async.config import load_config
from comap_async.priority import lower_priority


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


def test_cpu_default_nices_actors_and_evaluator_not_the_learner():
    cfg = load_config("configs/local.yaml", [])
    assert cfg.actor.nice == 5 and cfg.eval.nice == 10
    assert load_config(None, []).actor.nice == 0  # the class defaults change nothing
    with pytest.raises(ValueError):
        load_config(None, ["actor.nice=-2"])
