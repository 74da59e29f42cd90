"""What the evaluator costs the actors: actor env steps/s with and without
an evaluation running, interleaved, on one machine.

    python benchmarks/evaluator_cost.py [--config configs/local.yaml] [--window 180] [--rounds 2]

A broker, the embedded server and one actor run the CoMap loop with the base model (the registry
is set to ``coevolve`` with no adapters, so no learner is needed). Each round measures the stored
transitions per second over ``--window`` seconds without the evaluator, then over the same window
while ``comap evaluator`` evaluates the base model (its result file is removed before each round,
so it has work). Last line: ``steps_per_s_without=X steps_per_s_with=Y evaluator_slowdown=Z``
(1 - with/without, medians over the rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._inference import start_comap, stop_group, stored_transitions  # noqa: E402 - the repo must be on sys.path first
from comap_async.ports import free_port  # noqa: E402
from comap_async.wire.messages import COEVOLVE, ROLES  # noqa: E402


def _rate(http: int, seconds: float) -> float:
    n0, t0 = stored_transitions(http), time.monotonic()
    time.sleep(seconds)
    return (stored_transitions(http) - n0) / (time.monotonic() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--window", type=float, default=180.0, help="seconds measured per condition and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()

    run_root = REPO / "runs"
    name = f"evalcost-{time.strftime('%Y%m%d-%H%M%S')}"
    http, port, lp = free_port(), free_port(), free_port()
    sets = [
        f"run.root={run_root}",
        f"run.name={name}",
        f"broker.actor_port={free_port()}",
        f"broker.learner_port={lp}",
        f"broker.http_port={http}",
        f"inference.port={port}",
        f"inference.endpoints=['http://127.0.0.1:{port}']",
        "eval.success_games=0",
        *args.overrides,
    ]
    common = ["--config", args.config, *sum((["--set", s] for s in sets), [])]
    env = {**os.environ, "COMAP_LOG_JSON": "1", "OMP_NUM_THREADS": "1"}
    log_dir = run_root / name
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = [
        start_comap("broker", ["broker", *common], env, log_dir),
        start_comap("serve", ["serve", *common], env, log_dir),
    ]
    try:
        from comap_async.wire.broker_client import BrokerClient

        async def to_coevolve() -> None:
            async with BrokerClient(f"tcp://127.0.0.1:{lp}", timeout_s=10, retries=30) as bc:
                await bc.announce(COEVOLVE, dict.fromkeys(ROLES, 0), {}, 0)

        asyncio.run(to_coevolve())
        procs.append(start_comap("actor", ["actor", *common], env, log_dir))
        while stored_transitions(http) < 20:  # the server has loaded the model and the actor plays
            time.sleep(5)
        without, with_eval = [], []
        for r in range(args.rounds):
            without.append(_rate(http, args.window))
            (log_dir / "eval" / "v0.json").unlink(missing_ok=True)
            evaluator = start_comap("evaluator", ["evaluator", "--once", *common], env, log_dir)
            time.sleep(10)  # its start-up (no model) and first requests
            with_eval.append(_rate(http, args.window))
            busy = evaluator.poll() is None
            stop_group(evaluator, 60)
            print(
                f"round {r}: without={without[-1]:.3f}/s with={with_eval[-1]:.3f}/s "
                f"(evaluator {'still evaluating' if busy else 'finished within the window'})",
                file=sys.stderr,
            )
    finally:
        for p in reversed(procs):
            stop_group(p, 60)
    a, b = statistics.median(without), statistics.median(with_eval)
    print(
        f"steps_per_s_without={a:.3f} steps_per_s_with={b:.3f} "
        f"evaluator_slowdown={1 - b / a if a else float('nan'):.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
