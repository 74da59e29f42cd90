"""A stored record's kind is told apart in one place, ``comap_async/wire/records.py``: the broker's
counters and sampling and the learner's batches ask it, none of them reads ``source == "suffix"`` or
``"turns" in record`` itself. An AST walk over the processes and the core, like the method boundary's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from comap_async.wire.records import RecordKind, is_imagined, record_kind

REPO = Path(__file__).resolve().parents[2]
HOME = Path("comap_async/wire/records.py")


def _is_str(node: ast.AST, value: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == value


def tells_kinds_apart(node: ast.Compare) -> str | None:
    """``x.get("source") == "suffix"`` / ``x["source"] == "suffix"`` or ``"turns" in x``: a record's kind
    decided by hand."""
    left, right = node.left, node.comparators[0]
    op = node.ops[0]
    if isinstance(op, (ast.In, ast.NotIn)) and _is_str(left, "turns"):
        return '"turns" in a record'
    if isinstance(op, (ast.Eq, ast.NotEq)) and any(_is_str(side, "suffix") for side in (left, right)):
        return 'source == "suffix"'
    return None


def hand_made_kinds(root: Path) -> list[str]:
    out = []
    for top in ("comap_async", "actors", "broker", "learner", "evaluator"):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            if rel == HOME:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Compare) and (what := tells_kinds_apart(node)):
                    out.append(f"{rel}:{node.lineno}: {what}")
    return out


def test_record_kinds_are_told_apart_only_in_the_wire_records_module():
    assert hand_made_kinds(REPO) == []


def test_the_walk_catches_a_kind_told_apart_by_hand(tmp_path):
    for top in ("comap_async", "broker", "learner"):
        (tmp_path / top).mkdir()
    (tmp_path / "broker" / "b.py").write_text('def f(rec):\n    return rec.get("source") == "suffix"\n')
    (tmp_path / "learner" / "l.py").write_text('def g(rec):\n    return "turns" in rec\n')
    (tmp_path / "comap_async" / "wire").mkdir()
    (tmp_path / "comap_async" / "wire" / "records.py").write_text('def h(r):\n    return "turns" in r\n')
    assert hand_made_kinds(tmp_path) == [
        'broker/b.py:2: source == "suffix"',
        'learner/l.py:2: "turns" in a record',
    ]


def test_record_kind_reads_the_fields_the_actors_write():
    assert record_kind("transitions", {"s": "x"}) is RecordKind.TRANSITION
    assert record_kind("demos", {"s": "x", "target": "go to desk 1"}) is RecordKind.DEMO_STEP
    assert record_kind("demos", {"turns": [], "targets": []}) is RecordKind.DEMO_PATH
    assert record_kind("reflections", {"y": 1}) is RecordKind.GATE_REFLECTION
    assert record_kind("reflections", {"y": 1, "source": "suffix"}) is RecordKind.SUFFIX_REFLECTION
    assert is_imagined({"source": "imagined"}) and is_imagined({"turns": [], "imagined": True})
    assert not is_imagined({"source": "suffix"})
    with pytest.raises(ValueError, match="no store 'episodes'"):
        record_kind("episodes", {})
