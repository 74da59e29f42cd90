"""What ``comap compare`` writes: one row per method or run, as the paper's main table (success
rate and world-model Delta-F1) and its ablation figure (bars), from pure functions."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from evaluator.eval_report import counts_text

METHOD_LABELS = {
    "react": "ReAct",
    "imagine_and_act": "Imagine-and-Act",
    "draft_only": "Draft only",
    "comap": "CoMap",
    "comap_oracle": "CoMap, true next states",
    "lookahead": "Look-ahead (WebEvolver)",
}


def run_label(ablation: list[str], name: str, methods: list[str] | None = None) -> str:
    """``CoMap (run)`` for the method itself, ``ablation frozen_wm (run)`` for an ablated run,
    ``CoMap + imagined_episodes (run)`` with a related method's switch on (``name``: its run
    directory's name)."""
    head = "CoMap" if not ablation else f"ablation {'+'.join(ablation)}"
    return f"{head}{''.join(f' + {m}' for m in methods or [])} ({name})"


def wilson_interval(wins: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a success rate of ``wins`` in ``n`` games: how far the rate
    of 20 games moves by chance alone (0 of 20 is still compatible with up to 0.16)."""
    if n == 0:
        return 0.0, 1.0
    p = wins / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def row(
    label: str,
    kind: str,
    method: str,
    report: dict[str, Any],
    run: str | None = None,
    ablation: list[str] | None = None,
) -> dict[str, Any]:
    """One line of the comparison from an evaluation report (:func:`evaluator.eval_report.summarize`)."""
    wins = round(report["success_rate"] * report["games"])
    return {
        "label": label,
        "kind": kind,
        "method": method,
        "run": run,
        "ablation": list(ablation or []),
        "adapter_version": report["adapter_version"],
        "games": report["games"],
        "wins": wins,
        "success_rate": report["success_rate"],
        "success_interval": list(wilson_interval(wins, report["games"])),
        "mean_score": report.get("mean_score"),
        "delta_f1": report["delta_f1"],
        "delta_f1_transitions": report["delta_f1_transitions"],
        "mean_steps": report["mean_steps"],
        "revision_rate": report["revision_rate"],
        "invalid_action_rate": report["invalid_action_rate"],
        "loop_rate": report.get("loop_rate"),
        "parse_problem_rate": report.get("parse_problem_rate"),
        "gate_reasons": report.get("gate_reasons"),
        "revision_verbs": report.get("revision_verbs"),
        "wall_s_per_step": wall_per_step(report),
        "server_per_step": report.get("server_per_step"),
        # per game, its score (ALFWorld: 100 for a win): what pairs two rows game by game (:func:`paired_difference`)
        "game_scores": {e["game"]: e["score"] for e in report.get("episodes", [])},
        "games_won": sorted(e["game"] for e in report.get("episodes", []) if e["won"]),
    }


def paired_difference(
    a: dict[str, float], b: dict[str, float], resamples: int = 4000, seed: int = 0
) -> tuple[float, float, float, int] | None:
    """Row ``b``'s mean score minus row ``a``'s over the games both played, with a 95 % bootstrap
    interval (games resampled with replacement, a fixed seed so a table reads the same twice):
    ``(difference, low, high, games)``, None when they share no game. Pairing by game removes how
    hard each game is from the comparison, which two separate intervals cannot; an interval that
    excludes 0 is a difference these games show."""
    import random

    shared = sorted(set(a) & set(b))
    if not shared:
        return None
    diffs = [b[g] - a[g] for g in shared]
    n = len(diffs)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    return sum(diffs) / n, means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1], n


def reference_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row the others are paired with: the first run of the method itself (no ablation)."""
    return next((r for r in rows if r["kind"] == "run" and not r["ablation"]), None)


def paired_lines(rows: list[dict[str, Any]]) -> list[str]:
    """``- <row>: +5.0 (-10.0 to +20.0) over 20 games`` per row against :func:`reference_row`."""
    ref = reference_row(rows)
    if ref is None or not ref.get("game_scores"):
        return []
    lines = [
        "",
        f"Paired with {ref['label']} game by game (mean score difference, 95 % bootstrap interval over the "
        "games both played; an interval that excludes 0 is a difference these games show):",
        "",
    ]
    for r in rows:
        if r is ref or not r.get("game_scores"):
            continue
        d = paired_difference(ref["game_scores"], r["game_scores"])
        if d is not None:
            lines.append(f"- {r['label']}: {d[0]:+.1f} ({d[1]:+.1f} to {d[2]:+.1f}) over {d[3]} games")
    return lines


def won_by(rows: list[dict[str, Any]], games: int) -> list[str]:
    """Per game any row won, the rows that won it: whether rows win the same games or different ones."""
    won: dict[str, list[str]] = {}
    for r in rows:
        for game in r.get("games_won") or []:
            won.setdefault(game, []).append(r["label"])
    if not won:
        return []
    return ["", f"Games won ({len(won)} of {games}), by which rows:", ""] + [
        f"- `{game}`: {'; '.join(labels)}" for game, labels in sorted(won.items())
    ]


def gate_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per row that reflects, its action gate's steps by reason: a revision rate of 0 says the gate stayed
    shut, this says why (``keep``: p_revise at or below tau_p; ``low_confidence``: q_ref at or below tau_q;
    ``same_action``: the reflection repeated the draft; ``unreadable``)."""
    gated = [r for r in rows if r.get("gate_reasons")]
    if not gated:
        return []

    def revisions(r: dict[str, Any]) -> str:
        verbs = r.get("revision_verbs")
        return f"; revisions played (draft -> revision): {counts_text(verbs)}" if verbs else ""

    return ["", "The action gate, steps by reason:", ""] + [
        f"- {r['label']}: {counts_text(r['gate_reasons'])}{revisions(r)}" for r in gated
    ]


def wall_per_step(report: dict[str, Any]) -> float | None:
    """The evaluation's wall seconds per environment step it played (the steps ``eval.cycle_stop``
    projected were not played): a row's cost, comparable between rows played alike (the same
    server, threads and concurrent games). None for a report without its wall time."""
    if not report.get("wall_s"):
        return None
    played = report["mean_steps"] * report["games"] - report.get("cycle_projected_steps", 0)
    return report["wall_s"] / max(1.0, played)


def server_per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float] | None:
    """Where the server's time went while a row played ``steps`` environment steps, from its engine
    counters read before and after (:meth:`InferenceClient.engine_counters`): prompt tokens, the share of
    them whose KV came from the prefix cache, generated tokens, and prefill and decode seconds, per step;
    the mean decode batch. None when the server does not count them or nothing was played."""
    if steps <= 0 or not before or not after or any(k not in after for k in before):
        return None
    d = {k: after[k] - before[k] for k in before}
    prompt = d.get("prompt_tokens", 0.0)
    return {
        "steps": steps,
        "prompt_tokens": prompt / steps,
        "cached_share": d.get("prefix_cache_hit_tokens", 0.0) / prompt if prompt else 0.0,
        "generated_tokens": d.get("generation_tokens", 0.0) / steps,
        "prefill_s": d.get("prefill_seconds", 0.0) / steps,
        "decode_s": d.get("decode_seconds", 0.0) / steps,
        "mean_batch": d.get("decode_rows", 0.0) / d["decode_steps"] if d.get("decode_steps") else 0.0,
    }


def server_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per row whose server counted it, where the server's time went per played step."""
    counted = [r for r in rows if r.get("server_per_step")]
    if not counted:
        return []
    out = [
        "",
        "The server per played step (this sitting's steps; the prefill counts the prompt tokens the prefix "
        "cache did not hold):",
        "",
    ]
    for r in counted:
        s = r["server_per_step"]
        out.append(
            f"- {r['label']}: {s['prompt_tokens']:.0f} prompt tokens ({s['cached_share']:.0%} from the prefix "
            f"cache), {s['generated_tokens']:.0f} generated; prefill {s['prefill_s']:.2f} s, decode "
            f"{s['decode_s']:.2f} s (mean batch {s['mean_batch']:.1f}) over {s['steps']} steps"
        )
    return out


def markdown(rows: list[dict[str, Any]], split: str, games: int) -> str:
    def num(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    lines = [
        f"# Comparison on {split} ({games} games, the same for every row)",
        "",
        "| method / run | adapters | success rate | won (95 % interval) | mean score | world-model Delta-F1 "
        "| mean steps | revision rate | invalid-action rate | loop rate | unreadable answers "
        "| wall s per played step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        adapters = "base" if r["adapter_version"] == 0 else f"v{r['adapter_version']}"
        low, high = r["success_interval"]
        score = "n/a" if r.get("mean_score") is None else f"{r['mean_score']:.1f}"
        cost = "n/a" if r.get("wall_s_per_step") is None else f"{r['wall_s_per_step']:.1f}"
        lines.append(
            f"| {r['label']} | {adapters} | {num(r['success_rate'])} | {r['wins']}/{r['games']} "
            f"({low:.2f}-{high:.2f}) | {score} | {num(r['delta_f1'])} | "
            f"{r['mean_steps']:.1f} | {num(r['revision_rate'])} | {num(r['invalid_action_rate'])} | "
            f"{num(r.get('loop_rate'))} | {num(r.get('parse_problem_rate'))} | {cost} |"
        )
    lines += [
        "",
        "Delta-F1 is n/a where a method never imagines the executed action (ReAct, Draft only). The "
        "interval is the success rate's 95 % Wilson interval over the games: two rows whose intervals "
        "overlap are not shown apart by this many games. Mean score: 100 per won game on ALFWorld, "
        "the task score (0-100) on ScienceWorld. Wall s per played step: the row's evaluation time over "
        "the environment steps it played (its games concurrent on one server), its cost per step. "
        "Unreadable answers: the share of steps with a model answer that could not be read (a draft, ReAct or "
        "final-action answer: the fallback action ran instead; a reflection: the draft ran; n/a for rows "
        "measured before it was counted).",
    ]
    lines += gate_lines(rows) + server_lines(rows) + paired_lines(rows) + won_by(rows, games)
    return "\n".join(lines) + "\n"


def chart_panels(rows: list[dict[str, Any]], scored: bool) -> list[tuple[str, list[float | None]]]:
    """The chart's two panels, (axis name, one value in 0-1 per row; None: n/a)."""
    if scored:
        first = ("mean score / 100", [None if r.get("mean_score") is None else r["mean_score"] / 100 for r in rows])
    else:
        first = ("success rate", [r["success_rate"] for r in rows])
    return [first, ("world-model Delta-F1", [r["delta_f1"] for r in rows])]


def chart_label(label: str, width: int = 44) -> str:
    """A row's label wrapped onto lines of ``width`` characters at its `` + `` joins and spaces: a row
    with several switches is longer than the chart is wide, and the figure cannot make room for one line."""
    import textwrap

    return textwrap.fill(label, width=width, break_long_words=False, break_on_hyphens=False)


def bar_figure(rows: list[dict[str, Any]], title: str, scored: bool = False) -> Any:
    """Two panels of horizontal bars (success rate, or the mean score / 100 where the environment
    scores partial progress (``scored``: ScienceWorld); Delta-F1), one bar per row: a matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [chart_label(r["label"]) for r in rows]
    lines = sum(label.count("\n") + 1 for label in labels)
    colours = ["#4c72b0" if r["kind"] == "run" else "#999999" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.25 * lines + 0.35 * len(rows) + 1.6), sharey=True)
    for ax, (name, values) in zip(axes, chart_panels(rows, scored)):
        ax.barh(range(len(rows)), [0.0 if v is None else v for v in values], color=colours)
        for i, v in enumerate(values):
            ax.text(v or 0.0, i, " n/a" if v is None else f" {v:.2f}", va="center", fontsize=8)
        ax.set_xlim(0, 1.05)
        ax.set_xlabel(name)
    axes[0].set_yticks(range(len(rows)), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def bar_chart(rows: list[dict[str, Any]], path: Path, title: str, scored: bool = False) -> Path:
    """:func:`bar_figure` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = bar_figure(rows, title, scored)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
