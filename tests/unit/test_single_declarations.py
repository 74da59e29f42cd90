"""The Transition's fields, the phase names and the adapter-name format are
declared in one module (``comap_async/wire/messages.py``); every other module names them from there.

An AST walk over the code (docstrings and comments do not count): a dict, list, tuple or set
literal, or a class body, that spells five or more of the Transition's field names is a second
declaration; a ``"warmup"``/``"reflect_init"``/``"coevolve"`` string is a phase spelled again; an
f-string of the form ``f"{role}-v{n}"`` (or a split on ``"-v"``) is the adapter-name format again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from comap_async.wire.messages import PHASES, Transition

REPO = Path(__file__).resolve().parents[2]
HOME = REPO / "comap_async" / "wire" / "messages.py"
FIELDS = set(Transition.__struct_fields__) - {"v", "id", "t", "s", "o", "seq"}  # short names also mean other things


def code_files() -> list[Path]:
    return [
        p
        for top in ("comap_async", "actors", "broker", "learner", "evaluator", "benchmarks", "experiments/studies")
        for p in sorted((REPO / top).rglob("*.py"))
    ]


def _docstring_ids(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            for stmt in body:  # a string statement anywhere in a body is documentation
                if (
                    isinstance(stmt, ast.Expr)
                    and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)
                ):
                    ids.add(id(stmt.value))
    return ids


def declarations(path: Path) -> list[str]:
    """What ``path`` declares again that belongs to messages.py, as ``line: what``."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstring_ids(tree)
    docs |= {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}  # judged as f-strings
    out = []
    for node in ast.walk(tree):
        names: set[str] = set()
        if isinstance(node, ast.Dict):
            names = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            names = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        elif isinstance(node, ast.ClassDef):
            names = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
        if len(names & FIELDS) >= 5:
            out.append(f"{node.lineno}: the Transition's fields {sorted(names & FIELDS)[:5]}...")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in PHASES:
                out.append(f"{node.lineno}: the phase {node.value!r}")
            if node.value == "-v":
                out.append(f"{node.lineno}: the adapter-name separator '-v'")
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            for a, b, c in zip(parts, parts[1:], parts[2:]):
                if (
                    isinstance(a, ast.FormattedValue)
                    and isinstance(b, ast.Constant)
                    and str(b.value).endswith("-v")
                    and isinstance(c, ast.FormattedValue)
                ):
                    out.append(f'{node.lineno}: the adapter-name format f"{{role}}-v{{version}}"')
    return out


def test_declared_once_in_messages():
    found = {str(p.relative_to(REPO)): d for p in code_files() if p != HOME and (d := declarations(p))}
    assert found == {}


def test_messages_does_declare_them():
    found = declarations(HOME)
    assert any("Transition's fields" in d for d in found)  # the Transition class itself
    assert any("the phase 'coevolve'" in d for d in found) and any("adapter-name format" in d for d in found)


@pytest.mark.parametrize(
    "code,what",
    [
        ('PHASES = {"warmup": 1}\n', "the phase 'warmup'"),
        ('name = f"{role}-v{version}"\n', "adapter-name format"),
        ('v = name.rsplit("-v", 1)[1]\n', "separator '-v'"),
        ('REC = {"a_draft": 1, "s_hat": 2, "a_exec": 3, "s_next": 4, "s_hat_teacher": 5}\n', "Transition's fields"),
        (
            "class T:\n    a_draft: str\n    s_hat: str\n    a_exec: str\n    s_next: str\n    p_revise: float\n",
            "Transition's fields",
        ),
    ],
)
def test_a_second_declaration_is_found(tmp_path, code, what):
    path = tmp_path / "mod.py"
    path.write_text('"""The coevolve phase (a docstring does not count)."""\n' + code)
    found = declarations(path)
    assert len(found) == 1 and what in found[0], found
