"""An experiment's figures from its played games: ``results.json`` (its ``figures``, ``comparisons``,
``noise`` and ``verdicts``), ``results.md`` and ``results.png``; and the README's table from them.

Everything here is computed from the per-game records the runner wrote, so ``comap experiment report``
redraws it all from a committed ``results.json`` without playing a game.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from experiments import stats
from experiments.spec import ExperimentSpec

README_BLOCK = re.compile(r"(<!-- results: (?P<path>[^ ]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def seed_rows(results: dict[str, Any], row: str) -> list[str]:
    """The played rows behind table row ``row``: itself, or its seeds' rows (``row@sN``)."""
    rows = results["rows"]
    return [row] if row in rows else sorted(r for r in rows if r.startswith(row + "@s"))


def complete(results: dict[str, Any], name: str) -> bool:
    return len(results["rows"][name]["episodes"]) == len(results["games"])


def outcomes(results: dict[str, Any], row: str) -> list[list[int]] | None:
    """Per game (in the split's order), the outcome over the row's seeds; None while any is unfinished."""
    names = seed_rows(results, row)
    if not names or not all(complete(results, n) for n in names):
        return None
    return [[int(results["rows"][n]["episodes"][g]["won"]) for n in names] for g in results["games"]]


PAPER_REFLECTION = {"urr": 0.16, "hrr": 0.08, "brp": 0.92}
"""The paper's URR, HRR and BRP on ALFWorld (Qwen3-4B), shown beside a judged row's."""


def reflection_figures(episodes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """URR, HRR, BRP and their sums over the judged steps of ``episodes`` (each game's ``judged`` counts
    by ``(m, z_draft, z_ref)``), by the one definition (:func:`comap_async.method.labels.reflection_diagnostics`);
    None when no game was judged."""
    from comap_async.method.labels import reflection_diagnostics

    steps = [
        tuple(int(c) for c in code) for e in episodes for code, n in (e.get("judged") or {}).items() for _ in range(n)
    ]
    if not steps:
        return None
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in reflection_diagnostics(steps).items()}


def row_figures(results: dict[str, Any], name: str) -> dict[str, Any]:
    """One played row's figures (a seed's, or a row with one seed)."""
    row = results["rows"][name]
    eps = [row["episodes"][g] for g in results["games"] if g in row["episodes"]]
    n = len(eps)
    won = sum(e["won"] for e in eps)
    steps = sum(e["steps"] for e in eps)
    low, high = stats.wilson(won, n)
    reasons: dict[str, int] = {}
    for e in eps:
        for k, v in (e.get("gate_reasons") or {}).items():
            reasons[k] = reasons.get(k, 0) + v
    f1 = [e["delta_f1"] for e in eps if "delta_f1" in e]
    return {
        "games": n,
        "won": won,
        "success": round(won / n, 4) if n else None,
        "ci95": [round(low, 4), round(high, 4)],
        "mean_steps": round(steps / n, 2) if n else None,
        "revisions": sum(e.get("revisions", 0) for e in eps),
        "steps": steps,
        "gate_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        "wm_delta_f1": round(sum(f1) / len(f1), 4) if f1 else None,
        "wall_s": row["wall_s"],
        "complete": n == len(results["games"]),
        **({"reflection": judged} if (judged := reflection_figures(eps)) else {}),
    }


def pooled_figures(results: dict[str, Any], row: str) -> dict[str, Any]:
    """A table row: one seed's figures, or the pooled figures over its seeds (success = all games won over
    all seeds; its Wilson interval over games x seeds)."""
    names = seed_rows(results, row)
    each = {n: row_figures(results, n) for n in names}
    if names == [row]:
        return {**each[row], "seeds": [results["rows"][row]["seed"]]}
    n = sum(f["games"] for f in each.values())
    won = sum(f["won"] for f in each.values())
    low, high = stats.wilson(won, n)
    steps = sum(f["steps"] for f in each.values())
    return {
        "games": len(results["games"]),
        "seeds": [results["rows"][x]["seed"] for x in names],
        "won": won,
        "played": n,
        "success": round(won / n, 4) if n else None,
        "ci95": [round(low, 4), round(high, 4)],
        "mean_steps": round(steps / n, 2) if n else None,
        "revisions": sum(f["revisions"] for f in each.values()),
        "steps": steps,
        "complete": all(f["complete"] for f in each.values()),
        **({"reflection": judged} if (judged := reflection_figures(pooled_episodes(results, names))) else {}),
        "per_seed": each,
    }


def pooled_episodes(results: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
    return [
        results["rows"][n]["episodes"][g]
        for n in names
        for g in results["games"]
        if g in results["rows"][n]["episodes"]
    ]


def comparisons(spec: ExperimentSpec, results: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """(each row against the reference and the spec's pairs; the noise floor: the seeds of one arm and
    method against each other), over finished rows only."""
    ref = spec.evaluation.reference
    pairs = [(r, ref) for r in spec.row_names() if r != ref] + [tuple(p) for p in spec.evaluation.pairs]
    out = []
    for row, against in pairs:
        a, b = outcomes(results, row), outcomes(results, against)
        if a is None or b is None:
            continue  # unfinished
        out.append(stats.compare(row, a, against, b))
    noise = []
    for row in spec.row_names():
        names = seed_rows(results, row)
        for i, first in enumerate(names):
            for second in names[i + 1 :]:
                a, b = outcomes(results, first), outcomes(results, second)
                if a is not None and b is not None:
                    noise.append(stats.compare(first, a, second, b))
    return out, noise


def write_report(spec: ExperimentSpec, results: dict[str, Any], out: Path) -> dict[str, Any]:
    """Figures, comparisons and verdicts into ``results``; ``results.json``, ``results.md`` and
    ``results.png`` written in ``out``. Returns ``results``."""
    from experiments.system import write_json

    source = results.get("source") or {}
    if (
        "run_dir" in source
    ):  # where the source ran on this machine: kept relative, a committed file names no outside path
        source["run_dir"] = repo_relative(source["run_dir"])
    results["figures"] = {row: pooled_figures(results, row) for row in spec.row_names() if seed_rows(results, row)}
    results["comparisons"], results["noise"] = comparisons(spec, results)
    results["verdicts"] = [c["verdict"] for c in results["comparisons"]]
    write_json(out / "results.json", results)
    (out / "results.md").write_text(markdown(spec, results))
    chart(results, out / "results.png")
    return results


def repo_relative(path: str) -> str:
    """``path`` relative to the repository when inside it, else its last two parts (a run directory's name)."""
    repo = Path(__file__).resolve().parents[1]
    p = Path(path)
    try:
        return str(p.resolve().relative_to(repo))
    except ValueError:
        return str(Path(*p.parts[-2:])) if len(p.parts) >= 2 else str(p)


def fmt_ci(ci: list[float]) -> str:
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def fmt_diff_ci(ci: list[float]) -> str:
    return f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"


def table(results: dict[str, Any]) -> str:
    """The rows' table (each seed, then the pooled figure): also the README's."""
    lines = [
        "| row | steps trained | won | success [95 % CI] | mean steps | revised steps |",
        "| --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for row, f in results["figures"].items():
        played = results["rows"][seed_rows(results, row)[0]]
        trained = played["step"] - results["source"]["step"] if played["arm"] != "source" else 0
        each = f.get("per_seed", {row: f})
        for name, g in each.items():
            label = name if len(each) > 1 else row
            if not g["games"]:
                lines.append(f"| `{label}` (not played yet) | {trained} | — | — | — | — |")
                continue
            done = "" if g["complete"] else f" (partial: {g['games']} of {len(results['games'])})"
            lines.append(
                f"| `{label}`{done} | {trained} | {g['won']}/{g['games']} | {g['success']:.2f} {fmt_ci(g['ci95'])} | "
                f"{g['mean_steps']} | {g['revisions']} of {g['steps']} |"
            )
        if len(each) > 1 and f["played"]:
            lines.append(
                f"| `{row}` pooled ({len(each)} seeds){'' if f['complete'] else ' (partial)'} | {trained} | "
                f"{f['won']}/{f['played']} | "
                f"{f['success']:.2f} {fmt_ci(f['ci95'])} | {f['mean_steps']} | {f['revisions']} of {f['steps']} |"
            )
    return "\n".join(lines) + "\n"


def markdown(spec: ExperimentSpec, results: dict[str, Any]) -> str:
    src = results["source"]
    lines = [
        f"# {spec.name}",
        "",
        f"Regenerate: `comap experiment run {results['spec']}` (resumable; `comap experiment report` redraws "
        "this file from results.json).",
        "",
        f"- Fork point: v{src['version']} at learner step {src['step']} ({src['phase']})"
        + (f", {src['wall_s'] / 60:.0f} minutes from empty" if "wall_s" in src else ""),
        (
            "- No fork: every row plays the fork point"
            if not results["forks"]
            else f"- Each fork trained {results['train_steps']} learner steps; "
        )
        + ", ".join(
            f"`{k}` v{f['version']} ({f['wall_s'] / 60:.0f} min" + gate_text(f) + ")"
            for k, f in results["forks"].items()
            if "version" in f
        ),
        f"- Played on {len(results['games'])} games of `{results['split']}`, {results['decoding']}",
        *(
            f"- `{row}`: finished games taken from the same cell (adapters, method, games, settings) in "
            f"`{r['taken_from']}`"
            for row, r in results["rows"].items()
            if r.get("taken_from")
        ),
        "",
        table(results),
        "## Paired against the reference, same games",
        "",
        "Difference of success rates with a bootstrap 95 % interval over games; exact McNemar (sign) p over the "
        "discordant games.",
        "",
    ]
    if results["comparisons"]:
        lines += [
            "| row | against | difference [95 % CI] | only row / only reference | p |",
            "| --- | --- | --- | ---: | ---: |",
        ]
        lines += [
            f"| `{c['row']}` | `{c['reference']}` | {c['difference']:+.2f} {fmt_diff_ci(c['ci95'])} | "
            f"{c['only_row']} / {c['only_reference']} | {c['p']:.3g} |"
            for c in results["comparisons"]
        ]
        lines += ["", "**Verdicts** (written by `experiments/stats.py`):", ""]
        lines += [f"- {v}" for v in results["verdicts"]]
    else:
        lines.append("No comparison yet: the rows are not all played.")
    if results["noise"]:
        lines += ["", "## Noise floor: one arm's seeds against each other", ""]
        lines += [f"- {c['verdict']}" for c in results["noise"]]
    sees = {row: r.get("sees") for row, r in results["rows"].items() if r.get("sees")}
    if sees:
        lines += ["", "## What each row reads", ""]
        lines += [f"- `{row}`: {describe_sees(s)}" for row, s in sees.items()]
    judged = {
        name: g["reflection"]
        for row, f in results["figures"].items()
        for name, g in {**f.get("per_seed", {}), row: f}.items()
        if g.get("reflection")
    }
    if judged:
        paper = PAPER_REFLECTION
        lines += [
            "",
            "## Reflection: URR, HRR, BRP",
            "",
            "Every step of a judged row played twice more from its state, the draft first and the reflected action "
            "first, each continued by the game's expert to the episode's end (docs/design.md section 11). URR: "
            "executed revisions among drafts that would have won; HRR: those that then lost; BRP: executed "
            f"revisions that turned a loss into a win. The paper (ALFWorld, Qwen3-4B): URR {paper['urr']}, "
            f"HRR {paper['hrr']}, BRP {paper['brp']}.",
            "",
            "| row | judged steps | executed revisions | winning drafts | URR | HRR | BRP |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| `{name}` | {r['steps']} | {r['sum_m']} | {r['sum_z_draft']} | {r['urr']:.2f} | {r['hrr']:.2f} | "
            f"{r['brp']:.2f} |"
            for name, r in judged.items()
        ]
    gates = {row: f["gate_reasons"] for row, f in results["figures"].items() if f.get("gate_reasons")}
    if gates:
        lines += ["", "## The action gate's reasons", ""]
        lines += [f"- `{row}`: " + ", ".join(f"{k} {v}" for k, v in g.items()) for row, g in gates.items()]
    return "\n".join(lines) + "\n"


def gate_text(fork: dict[str, Any]) -> str:
    """``; gate opened 3 of 41``: the action gate in the fork's own training (absent in older ledgers)."""
    return f"; gate opened {fork['gate_opened']} of {fork['gate_samples']}" if "gate_samples" in fork else ""


def describe_sees(sees: dict[str, Any]) -> str:
    return "; ".join(f"{role} " + ", ".join(f"{k}={v}" for k, v in what.items()) for role, what in sees.items())


def chart(results: dict[str, Any], path: Path) -> Path | None:
    """Success per row with its Wilson interval (the seeds' rows beside their pooled row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, lows, highs = [], [], [], []
    for row, f in results["figures"].items():
        for name, g in {**f.get("per_seed", {}), row: f}.items():
            if g["success"] is None:
                continue
            labels.append(name + ("" if g["complete"] else " (partial)"))
            values.append(g["success"])
            lows.append(g["success"] - g["ci95"][0])
            highs.append(g["ci95"][1] - g["success"])
    if not labels:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 4))
    ax.bar(range(len(labels)), values, yerr=[lows, highs], capsize=4, color="#4a78a8")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("games won (Wilson 95 %)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{results['experiment']}: {results['split']}, {len(results['games'])} games")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def readme_tables(readme: str, repo: Path) -> str:
    """``readme`` with every block between ``<!-- results: results/NAME/results.json -->`` and
    ``<!-- /results -->`` replaced by the table and verdicts generated from that file."""

    def block(m: re.Match) -> str:
        results = json.loads((repo / m["path"]).read_text())
        verdicts = "".join(f"\n- {v}" for v in results.get("verdicts", []))
        body = table(results) + (f"\nVerdicts (computed):{verdicts}\n" if verdicts else "")
        return m.group(1) + body + m.group(4)

    return README_BLOCK.sub(block, readme)
