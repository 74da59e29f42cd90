"""What ``comap eval`` writes: the summary of a split's episodes, reflection diagnostics and labels,
as JSON-ready dicts and Markdown (pure functions)."""

from __future__ import annotations

from typing import Any


def reflection_summary(judged: list[tuple[int, int, int]], max_steps: int) -> dict[str, Any]:
    """URR, HRR, BRP over every evaluated step ``(m, z_draft, z_ref)``, exactly as the paper's
    appendix C.2 defines them (:func:`comap_async.diagnostics.reflection_diagnostics`), with the
    raw sums. Branches continue under the game's expert until the episode ends (``max_steps``)."""
    from comap_async.diagnostics import EPS, reflection_diagnostics

    return {**reflection_diagnostics(judged), "eps": EPS, "branch_max_steps": max_steps}


def label_counts(results: list[tuple[Any, Any]]) -> dict[str, int]:
    """Reflection-initialisation samples per label over the episodes (``expert_better`` is y = 1)."""
    from comap_async.wire.protocol import REFLECTION_LABELS

    counts = dict.fromkeys(REFLECTION_LABELS, 0)
    for _, stats in results:
        for label, n in stats.labels.items():
            counts[label] += n
    return counts


def summarize(results: list[tuple[Any, Any]], split: str, version: int, wall_s: float) -> dict[str, Any]:
    n = len(results)
    steps = [s.steps for _, s in results]
    total_steps = max(1, sum(steps))
    f1 = [x for _, s in results for x in s.delta_f1]
    return {
        "split": split,
        "adapter_version": version,
        "games": n,
        "success_rate": sum(s.won for _, s in results) / n if n else 0.0,
        "mean_steps": sum(steps) / n if n else 0.0,
        # 100 x an episode's return: ScienceWorld's task score (0-100; rewards are score changes / 100),
        # ALFWorld's 100 for a win
        "mean_score": 100.0 * sum(s.reward for _, s in results) / n if n else 0.0,
        "delta_f1": sum(f1) / len(f1) if f1 else None,
        "delta_f1_transitions": len(f1),
        "revision_rate": sum(s.revisions for _, s in results) / total_steps,
        "invalid_action_rate": sum(s.invalid for _, s in results) / total_steps,
        "loop_rate": sum(s.loops for _, s in results) / total_steps,
        "guard_rate": sum(s.guarded for _, s in results) / total_steps,
        "wall_s": round(wall_s, 2),
        "episodes": [
            {
                "game": g.name,
                "task_type": g.task_type,
                "won": s.won,
                "steps": s.steps,
                "score": round(100.0 * s.reward, 2),
                "revisions": s.revisions,
                "invalid": s.invalid,
                "loops": s.loops,
                "guarded": s.guarded,
            }
            for g, s in results
        ],
    }


def markdown(report: dict[str, Any]) -> str:
    f1 = "n/a" if report["delta_f1"] is None else f"{report['delta_f1']:.3f}"

    def num(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    rows = [
        f"# Evaluation: {report['split']} (adapters v{report['adapter_version']}, "
        f"method {report.get('method', 'comap')})",
        "",
        "| games | success rate | mean score | mean steps | world-model Delta-F1 | revision rate | invalid-action rate "
        "| loop rate |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {report['games']} | {report['success_rate']:.3f} | {report.get('mean_score', 0.0):.1f} | "
        f"{report['mean_steps']:.1f} | {f1} | "
        f"{report['revision_rate']:.3f} | {report['invalid_action_rate']:.3f} | {num(report.get('loop_rate'))} |",
        "",
        "| game | won | score | steps | revisions |",
        "| --- | :---: | ---: | ---: | ---: |",
    ]
    rows += [
        f"| {e['game']} | {'yes' if e['won'] else 'no'} | {e.get('score', 0.0):g} | {e['steps']} | {e['revisions']} |"
        for e in report["episodes"]
    ]
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
