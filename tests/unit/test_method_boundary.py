"""The method in one place: the ablations and the gates' thresholds (``method.ablation``,
``method.tau_*``) are read only in ``comap_async/method/`` (and declared and validated in
``comap_async/config/``; the learner reads the method section's loss weights); the phase
routing tables are defined only there, and the action gate's ``p`` and ``q`` computed only there
(``comap_async/method/decision.py``). An AST walk over every module of the processes and the core,
like the import-boundary test."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from comap_async.config import ABLATIONS, MethodConfig
from comap_async.method import decision, labels

REPO = Path(__file__).resolve().parents[2]
METHOD = REPO / "comap_async" / "method"
DECLARED = REPO / "comap_async" / "config"
FLAGS = {name for name in MethodConfig.model_fields if name.startswith("tau_")}
"""The gates' thresholds, read as attributes (``cfg.method.tau_p``)."""
ABLATION_NAMES = set(ABLATIONS)
"""The ablations, tested by name (``"frozen_wm" in cfg.method.ablation``): a name spelled in the code is a read."""
ROUTING = {"PHASE_STORES", "PHASE_REQUIRES", "PHASE_FILTERS", "MIXED_IN"}
DEFINITIONS = {
    name: module.__name__
    for module in (decision, labels)
    for name, f in vars(module).items()
    if inspect.isfunction(f) and f.__module__ == module.__name__ and not name.startswith("_")
}
"""``p`` and ``q``'s functions, the label rule's and the reflection metrics': another function of one of
these names is a second definition (name -> the module that defines it)."""
SQUASHES = {"exp", "expit", "sigmoid", "logsigmoid", "log_sigmoid", "softmax", "log_softmax"}
"""What turns the two decision scores into ``p`` (a softmax over the pair is a sigmoid of their
difference, and either is built from exp), or a mean log-probability into ``q``."""


def _words(name: str) -> set[str]:
    return set(re.split(r"[^a-z]+", name.lower()))


def _decision_sides(node: ast.AST, derived: set[str]) -> set[str]:
    """Which decision tokens (``keep``, ``revise``) the names in ``node`` stand for: a name or
    attribute with the word in it (``keep_id``, ``p_revise``, ``decision.keep``), or a local name
    ``derived`` from both."""
    sides: set[str] = set()
    for n in ast.walk(node):
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None
        if name is None:
            continue
        if isinstance(n, ast.Name) and name in derived:
            return {"keep", "revise"}
        sides |= {"keep", "revise"} & _words(name)
    return sides


def _called(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _is_a_mean(node: ast.AST) -> bool:
    """``mean(...)``, ``x.mean()``, ``statistics.fmean(...)`` or ``sum(...) / n``."""
    if isinstance(node, ast.Call):
        return _called(node) in {"mean", "fmean"}
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Div)
        and isinstance(node.left, ast.Call)
        and _called(node.left) in {"sum", "fsum"}
    )


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _scopes(tree: ast.Module) -> list[list[ast.AST]]:
    """The nodes of the module's own code and of each function's, a nested function's apart."""
    out = []
    for scope in [
        tree,
        *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))),
    ]:
        nodes, stack = [], list(ast.iter_child_nodes(scope))
        while stack:
            n = stack.pop()
            nodes.append(n)
            if not isinstance(n, FUNCTIONS):
                stack.extend(ast.iter_child_nodes(n))
        out.append(nodes)
    return out


def computes_p_or_q(tree: ast.Module) -> list[tuple[int, str]]:
    """Where a module defines or computes ``p`` or ``q`` itself: a function named as one of
    :data:`DEFINITIONS`; exp, a sigmoid or a softmax of the two decision tokens' scores (both named
    in its operands, or in what a local name in them was assigned from); exp of a mean (a geometric
    mean). The inference server's sampling softmaxes whole vocabularies and names no decision token."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in DEFINITIONS:
            out.append((node.lineno, f"defines {node.name} ({DEFINITIONS[node.name]}'s)"))
    for nodes in _scopes(tree):
        derived: set[str] = set()
        assigns = [n for n in nodes if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and n.value]
        grew = True
        while grew:  # names assigned from both scores, and from those (in any order of the statements)
            grew = False
            for a in assigns:
                if _decision_sides(a.value, derived) == {"keep", "revise"}:
                    targets = a.targets if isinstance(a, ast.Assign) else [a.target]
                    for name in {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)} - derived:
                        derived.add(name)
                        grew = True
        for n in nodes:
            if not isinstance(n, ast.Call) or _called(n) not in SQUASHES:
                continue
            operands = [*n.args, *(k.value for k in n.keywords)]
            if isinstance(n.func, ast.Attribute):
                operands.append(n.func.value)  # x.sigmoid(), x.mean().exp()
            if any(_decision_sides(o, derived) == {"keep", "revise"} for o in operands):
                out.append((n.lineno, f"computes p: {_called(n)} of the decision tokens' scores"))
            elif _called(n) == "exp" and any(_is_a_mean(o) for o in operands):
                out.append((n.lineno, "computes q: exp of a mean log-probability"))
    return sorted(out)


def _names_learner(node: ast.AST) -> bool:
    """``cfg.learner``, ``self.cfg.learner``, ``learner``, ``lc``: what a ``LearnerConfig`` is read through."""
    return (isinstance(node, ast.Attribute) and node.attr == "learner") or (
        isinstance(node, ast.Name) and node.id in ("learner", "lc")
    )


def reads_outside_the_method(root: Path) -> list[str]:
    out = []
    for top in ("comap_async", "actors", "broker", "learner", "evaluator"):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            if any(home.relative_to(REPO) in rel.parents for home in (DECLARED, METHOD)):
                continue
            tree = ast.parse(path.read_text(), str(path))
            out += [f"{rel}:{line}: {what}" for line, what in computes_p_or_q(tree)]
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in FLAGS:
                    out.append(f"{rel}:{node.lineno}: reads .{node.attr}")
                if isinstance(node, ast.Constant) and node.value in ABLATION_NAMES:
                    out.append(f"{rel}:{node.lineno}: names the ablation {node.value}")
                # a phase's settings are read as its spec (comap_async.method.phases), not from the config
                if isinstance(node, ast.Attribute) and node.attr == "phases" and _names_learner(node.value):
                    out.append(f"{rel}:{node.lineno}: reads learner.phases")
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


def test_ablations_gate_thresholds_phases_routing_p_q_and_labels_live_in_the_method_package():
    assert reads_outside_the_method(REPO) == []


def test_the_walk_catches_a_flag_read_and_a_routing_table_elsewhere(tmp_path):
    for top in ("comap_async", "actors", "broker", "learner"):
        (tmp_path / top).mkdir()
    (tmp_path / "actors" / "x.py").write_text(
        "def f(cfg):\n    return 'no_action_gate' in cfg.method.ablation or cfg.method.tau_p\n"
    )
    (tmp_path / "learner" / "y.py").write_text("PHASE_STORES = {}\n")
    (tmp_path / "learner" / "w.py").write_text(
        "def steps(cfg, lc):\n    return cfg.learner.phases.warmup.steps + lc.phases.coevolve.steps\n"
    )
    (tmp_path / "actors" / "v.py").write_text("def reflection_label(equal, expert, draft):\n    return 0, 'keep'\n")
    (tmp_path / "comap_async" / "method").mkdir()
    (tmp_path / "comap_async" / "method" / "z.py").write_text("def g(a):\n    return 'frozen_wm' in a\n")  # allowed
    assert reads_outside_the_method(tmp_path) == [
        "actors/v.py:1: defines reflection_label (comap_async.method.labels's)",
        "actors/x.py:2: reads .tau_p",
        "actors/x.py:2: names the ablation no_action_gate",
        "learner/w.py:2: reads learner.phases",
        "learner/w.py:2: reads learner.phases",
        "learner/y.py:1: defines PHASE_STORES",
    ]


def test_the_walk_catches_p_and_q_computed_elsewhere(tmp_path):
    for top in ("comap_async", "actors", "learner", "evaluator"):
        (tmp_path / top).mkdir()
    (tmp_path / "actors" / "a.py").write_text(
        "import math\n"
        "def read(top, decision):\n"
        "    keep, revise = top[decision.keep], top[decision.revise]\n"
        "    return 1.0 / (1.0 + math.exp(keep - revise))\n"
        "def sequence_confidence(lps):\n"
        "    return math.exp(sum(lps) / len(lps))\n"
    )
    (tmp_path / "learner" / "l.py").write_text(
        "import torch\n"
        "def p(logits, keep_id, revise_id):\n"
        "    two = torch.stack([logits[:, keep_id], logits[:, revise_id]], dim=-1)\n"
        "    scaled = two.float()\n"
        "    return torch.softmax(scaled, dim=-1)[:, 1]\n"
        "def p2(logits, keep_id, revise_id):\n"
        "    return (logits[:, revise_id] - logits[:, keep_id]).sigmoid()\n"
        "def q(token_logprobs):\n"
        "    return token_logprobs.mean().exp()\n"
    )
    # allowed: the method's own definitions; a BCE on its logit; the server's sampling (a vocabulary-wide
    # softmax beside a top-p mask named keep); a function of its own scope's names only
    (tmp_path / "comap_async" / "method").mkdir()
    (tmp_path / "comap_async" / "method" / "decision.py").write_text(
        "import math\ndef revise_probability(keep, revise):\n    return 1 / (1 + math.exp(keep - revise))\n"
    )
    (tmp_path / "learner" / "ok.py").write_text(
        "import torch.nn.functional as F\n"
        "from comap_async.method.decision import revise_logit\n"
        "def bce(logits, keep_id, revise_id, y):\n"
        "    logit = revise_logit(logits[:, keep_id], logits[:, revise_id])\n"
        "    return F.binary_cross_entropy_with_logits(logit, y)\n"
    )
    (tmp_path / "comap_async" / "sampling.py").write_text(
        "import torch\n"
        "def draw(logits, probs, top_p, temperature):\n"
        "    keep = probs.cumsum(-1) < top_p\n"
        "    return torch.softmax(logits.masked_fill(~keep, -1e9) / temperature, dim=-1)\n"
        "def other(revise_after):\n"
        "    two = revise_after * 2\n"
        "    return torch.exp(two)\n"
    )
    assert reads_outside_the_method(tmp_path) == [
        "actors/a.py:4: computes p: exp of the decision tokens' scores",
        "actors/a.py:5: defines sequence_confidence (comap_async.method.decision's)",
        "actors/a.py:6: computes q: exp of a mean log-probability",
        "learner/l.py:5: computes p: softmax of the decision tokens' scores",
        "learner/l.py:7: computes p: sigmoid of the decision tokens' scores",
        "learner/l.py:9: computes q: exp of a mean log-probability",
    ]
