"""How long one evaluation of one version takes (the evaluator's: probes on ``eval.games`` games,
then ``eval.success_games`` games of the CoMap loop), with the probes' walkthrough states sent to
the server together (``eval.probe_states``, the default 8) and one after another (0, the path
before), alternating, against the servers of a running system.

    honcho start   # the run to measure beside: actors and learner busy
    python benchmarks/evaluation_time.py --config configs/local.yaml --set run.name=local --version 20

The version's adapters are loaded under names of the benchmark's own (``bench-policy-v<N>``...),
copied first (the learner rotates old versions away), so the run's own evaluator may evaluate beside
it (and does: say so when quoting). Each evaluation also reports the transitions the run's actors
stored meanwhile per second (from the broker's ``/stats``): more of the server for the evaluation is
less for them. Rounds alternate the order (together first in odd rounds). Last line:
``eval_s_one_by_one=X eval_s_together=Y probe_s_one_by_one=A probe_s_together=B speedup=Z``
(medians over the rounds; speedup of the whole evaluation).
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

VARIANTS = {"one_by_one": 0, "together": None}  # None: the config's eval.probe_states
FIGURES = ("p_discrimination", "p_auc", "draft_accuracy", "wm_delta_f1", "success_rate", "loop_rate")


async def evaluate(cfg, version: int, probe_states: int | None, log, adapter_dir: Path) -> dict:
    from actors.evaluator import Evaluator
    from comap_async.wire.inference_client import InferenceClient

    if probe_states is not None:
        cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"probe_states": probe_states})})
    async with InferenceClient.from_config(cfg) as client:
        return await Evaluator(cfg, log, prefix="bench-").evaluate(client, version, {}, adapter_dir)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--version", type=int, required=True, help="a published version of the run")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, help="write each evaluation's result here as JSON lines")
    args = ap.parse_args()

    from comap_async.config import load_config
    from comap_async.logsetup import configure_logging
    from comap_async.wire.messages import ROLES, adapter_name

    cfg = load_config(args.config, args.overrides)
    missing = [r for r in ROLES if not (cfg.adapter_root / adapter_name(r, args.version)).is_dir()]
    if missing:
        raise SystemExit(f"version {args.version} of run {cfg.run.name} has no {', '.join(missing)} adapter")
    log = configure_logging("evaluation-time", run=cfg.run.name)
    # the learner keeps its newest few versions only: a copy of this one (inside the adapter root,
    # which the server loads from) outlives its rotation
    snapshot = cfg.adapter_root / f"bench-snapshot-{os.getpid()}"
    for role in ROLES:
        shutil.copytree(
            cfg.adapter_root / adapter_name(role, args.version), snapshot / adapter_name(role, args.version)
        )
    try:
        seconds = measure(args, cfg, log, snapshot)
    finally:
        shutil.rmtree(snapshot, ignore_errors=True)
    med = {v: (statistics.median(e for e, _ in xs), statistics.median(p for _, p in xs)) for v, xs in seconds.items()}
    print(
        f"eval_s_one_by_one={med['one_by_one'][0]:.0f} eval_s_together={med['together'][0]:.0f} "
        f"probe_s_one_by_one={med['one_by_one'][1]:.0f} probe_s_together={med['together'][1]:.0f} "
        f"speedup={med['one_by_one'][0] / med['together'][0]:.2f}"
    )
    return 0


def measure(args, cfg, log, snapshot: Path) -> dict[str, list[tuple[float, float]]]:
    seconds: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
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
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps({"round": r, "variant": variant, **result}) + "\n")
    return seconds


if __name__ == "__main__":
    raise SystemExit(main())
