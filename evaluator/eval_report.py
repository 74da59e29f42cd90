"""What ``comap eval`` writes: the summary of a split's episodes, reflection diagnostics and labels,
as JSON-ready dicts and Markdown (pure functions)."""

from __future__ import annotations

from collections import Counter
from typing import Any


def reflection_summary(judged: list[tuple[int, int, int]], max_steps: int) -> dict[str, Any]:
    """URR, HRR, BRP over every evaluated step ``(m, z_draft, z_ref)``, exactly as the paper's
    appendix C.2 defines them (:func:`comap_async.method.labels.reflection_diagnostics`), with the
    raw sums. Branches continue under the game's expert until the episode ends (``max_steps``)."""
    from comap_async.method.labels import EPS, reflection_diagnostics

    return {**reflection_diagnostics(judged), "eps": EPS, "branch_max_steps": max_steps}


def label_counts(results: list[tuple[Any, Any]]) -> dict[str, int]:
    """Reflection-initialisation samples per label over the episodes (``expert_better`` is y = 1)."""
    from comap_async.wire.protocol import REFLECTION_LABELS

    counts = dict.fromkeys(REFLECTION_LABELS, 0)
    for _, stats in results:
        for label, n in stats.labels.items():
            counts[label] += n
    return counts


def episode_record(game: Any, stats: Any) -> dict[str, Any]:
    """What the report keeps of one episode (JSON-ready): enough to rebuild the summary, so a
    comparison stopped between games keeps the episodes it had played (``evaluator.compare``)."""
    return {
        "game": game.name,
        "task_type": game.task_type,
        "won": bool(stats.won),
        "steps": stats.steps,
        # rewards are k / 100 each: their float sum is rounded, so a score of 0 does not print as -0.0
        "score": round(100.0 * stats.reward, 6) + 0.0,
        "revisions": stats.revisions,
        "invalid": stats.invalid,
        "parse_problems": stats.parse_problems,
        "loops": stats.loops,
        "delta_f1": list(stats.delta_f1),
        # the actions executed, canonical, in order: what a lost game did (its loops, its invalid commands)
        # can be read after the fact without playing it again
        "actions": [action for _, action in stats.state_actions],
        # why the action gate opened or stayed shut, per step (CoMap rows only; reasons: method/gates.py)
        **({"gate_reasons": dict(stats.gate_reasons)} if stats.gate_reasons else {}),
        **({"revisions_played": [list(r) for r in stats.revisions_played]} if stats.revisions_played else {}),
        **({"cycle_projected": stats.cycle_projected} if stats.cycle_projected else {}),
        **({"cycle_check": stats.cycle_check} if stats.cycle_check is not None else {}),
    }


def summarize(results: list[tuple[Any, Any]], split: str, version: int, wall_s: float) -> dict[str, Any]:
    return summarize_records([episode_record(g, s) for g, s in results], split, version, wall_s)


def summarize_records(records: list[dict[str, Any]], split: str, version: int, wall_s: float) -> dict[str, Any]:
    """The report over :func:`episode_record` records (its ``episodes`` without the per-step Delta-F1)."""
    n = len(records)
    steps = [r["steps"] for r in records]
    total_steps = max(1, sum(steps))
    f1 = [x for r in records for x in r["delta_f1"]]
    return {
        "split": split,
        "adapter_version": version,
        "games": n,
        "success_rate": sum(r["won"] for r in records) / n if n else 0.0,
        "mean_steps": sum(steps) / n if n else 0.0,
        # 100 x an episode's return: ScienceWorld's task score (0-100; rewards are score changes / 100),
        # ALFWorld's 100 for a win
        "mean_score": sum(r["score"] for r in records) / n if n else 0.0,
        "delta_f1": sum(f1) / len(f1) if f1 else None,
        "delta_f1_transitions": len(f1),
        "revision_rate": sum(r["revisions"] for r in records) / total_steps,
        "invalid_action_rate": sum(r["invalid"] for r in records) / total_steps,
        "loop_rate": sum(r["loops"] for r in records) / total_steps,
        # steps whose answer could not be read (the fallback action ran instead): a row where most are is
        # the prompt's format failing, not the method acting; None where an older record lacks the count
        "parse_problem_rate": (
            sum(r["parse_problems"] for r in records) / total_steps
            if all("parse_problems" in r for r in records)
            else None
        ),
        "gate_reasons": gate_reasons(records),
        "revision_verbs": revision_verbs(records),
        # eval.cycle_stop: steps counted above but not played (the episode had entered a cycle)
        "cycle_projected_steps": sum(r.get("cycle_projected", 0) for r in records),
        "wall_s": round(wall_s, 2),
        "episodes": [{k: round(v, 2) if k == "score" else v for k, v in r.items() if k != "delta_f1"} for r in records],
    }


def gate_reasons(records: list[dict[str, Any]]) -> dict[str, int] | None:
    """The action gate's reasons summed over the episodes, most frequent first; None for a row without
    reflections (a prompting method) or with an older record that lacks them."""
    if not records or not all("gate_reasons" in r for r in records):
        return None
    total = sum((Counter(r["gate_reasons"]) for r in records), Counter())
    return dict(sorted(total.items(), key=lambda kv: (-kv[1], kv[0])))


def revision_verbs(records: list[dict[str, Any]]) -> dict[str, int] | None:
    """The played revisions by what they replaced: ``"move -> go": 3`` (the draft's first word, then
    the executed revision's; a ``go`` that a revision picks over a ``move`` is where a won game can be
    lost), commonest first; None when no record lists its revisions (no CoMap row, or none revised)."""
    from comap_async.method.gates import action_verb

    def verb(action: str) -> str:
        return action_verb(action) or "?"

    pairs = Counter(f"{verb(draft)} -> {verb(ref)}" for r in records for _, draft, ref in r.get("revisions_played", ()))
    return dict(pairs.most_common()) or None


def counts_text(counts: dict[str, int]) -> str:
    """``keep 40, revised 2``: counts (the gate's reasons, the revisions' verbs) in the order given."""
    return ", ".join(f"{name} {n}" for name, n in counts.items())


def markdown(report: dict[str, Any]) -> str:
    f1 = "n/a" if report["delta_f1"] is None else f"{report['delta_f1']:.3f}"

    def num(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    rows = [
        f"# Evaluation: {report['split']} (adapters v{report['adapter_version']}, "
        f"method {report.get('method', 'comap')})",
        "",
        "| games | success rate | mean score | mean steps | world-model Delta-F1 | revision rate | invalid-action rate "
        "| loop rate | unreadable answers |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {report['games']} | {report['success_rate']:.3f} | {report.get('mean_score', 0.0):.1f} | "
        f"{report['mean_steps']:.1f} | {f1} | "
        f"{report['revision_rate']:.3f} | {report['invalid_action_rate']:.3f} | {num(report.get('loop_rate'))} | "
        f"{num(report.get('parse_problem_rate'))} |",
        "",
        "| game | won | score | steps | revisions |",
        "| --- | :---: | ---: | ---: | ---: |",
    ]
    rows += [
        f"| {e['game']} | {'yes' if e['won'] else 'no'} | {e.get('score', 0.0):g} | {e['steps']} | {e['revisions']} |"
        for e in report["episodes"]
    ]
    reasons = report.get("gate_reasons")
    if reasons:
        rows += ["", "Action gate per step: " + counts_text(reasons)]
    if report.get("revision_verbs"):
        rows += ["", "Revisions played (draft -> revision): " + counts_text(report["revision_verbs"])]
    r = report.get("reflection")
    if r is not None:
        rows += [
            "",
            "Reflection diagnostics (every step judged by a draft branch and a reflected-action branch, "
            "expert continuation to the episode's end):",
            "",
            "| steps | executed revisions (Σm) | winning drafts (Σz_draft) | URR | HRR | BRP |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| {r['steps']} | {r['sum_m']} | {r['sum_z_draft']} | {num(r['urr'])} | {num(r['hrr'])} "
            f"| {num(r['brp'])} |",
        ]
    labels = report.get("reflect_init_labels")
    if labels is not None:
        from comap_async.commands.stats import label_line

        rows += ["", "Reflection-mode initialisation " + label_line(labels)]
    return "\n".join(rows) + "\n"
