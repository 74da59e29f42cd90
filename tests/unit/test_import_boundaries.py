"""Processes meet only through the wire: an import walk over every module of the repository.

Process packages are ``actors``, ``broker``, ``learner``, ``evaluator`` and the embedded inference
server (``comap_async.inference``); everything else under ``comap_async`` is the core. A process may
import the core and itself, never another process, except that the evaluator plays its games with the
actor's own code (``evaluator`` may import ``actors``; nothing but the drivers imports the evaluator);
the core imports no process; ``actors``, ``broker`` and ``evaluator`` never import torch (they run on
CPU nodes without it); benchmarks do not import tests. The top-level packages import each other
without a cycle. Imports inside functions count: a lazy import still couples two processes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROCESSES = ("actors", "broker", "learner", "evaluator", "comap_async.inference")
MAY_IMPORT = {"evaluator": ("actors",)}  # process -> the other processes it may import (one way only)
NO_TORCH = ("actors", "broker", "evaluator")
HEAVY = ("torch", "transformers", "peft")
DRIVERS = ("benchmarks", "experiments")  # they drive the processes and may import them; none imports them
TOPS = ("comap_async", "actors", "broker", "learner", "evaluator", "benchmarks", "experiments")


def owner(module: str) -> str:
    """The process package a dotted module name belongs to, ``core``, or ``other`` (third party)."""
    for p in PROCESSES:
        if module == p or module.startswith(p + "."):
            return p
    return "core" if module == "comap_async" or module.startswith("comap_async.") else "other"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from comap_async import inference`` imports a process: judge each name it brings in
            found += [(node.lineno, f"{base}.{a.name}" if base else a.name) for a in node.names]
    return found


def violations(root: Path) -> list[str]:
    """Every forbidden import under ``root`` (a repository checkout), as ``path:line: reason``."""
    out = []
    for top in TOPS:
        for path in sorted((root / top).rglob("*.py")):
            module = module_name(path, root)
            me = owner(module)
            for line, name in imports_of(path, module):
                where = f"{path.relative_to(root)}:{line}"
                them = owner(name)
                if top in DRIVERS:
                    if name == "tests" or name.startswith("tests."):
                        out.append(f"{where}: {top} imports {name} (tests are not a library)")
                    continue
                if name.split(".")[0] in DRIVERS:
                    out.append(f"{where}: {me} imports {name} (a driver of the processes; nothing imports it)")
                if them not in ("core", "other") and them != me and them not in MAY_IMPORT.get(me, ()):
                    out.append(
                        f"{where}: {me} imports {name} ({them} is another process; meet through comap_async.wire)"
                        if me != "core"
                        else f"{where}: the core imports {name} (a process package)"
                    )
                if me in NO_TORCH and name.split(".")[0] in HEAVY:
                    out.append(f"{where}: {me} imports {name} (no torch on actor/broker nodes)")
    return out


def package_graph(root: Path) -> dict[str, dict[str, str]]:
    """The import graph of the top-level packages under ``root``: package -> {package it imports:
    the first ``path:line`` that does}. Lazy imports count; names imported by string (the CLI's
    command table) do not."""
    graph: dict[str, dict[str, str]] = {top: {} for top in TOPS}
    for top in TOPS:
        for path in sorted((root / top).rglob("*.py")):
            for line, name in imports_of(path, module_name(path, root)):
                them = name.split(".")[0]
                if them in graph and them != top:
                    graph[top].setdefault(them, f"{path.relative_to(root)}:{line}")
    return graph


def import_cycles(root: Path) -> list[str]:
    """Every cycle among the top-level packages (each once, from its smallest name), as
    ``a -> b (path:line) -> a (path:line)``; empty when the packages form a layered graph."""
    graph = package_graph(root)
    found: list[str] = []

    def walk(start: str, node: str, trail: list[str]) -> None:
        for nxt in sorted(graph[node]):
            step = f"{nxt} ({graph[node][nxt]})"
            if nxt == start:
                found.append(" -> ".join([start, *trail, step]))
            elif nxt > start and nxt not in [t.split(" ")[0] for t in trail]:
                walk(start, nxt, [*trail, step])

    for start in sorted(graph):
        walk(start, start, [])
    return found


def test_the_repository_keeps_its_import_boundaries():
    assert violations(REPO) == []


def test_the_top_level_packages_import_each_other_without_a_cycle():
    graph = package_graph(REPO)
    assert "actors" in graph["evaluator"] and "evaluator" not in graph["actors"]  # the walk sees the packages
    assert import_cycles(REPO) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for top in TOPS:
        (tmp_path / top).mkdir(parents=True, exist_ok=True)
        (tmp_path / top / "__init__.py").write_text("")
    (tmp_path / "comap_async" / "inference").mkdir(exist_ok=True)
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "rel,text,reason",
    [
        ("actors/worker.py", "def f():\n    from learner.loop import Learner\n", "actors imports learner.loop"),
        ("learner/loop.py", "from broker import store\n", "learner imports broker.store"),
        ("broker/server.py", "from . import x\nfrom actors import episodes\n", "broker imports actors.episodes"),
        (
            "actors/llm.py",
            "from comap_async.inference.engine import Engine\n",
            "actors imports comap_async.inference.engine",
        ),
        ("comap_async/gates.py", "import broker.store\n", "the core imports broker.store"),
        ("comap_async/wire/x.py", "from learner import losses\n", "the core imports learner.losses"),
        ("broker/ingest.py", "import torch\n", "broker imports torch"),
        ("actors/episodes.py", "from transformers import AutoTokenizer\n", "actors imports transformers"),
        (
            "benchmarks/b.py",
            "from tests.fixtures.broker import BrokerProc\n",
            "benchmarks imports tests.fixtures.broker",
        ),
        ("actors/x.py", "from experiments.stats import wilson\n", "actors imports experiments.stats"),
        ("comap_async/y.py", "import benchmarks.env_step\n", "core imports benchmarks.env_step"),
        ("actors/worker.py", "def f():\n    from evaluator import probes\n", "actors imports evaluator.probes"),
        ("broker/store.py", "from evaluator.eval_report import summarize\n", "broker imports evaluator.eval_report"),
        ("learner/loop.py", "import evaluator.evaluator\n", "learner imports evaluator.evaluator"),
        ("comap_async/z.py", "from evaluator import compare\n", "the core imports evaluator.compare"),
        ("evaluator/probes.py", "from learner.losses import x\n", "evaluator imports learner.losses"),
        ("evaluator/compare.py", "from broker.store import ReplayStore\n", "evaluator imports broker.store"),
        ("evaluator/evaluator.py", "import torch\n", "evaluator imports torch"),
        ("evaluator/x.py", "from experiments.stats import wilson\n", "evaluator imports experiments.stats"),
    ],
)
def test_an_added_cross_process_import_is_caught(tmp_path, rel, text, reason):
    (tmp_path / "comap_async" / "wire").mkdir(parents=True)
    root = _tree(tmp_path, {rel: text})
    found = violations(root)
    assert len(found) == 1 and reason in found[0], found


def test_allowed_imports_pass(tmp_path):
    (tmp_path / "comap_async" / "wire").mkdir(parents=True)
    root = _tree(
        tmp_path,
        {
            "actors/worker.py": "from comap_async.wire.broker_client import BrokerClient\nfrom actors import llm\n",
            "learner/loop.py": "import torch\nfrom comap_async.wire.inference_client import InferenceClient\n",
            "comap_async/inference/engine.py": "import torch\nfrom comap_async.config import Config\n",
            "broker/server.py": "from .store import ReplayStore\nfrom comap_async import gates\n",
            "evaluator/eval_runner.py": "from actors.worker import ActorWorker\nfrom .eval_report import summarize\n",
            "experiments/runner.py": "from evaluator.compare_cells import cell_key\nfrom broker import store\n",
            "benchmarks/b.py": "from evaluator.probes import auc\nfrom experiments.fork import fork_run\n",
        },
    )
    assert violations(root) == []
    assert import_cycles(root) == []


@pytest.mark.parametrize(
    "files,cycle",
    [
        (
            {
                "actors/llm.py": "def f():\n    from evaluator import probes\n",
                "evaluator/probes.py": "import actors.llm\n",
            },
            "actors -> evaluator (actors/llm.py:2) -> actors (evaluator/probes.py:1)",
        ),
        (
            {
                "experiments/runner.py": "from benchmarks import env_step\n",
                "benchmarks/env_step.py": "from experiments.stats import wilson\n",
            },
            "benchmarks -> experiments (benchmarks/env_step.py:1) -> benchmarks (experiments/runner.py:1)",
        ),
        (
            {
                "comap_async/cli.py": "from learner.cli import main\n",
                "learner/cli.py": "from broker import store\n",
                "broker/store.py": "import comap_async.wire\n",
            },
            "broker -> comap_async (broker/store.py:1) -> learner (comap_async/cli.py:1) -> broker (learner/cli.py:1)",
        ),
    ],
)
def test_an_import_cycle_between_packages_is_caught(tmp_path, files, cycle):
    assert import_cycles(_tree(tmp_path, files)) == [cycle]


def test_no_test_imports_a_benchmark(tmp_path):
    """benchmarks/ holds performance checks, each run by its path; what a test needs of one lives in a package
    (experiments/ or the system's own). An import of ``benchmarks``, of a benchmark module by its bare name
    (benchmarks/ put on sys.path) or one loaded by name or path in-process all count; running a script as a
    subprocess does not."""
    loaders = {"import_module", "run_module", "run_path", "spec_from_file_location"}

    def benchmark_imports(root: Path) -> list[str]:
        bare = {p.stem for p in (root / "benchmarks").glob("*.py")}
        out = []
        for path in sorted((root / "tests").rglob("*.py")):
            where = path.relative_to(root)
            for line, name in imports_of(path, module_name(path, root)):
                if name.split(".")[0] == "benchmarks" or name.split(".")[0] in bare:
                    out.append(f"{where}:{line}: imports {name}")
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in loaders:
                    args = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                    if any(a.startswith("benchmarks") for a in args):
                        out.append(f"{where}:{node.lineno}: loads {args[0]}")
        return out

    assert benchmark_imports(REPO) == []
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "env_step.py").write_text("")
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    for rel in ("tests/__init__.py", "tests/unit/__init__.py"):
        (tmp_path / rel).write_text("")
    (tmp_path / "tests" / "unit" / "test_a.py").write_text("def test_a():\n    from benchmarks.env_step import main\n")
    (tmp_path / "tests" / "unit" / "test_b.py").write_text("import sys\n\nimport env_step\n")
    (tmp_path / "tests" / "test_c.py").write_text("import runpy\n\nrunpy.run_path('benchmarks/env_step.py')\n")
    ok = "import subprocess\nimport sys\n\nsubprocess.run([sys.executable, 'benchmarks/env_step.py'])\n"
    (tmp_path / "tests" / "test_d.py").write_text(ok)
    assert benchmark_imports(tmp_path) == [
        "tests/test_c.py:3: loads benchmarks/env_step.py",
        "tests/unit/test_a.py:2: imports benchmarks.env_step.main",
        "tests/unit/test_b.py:3: imports env_step",
    ]
