"""How long one evaluation of one version takes (the evaluator's: probes on ``eval.games`` games and
``eval.success_games`` games of the CoMap loop, at once) in
several evaluator settings, alternating, against the servers of a running system:

* ``together``: the config's evaluator (the probes' walkthrough states sent to the server together,
  ``evaluator.probes.PROBE_STATES``, 8; reflections read from their decision token first);
* (``one_by_one``, the probes' states one after another, went with ``eval.probe_states``; its figure
  stays in docs/benchmarks.md);
* ``priority``: ``together`` with its model calls admitted ahead of the actors' (``eval.priority=-1``);
* ``priority_envs8``: ``priority`` with 8 success games at a time (``eval.envs=8``), so the evaluation's
  calls alone can fill the server's batch (``inference.max_batch_size``, 8) while they go first;
* ``priority_envs10``: ``priority`` with every one of the 10 success games at once (``eval.envs=10``):
  with 8, the last two games start when the first two end, and a 50-step game among them ends last.

    honcho start   # the run to measure beside: actors and learner busy
    python benchmarks/evaluation_time.py --config configs/local.yaml --set run.name=local --version 20
    # or the system started here, on a fork of a run's version:
    python benchmarks/evaluation_time.py --fork NAME --version 22 --variants one_by_one together priority

The version's adapters are loaded under names of the benchmark's own (``bench-policy-v<N>``...),
copied first (the learner rotates old versions away), so the run's own evaluator may evaluate beside
it (and does: say so when quoting). ``--fork SOURCE``: ``comap fork`` makes run
``evaltime-<time>`` from SOURCE's version ``--version`` (its checkpoint, adapters and replay) and
``honcho start broker inference learner actor`` runs it (co-evolution: the actors play and the
learner trains) while the evaluations run, then stops it. The evaluations run at the evaluator
process's niceness (``comap_async.priority.niceness``). Each evaluation also reports the transitions the run's actors
stored meanwhile per second (from the broker's ``/stats``): more of the server for the evaluation is
less for them. Rounds alternate the order, and should: an evaluation right after ``--fork`` started the
system shares the server with the actors' first, short conversations, and read 571-642 s where the same
settings' second evaluation read 977-1,141 s (sessions 56-57), so one round compares positions as much
as settings (``--rounds 2`` gives each variant a first and a later place). Last line:
``eval_s_<variant>=X probe_s_<variant>=Y`` for each variant, then ``speedup=Z`` (medians over the
rounds; the first variant's evaluation time over the last's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._inference import stored_transitions  # noqa: E402 - the repo must be on sys.path first
from experiments.system import wait_for  # noqa: E402

VARIANTS: dict[str, dict] = {
    "together": {},
    "priority": {"priority": -1},
    "priority_envs8": {"priority": -1, "envs": 8},
    "priority_envs10": {"priority": -1, "envs": 10},
}
FIGURES = ("p_discrimination", "p_auc", "draft_accuracy", "wm_delta_f1", "success_rate", "loop_rate")


async def evaluate(cfg, version: int, eval_settings: dict, log, adapter_dir: Path) -> dict:
    from comap_async.wire.inference_client import InferenceClient
    from evaluator.evaluator import Evaluator

    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update=eval_settings)})
    async with InferenceClient.from_config(cfg) as client:
        before = await client.engine_counters()
        result = await Evaluator(cfg, log, prefix="bench-").evaluate(client, version, {}, adapter_dir)
        after = await client.engine_counters()
    result["server"] = {k: round(after[k] - before[k], 3) for k in before if k in after}
    return result


def server_line(d: dict[str, float]) -> str:
    """Where the server's time went during one evaluation (everyone's calls: the evaluation's and the actors')."""
    if not d.get("prompt_tokens"):
        return "server: no counters"
    computed = d["prompt_tokens"] - d.get("prefix_cache_hit_tokens", 0.0)
    rows = d["decode_rows"] / d["decode_steps"] if d.get("decode_steps") else 0.0
    return (
        f"server: prefill {d.get('prefill_seconds', 0):.0f} s for {computed:.0f} computed of {d['prompt_tokens']:.0f} "
        f"prompt tokens ({d.get('prefix_cache_hit_tokens', 0) / d['prompt_tokens']:.0%} from the prefix cache, "
        f"{1000 * d.get('prefill_seconds', 0) / max(1.0, computed):.2f} ms a computed token), decode "
        f"{d.get('decode_seconds', 0):.0f} s in {d.get('decode_steps', 0):.0f} steps of {rows:.1f} rows, "
        f"{d.get('prefix_cache_evicted_blocks', 0):.0f} prefix-cache blocks evicted"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument(
        "--version", type=int, required=True, help="a published version of the run (with --fork: of SOURCE)"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["one_by_one", "together"])
    ap.add_argument("--fork", metavar="SOURCE", help="start the system here, on a fork of run SOURCE's --version")
    ap.add_argument("--out", type=Path, help="write each evaluation's result here as JSON lines")
    args = ap.parse_args()

    from comap_async.config import load_config
    from comap_async.logsetup import configure_logging

    if args.fork is None:
        cfg = load_config(args.config, args.overrides)
        seconds = measure_version(args, cfg, configure_logging("evaluation-time", run=cfg.run.name))
    else:
        seconds = measure_beside_fork(args)
    med = {v: (statistics.median(e for e, _ in xs), statistics.median(p for _, p in xs)) for v, xs in seconds.items()}
    print(
        " ".join(f"eval_s_{v}={e:.0f} probe_s_{v}={p:.0f}" for v, (e, p) in med.items())
        + f" speedup={med[args.variants[0]][0] / med[args.variants[-1]][0]:.2f}"
    )
    return 0


def measure_beside_fork(args) -> dict[str, list[tuple[float, float]]]:
    """Fork ``args.fork`` at ``args.version``, run the fork's training processes and measure beside them."""
    import subprocess

    from comap_async.config import load_config
    from comap_async.logsetup import configure_logging
    from experiments.system import system_running

    name = f"evaltime-{time.strftime('%Y%m%d-%H%M%S')}"
    sets = [x for o in args.overrides for x in ("--set", o)]
    forked = subprocess.run(
        [sys.executable, "-m", "comap_async", "fork", args.fork, "--name", name, "--version", str(args.version)]
        + ["--config", args.config, *sets],
        cwd=REPO,
    )
    if forked.returncode:  # comap fork said why on its own stderr
        raise SystemExit(f"evaluation_time: could not fork {args.fork} at version {args.version}")
    cfg = load_config(args.config, [*args.overrides, f"run.name={name}"])
    log = configure_logging("evaluation-time", run=name)
    with system_running(name, args.config, args.overrides, cfg.run.dir) as proc:
        http, system = cfg.broker.http_port, {proc: cfg.run.dir / f"{name}.log"}
        try:
            wait_for(lambda: _answers(http), 300, f"{name}'s broker did not answer", system)
            start = stored_transitions(http)
            wait_for(lambda: stored_transitions(http) >= start + 8, 900, f"{name}'s actors stored nothing", system)
        except TimeoutError as exc:
            raise SystemExit(f"evaluation_time: {exc} (see {system[proc]})") from None
        return measure_version(args, cfg, log)


def _answers(http_port: int) -> bool:
    try:
        stored_transitions(http_port)
        return True
    except OSError:  # not up yet
        return False


def measure_version(args, cfg, log) -> dict[str, list[tuple[float, float]]]:
    from comap_async.priority import lower_priority, niceness
    from comap_async.wire.messages import ROLES, adapter_name

    missing = [r for r in ROLES if not (cfg.adapter_root / adapter_name(r, args.version)).is_dir()]
    if missing:
        raise SystemExit(f"version {args.version} of run {cfg.run.name} has no {', '.join(missing)} adapter")
    lower_priority(niceness(cfg, "evaluator"))  # as the evaluator process does (a --fork system does not pass it on)
    # the learner keeps its newest few versions only: a copy of this one (inside the adapter root,
    # which the server loads from) outlives its rotation
    snapshot = cfg.adapter_root / f"bench-snapshot-{os.getpid()}"
    for role in ROLES:
        shutil.copytree(
            cfg.adapter_root / adapter_name(role, args.version), snapshot / adapter_name(role, args.version)
        )
    try:
        return measure(args, cfg, log, snapshot)
    finally:
        shutil.rmtree(snapshot, ignore_errors=True)


def measure(args, cfg, log, snapshot: Path) -> dict[str, list[tuple[float, float]]]:
    seconds: dict[str, list[tuple[float, float]]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        order = args.variants if r % 2 == 0 else args.variants[::-1]
        for variant in order:
            n0, t0 = stored_transitions(cfg.broker.http_port), time.monotonic()
            result = asyncio.run(evaluate(cfg, args.version, VARIANTS[variant], log, snapshot))
            # what the run's actors stored meanwhile: an evaluation that takes more of the server is
            # faster at the actors' expense
            result["actor_transitions_per_s"] = round(
                (stored_transitions(cfg.broker.http_port) - n0) / (time.monotonic() - t0), 4
            )
            seconds[variant].append((result["eval_s"], result["probe_s"]))
            print(
                f"round={r} variant={variant} eval_s={result['eval_s']} probe_s={result['probe_s']} "
                f"actor_transitions_per_s={result['actor_transitions_per_s']} "
                + " ".join(f"{k}={result.get(k)}" for k in FIGURES),
                flush=True,
            )
            print(f"round={r} variant={variant} {server_line(result['server'])}", flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps({"round": r, "variant": variant, **result}) + "\n")
    return seconds


if __name__ == "__main__":
    raise SystemExit(main())
