"""The method in one place: the ablation flags and the gates' thresholds are read only in
``comap_async/method/`` (and declared and validated in ``comap_async/config/``); the phase
routing tables are defined only there. An AST walk over every module of the processes and the core,
like the import-boundary test."""

from __future__ import annotations

import ast
from pathlib import Path

from comap_async.config import AblationConfig, GateConfig

REPO = Path(__file__).resolve().parents[2]
METHOD = REPO / "comap_async" / "method"
DECLARED = REPO / "comap_async" / "config"
FLAGS = set(AblationConfig.model_fields) | set(GateConfig.model_fields)
ROUTING = {"PHASE_STORES", "PHASE_REQUIRES", "PHASE_FILTERS", "MIXED_IN"}


def reads_outside_the_method(root: Path) -> list[str]:
    out = []
    for top in ("comap_async", "actors", "broker", "learner", "evaluator"):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            if any(home.relative_to(REPO) in rel.parents for home in (DECLARED, METHOD)):
                continue
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in FLAGS:
                    out.append(f"{rel}:{node.lineno}: reads .{node.attr}")
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [node.target]
                    if isinstance(node, ast.AnnAssign)
                    else []
                )
                for t in targets:
                    if isinstance(t, ast.Name) and t.id in ROUTING:
                        out.append(f"{rel}:{node.lineno}: defines {t.id}")
    return out


def test_ablation_flags_gate_thresholds_and_routing_live_in_the_method_package():
    assert reads_outside_the_method(REPO) == []


def test_the_walk_catches_a_flag_read_and_a_routing_table_elsewhere(tmp_path):
    for top in ("comap_async", "actors", "broker", "learner"):
        (tmp_path / top).mkdir()
    (tmp_path / "actors" / "x.py").write_text(
        "def f(cfg):\n    return cfg.ablation.no_action_gate or cfg.gates.tau_p\n"
    )
    (tmp_path / "learner" / "y.py").write_text("PHASE_STORES = {}\n")
    (tmp_path / "comap_async" / "method").mkdir()
    (tmp_path / "comap_async" / "method" / "z.py").write_text("def g(a):\n    return a.frozen_wm\n")  # allowed
    assert reads_outside_the_method(tmp_path) == [
        "actors/x.py:2: reads .no_action_gate",
        "actors/x.py:2: reads .tau_p",
        "learner/y.py:1: defines PHASE_STORES",
    ]
