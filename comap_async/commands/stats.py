"""``comap stats``: a compact live summary of a running system, from the broker's HTTP API.

Sections: registry, stores, episodes and success by adapter version (with Delta-F1 and revision
rate), gates by version, throughput (env steps/s, transitions/s, learner tokens/s), staleness.
``--plot DIR`` writes the same curves as PNG charts.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from comap_async.cli import add_config_arguments
from comap_async.wire.messages import COEVOLVE


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--url", default=None, help="broker HTTP base URL (default: from broker.host/http_port)")
    p.add_argument("--limit", type=int, default=5000, help="newest records per store to aggregate")
    p.add_argument("--plot", metavar="DIR", default=None, help="also write PNG charts into DIR")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


# ----------------------------------------------------------------------------- aggregation (pure)
def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def by_version(episodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Training episodes grouped by policy adapter version: count, SR, steps, Delta-F1, revision rate."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for e in episodes:
        groups[(int(e.get("policy_version", 0)), "eval" if e.get("eval") else e.get("phase", "?"))].append(e)
    rows = []
    for (version, phase), eps in sorted(groups.items()):
        metrics = [e.get("metrics") or {} for e in eps]
        rows.append(
            {
                "version": version,
                "phase": phase,
                "episodes": len(eps),
                "success_rate": sum(bool(e.get("won")) for e in eps) / len(eps),
                "mean_steps": sum(int(e.get("steps", 0)) for e in eps) / len(eps),
                "delta_f1": _mean([m["delta_f1"] for m in metrics if "delta_f1" in m]),
                "revision_rate": _mean([m["revision_rate"] for m in metrics if "revision_rate" in m]),
                "invalid_rate": _mean([m["invalid_rate"] for m in metrics if "invalid_rate" in m]),
            }
        )
    return rows


def gates_by_version(reflections: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """World-state gate adoption (imagined s̄), accepted revisions (y=1) and the action gate's reasons
    (``revised``, ``keep``, ``low_confidence``, ``same_action``) per policy version."""
    groups: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in reflections:
        if r.get("source") == "gate":
            groups[int(r.get("policy_version", 0))].append(r)
    return [
        {
            "version": v,
            "samples": len(rs),
            "ws_adoption": sum(bool(r.get("ws_imagined")) for r in rs) / len(rs),
            "revision_accepted": sum(int(r.get("y", 0)) for r in rs) / len(rs),
            "reasons": dict(sorted(Counter(str(r.get("ag_reason", "?")) for r in rs).items())),
        }
        for v, rs in sorted(groups.items())
    ]


def env_steps_per_s(episodes: list[dict[str, Any]]) -> float | None:
    """Environment steps per second over the span the given episodes cover."""
    timed = [e for e in episodes if "ts" in e and "wall_s" in e]
    if len(timed) < 2:
        return None
    start = min(e["ts"] - e["wall_s"] for e in timed)
    span = max(e["ts"] for e in timed) - start
    return sum(int(e.get("steps", 0)) for e in timed) / span if span > 0 else None


def staleness(records: list[dict[str, Any]], current: int) -> dict[str, int]:
    """How many versions behind the current policy the newest stored samples are."""
    hist: dict[str, int] = defaultdict(int)
    for r in records:
        hist[str(max(0, current - int(r.get("policy_version", 0))))] += 1
    return dict(sorted(hist.items(), key=lambda kv: int(kv[0])))


def summarize(
    stats: dict[str, Any], episodes: list[dict[str, Any]], reflections: list[dict[str, Any]]
) -> dict[str, Any]:
    reg = stats.get("registry") or {}
    current = int((reg.get("versions") or {}).get("policy", 0))
    learner = stats.get("learner") or {}
    return {
        "run": stats.get("run"),
        "registry": reg,
        "stores": stats.get("stores", {}),
        "episodes_by_version": by_version(episodes),
        "gates_by_version": gates_by_version(reflections),
        "gates_total": stats.get("gates", {}),
        "throughput": {
            "env_steps_per_s": env_steps_per_s(episodes),
            "transitions_per_s": (stats.get("ingest") or {}).get("rate_per_s"),
            "learner_tokens_per_s": learner.get("learner/tokens_per_s"),
        },
        "staleness": {"skipped": stats.get("stale_skipped", {}), "versions_behind": staleness(reflections, current)},
        "reflect_init_labels": stats.get("reflect_init_labels", {}),
        "eval": stats.get("eval") or [],
        "learner": learner,
    }


# the learner's latest scalars (sent with each publish), in the order `comap stats` shows them
LEARNER_SCALARS = (
    "wm/ce",
    "wm/change_nll",
    "wm/kl",
    "policy/draft_ce",
    "policy/reflect_ce",
    "policy/bce",
    "policy/revise_label_share",
    "learner/tokens_per_s",
)


EVAL_COLUMNS = (
    ("wm_delta_f1", "wm_dF1"),
    ("wm_delta_f1_failures", "fail_dF1"),
    ("draft_accuracy", "draft_acc"),
    ("admissible_rate", "admissible"),
    ("reflection_problem_rate", "refl_prob"),
    ("gate_open_rate", "gate_open"),
    ("p_discrimination", "p_discr"),
    ("success_rate", "success"),
)


def eval_table(results: list[dict[str, Any]]) -> list[str]:
    """The evaluator's held-out figures, one row per evaluated version."""
    if not results:
        return ["  (no evaluated versions yet: is `comap evaluator` running?)"]
    rows = [
        f"  {'ver':>4} {'phase':<12} {'step':>6} " + " ".join(f"{h:>10}" for _, h in EVAL_COLUMNS) + f" {'split':>12}"
    ]
    for r in results:
        rows.append(
            f"  {r['version']:>4} {str(r.get('phase')):<12} {r.get('learner_step', 0):>6} "
            + " ".join(f"{_fmt(r.get(k)):>10}" for k, _ in EVAL_COLUMNS)
            + f" {str(r.get('split')):>12}"
        )
    return rows


def eval_points(results: list[dict[str, Any]], key: str) -> list[tuple[int, float, float]]:
    """``(version, minutes since the first result, value)`` of one held-out figure, in version
    order (results may come in any order, e.g. ``v10.json`` sorted before ``v2.json``)."""
    t0 = min((r["ts"] for r in results if "ts" in r), default=0.0)
    return sorted((int(r["version"]), (r.get("ts", t0) - t0) / 60, r[key]) for r in results if r.get(key) is not None)


def plot_eval(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """``eval_wm_delta_f1.png``, ``eval_draft_accuracy.png``, ``eval_success_rate.png``: each
    held-out figure against the adapter version and against wall time since the first evaluation."""
    import matplotlib.pyplot as plt

    written = []
    for key, title in (
        ("wm_delta_f1", "World-model Delta-F1 (held-out probes)"),
        ("draft_accuracy", "Draft accuracy along held-out walkthroughs"),
        ("success_rate", "Success rate (held-out games, CoMap loop)"),
    ):
        pts = eval_points(results, key)
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
        for ax, i, xlabel in (
            (a1, 0, "adapter version (0 = base)"),
            (a2, 1, "wall time (minutes since the first evaluation)"),
        ):
            if pts:
                ax.plot([p[i] for p in pts], [p[2] for p in pts], marker="o")
            else:
                ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
            ax.set(xlabel=xlabel)
            ax.grid(alpha=0.3)
        a1.set(ylabel=key, ylim=(-0.02, 1.02))  # all three are shares: one scale, a flat 0 stays at the bottom
        a1.xaxis.get_major_locator().set_params(integer=True)
        fig.suptitle(title)
        fig.tight_layout()
        path = out_dir / f"eval_{key}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def label_line(labels: dict[str, int]) -> str:
    """Reflection-initialisation labels: y=1 (the expert branch did strictly better), y=0 from
    drafts equal to the expert action, y=0 from ties or worse."""
    if not labels:
        return "labels: (no reflection-initialisation samples yet)"
    won, sooner, eq, nb = (labels.get(k, 0) for k in ("expert_better", "expert_sooner", "equal_draft", "not_better"))
    y1 = won + sooner
    total = y1 + eq + nb
    return (
        f"labels: y=1 {y1} (the draft's branch lost {won}, won later {sooner})  y=0 equal drafts {eq}  "
        f"y=0 ties or worse {nb}  (share y=1 {y1 / total:.3f} of {total})"
    )


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def render(s: dict[str, Any]) -> str:
    reg = s["registry"]
    out = [
        f"run        {s.get('run') or '(a broker that does not say)'}",
        f"registry   phase={reg.get('phase')} versions={reg.get('versions')} learner_step={reg.get('step')}",
        "",
        "stores     "
        + "  ".join(
            f"{k}={v.get('count')}/{v.get('capacity')} (evicted {v.get('evicted')})" for k, v in s["stores"].items()
        ),
        "",
        "episodes by adapter version",
        f"  {'ver':>4} {'phase':<12} {'episodes':>8} {'success':>8} "
        f"{'steps':>6} {'dF1':>6} {'revise':>7} {'invalid':>7}",
    ]
    for r in s["episodes_by_version"]:
        out.append(
            f"  {r['version']:>4} {r['phase']:<12} {r['episodes']:>8} {r['success_rate']:>8.3f} "
            f"{r['mean_steps']:>6.1f} {_fmt(r['delta_f1']):>6} {_fmt(r['revision_rate']):>7} "
            f"{_fmt(r['invalid_rate']):>7}"
        )
    if not s["episodes_by_version"]:
        out.append("  (no episodes yet)")
    out += [
        "",
        "gates by adapter version (reflection samples derived by the broker)",
        f"  {'ver':>4} {'samples':>8} {'ws_adoption':>12} {'revision_accepted':>18}  reasons",
    ]
    out += [
        f"  {g['version']:>4} {g['samples']:>8} {g['ws_adoption']:>12.3f} {g['revision_accepted']:>18.3f}  "
        + " ".join(f"{k}={n}" for k, n in (g.get("reasons") or {}).items())
        for g in s["gates_by_version"]
    ] or ["  (no gated samples yet)"]
    out += ["", "reflect_init " + label_line(s.get("reflect_init_labels") or {})]
    out += ["", "held-out eval by adapter version (comap evaluator)"] + eval_table(s.get("eval") or [])
    t = s["throughput"]
    out += [
        f"throughput env_steps/s={_fmt(t['env_steps_per_s'], '.2f')} "
        f"transitions/s={_fmt(t['transitions_per_s'], '.2f')} "
        f"learner_tokens/s={_fmt(t['learner_tokens_per_s'], '.1f')}",
        f"staleness  versions_behind={s['staleness']['versions_behind']} skipped={s['staleness']['skipped']}",
    ]
    learner = s.get("learner") or {}
    shown = [k for k in LEARNER_SCALARS if k in learner]
    out.append(
        "learner    "
        + (
            "  ".join(f"{k}={_fmt(float(learner[k]))}" for k in shown)
            if shown
            else "(no publish yet: the learner reports its scalars with each publish)"
        )
    )
    return "\n".join(out)


# ----------------------------------------------------------------------------- plots
def plot(s: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    # the policy's curves: co-evolution episodes only (warm-up episodes replay demonstrations)
    eps = [r for r in s["episodes_by_version"] if r["phase"] == COEVOLVE]
    gates = s["gates_by_version"]
    charts = [
        ("success_rate.png", "Success rate by adapter version", eps, "success_rate"),
        ("delta_f1.png", "World-model Delta-F1 by adapter version", eps, "delta_f1"),
        ("revision_rate.png", "Revision rate by adapter version", eps, "revision_rate"),
        ("gate_adoption.png", "World-state gate adoption by adapter version", gates, "ws_adoption"),
    ]
    written = []
    for name, title, rows, key in charts:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        pts = [(r["version"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        else:
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=title, xlabel="policy adapter version", ylabel=key)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    hist = s["staleness"]["versions_behind"]
    ax.bar(list(hist.keys()) or ["0"], list(hist.values()) or [0])
    ax.set(title="Staleness of stored samples", xlabel="versions behind the current policy", ylabel="samples")
    fig.tight_layout()
    fig.savefig(out_dir / "staleness.png", dpi=100)
    plt.close(fig)
    return [*written, out_dir / "staleness.png", *plot_eval(s.get("eval") or [], out_dir)]


# ----------------------------------------------------------------------------- command
def _get(url: str, token: str | None) -> Any:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"comap stats: {url}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:200]}") from None
    except OSError as exc:
        raise SystemExit(f"comap stats: cannot reach the broker at {url} ({exc}); is `comap broker` running?") from None


def run(args: argparse.Namespace) -> int:
    from comap_async.config import load_config

    cfg = load_config(args.config, args.overrides)
    host = "127.0.0.1" if cfg.broker.host in ("0.0.0.0", "localhost") else cfg.broker.host
    base = (args.url or f"http://{host}:{cfg.broker.http_port}").rstrip("/")
    token = cfg.broker.http_token
    stats = _get(f"{base}/stats", token)
    asked = next((o.split("=", 1)[1] for o in reversed(args.overrides) if o.startswith("run.name=")), None)
    if asked and stats.get("run") and stats["run"] != asked:
        raise SystemExit(
            f"comap stats: the broker at {base} serves run {stats['run']!r}, not {asked!r}: comap stats reads "
            f"a running broker, and {asked!r}'s is not the one on that port"
        )
    episodes = _get(f"{base}/records?store=episodes&limit={args.limit}", token)["items"]
    reflections = _get(f"{base}/records?store=reflections&limit={args.limit}", token)["items"]
    summary = summarize(stats, episodes, reflections)
    print(json.dumps(summary, indent=2, default=str) if args.json else render(summary))
    if args.plot:
        for path in plot(summary, Path(args.plot)):
            print(f"wrote {path}")
    return 0
