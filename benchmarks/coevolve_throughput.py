"""Co-evolution env steps/s of one actor on the embedded server, today's path against the fast one,
in alternating rounds on one machine:

* ``fast``: the defaults, with reflections generated whole: fused forward, top-p from the top
  candidates, the teacher overlapped with the next draft (with ``configs/local.yaml``: the draft's turns
  form and a 2 GB prefix cache).
* ``fast_cache``: ``fast`` with a 2 GB prefix cache (the built-in default is 256 MB);
* ``fast_history``: ``fast_cache`` with the whole interaction history as the state
  (``env.history_k=50``, the paper's state) instead of the last 3 pairs.
* ``fast_envs8``: ``fast_cache`` with 8 environments per actor instead of 4 (fuller decode batches).
* ``fast_envs16``: 16 environments, decoded up to 16 rows at a time.
* ``fast_history_envs8``: ``fast_history`` with 8 environments.
* ``fast_turns``: every role a conversation over the episode (``env.prompt_form: all_turns``: the
  reflection continues the draft's conversation, the world model and its teacher have their own);
  ``fast_envs8_turns``: with 8 environments too. Co-evolution's reflections read decision first
  (``fast_turns_decision_first``, 1.15x) went with the setting: co-evolution's reflections are generated
  whole. The settings with prompt-lookup speculative decoding
  (``fast_spec4``, ``fast_turns_decision_first_spec4`` and others) and with prefix-cache blocks of 32 tokens
  went with ``inference.speculative_tokens`` and ``inference.prefix_cache_block`` (their figures:
  docs/benchmarks.md, docs/inference.md).
  (The reflection's turns alone, ``fast_reflect_turns``, are no ``env.prompt_form``: dropped, ``fast_turns``
  measures them with the world model's and the teacher's.)

    python benchmarks/coevolve_throughput.py [--config configs/local.yaml] [--steps 40] [--rounds 2]

Each round, for each setting in turn (a window): a fresh run directory, broker (a setting may change
what the run records as its method) and ``comap serve``, which loads three LoRA adapters (policy,
world model, teacher: random, small, the learner's shape; ``--adapters-from RUN/adapters
--adapter-version N``: a run's trained ones), the registry is set to ``coevolve`` on
them (no learner), and one actor (``actor.envs`` environments, ``env.split=train``) plays the
CoMap loop. After 4 transitions of warm-up, the window is the time to store the next ``--steps``
transitions times ``actor.envs`` / 4 (every setting's window covers the same steps of its episodes:
prompts grow along an episode); model calls per step are the server's completion requests in the
window over those transitions.

Last line: ``coevolve_env_steps_per_s=X model_calls_per_step=Y`` (``fast``, medians over rounds;
without ``fast`` the first setting's, named), after one line per setting (with the prompt tokens
prefilled per env step, those the prefix cache did not serve, in all and by adapter role) and
the other settings' ratios to ``fast``. ``fast_cache`` and
``fast_history`` (the whole history as the state) need a window long enough for histories to grow
(``--steps 200``: four 50-step episodes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks._inference import (  # noqa: E402
    start_comap,
    stop_group,
    stored_transitions,
    write_random_adapters,
)
from comap_async.ports import free_port  # noqa: E402
from comap_async.wire.inference_client import ENGINE_COUNTERS, parse_engine_counters  # noqa: E402
from comap_async.wire.messages import COEVOLVE, ROLES, adapter_name  # noqa: E402
from experiments.system import copy_trained_adapters, wait_for  # noqa: E402

FAST: list[str] = []
SETTINGS = {
    "fast": FAST,
    # the fast path with a prefix cache that holds every in-flight episode's prompts (a step's
    # reflection shares its draft's prompt up to the state's end; 256 MB holds ~5.8k fp32 tokens of
    # SmolLM2-135M, fewer than 4 environments' calls between one draft and its reflection)
    "fast_cache": [*FAST, "inference.prefix_cache_mb=2048"],
    # the whole interaction history as the state (the paper's; the window is 3 pairs): a step's prompt
    # then starts with the previous step's up to its current observation, so the cache serves it
    "fast_history": [*FAST, "inference.prefix_cache_mb=2048", "env.history_k=50"],
    # twice the environments per actor: the server decodes 8 rows in little more than the time of 4, so
    # more episodes in flight fill its batches (4 environments' calls leave half of each batch empty)
    "fast_envs8": [*FAST, "inference.prefix_cache_mb=2048", "actor.envs=8"],
    # four times the rows: a decode step costs ~40 ms however few rows it holds (one thread, SmolLM2)
    "fast_envs16": [*FAST, "inference.prefix_cache_mb=2048", "actor.envs=16", "inference.max_batch_size=16"],
    # both: every role's prompt extends its previous step's, and twice the rows in each decode step
    "fast_history_envs8": [*FAST, "inference.prefix_cache_mb=2048", "env.history_k=50", "actor.envs=8"],
    # every role a conversation over the episode: the reflection continues the draft's (the cache holds the
    # draft's prompt: ~60 new tokens a reflection instead of the state again), the world model's and the
    # teacher's prompts extend their previous step's (~1,000 computed prompt tokens a step with trained
    # adapters, 2/3 of the server's time)
    "fast_turns": [*FAST, "env.prompt_form=all_turns"],
    "fast_envs8_turns": [
        *FAST,
        "inference.prefix_cache_mb=2048",
        "actor.envs=8",
        "env.prompt_form=all_turns",
    ],
}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _server(port: int) -> dict[str, float]:
    """Completions answered and the engine's counters, from ``/metrics``; a counter by label (the prompt
    tokens computed and the tokens generated by adapter, the speculative tokens by outcome) flattened to
    ``"<prefix>:<label value>"`` keys."""
    text = _get(f"http://127.0.0.1:{port}/metrics")
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)

    def by(name: str, label: str, prefix: str) -> dict[str, float]:
        return {f"{prefix}:{s.labels[label]}": s.value for s in samples.get(f"comap_inference_{name}", [])}

    answered = {"route": "/v1/completions", "status": "200"}
    completions = sum(s.value for s in samples.get("comap_inference_http_requests_total", []) if s.labels == answered)
    counted = parse_engine_counters(text)
    return (
        {"completions": completions}
        | {name: counted.get(name, 0.0) for name in ENGINE_COUNTERS}
        | by("prompt_tokens_computed_total", "adapter", "computed")
        | by("generation_tokens_by_adapter_total", "adapter", "generated")
        | by("speculative_tokens_total", "outcome", "speculative")
        | by("attended_columns_total", "kind", "columns")
        | {"mixed_prefills": sum(s.value for s in samples.get("comap_inference_mixed_prefills_total", []))}
    )


def _by_role(counters: dict[str, float], prefix: str, steps: float, spec: str) -> str:
    """``"policy 184, wm 60, ..."``: the ``prefix`` counters of :func:`_server` per env step, by role."""
    head = prefix + ":"
    return ", ".join(
        f"{k.removeprefix(head)} {v / steps:{spec}}" for k, v in sorted(counters.items()) if k.startswith(head)
    )


def _healthy(port: int) -> bool:
    try:
        _get(f"http://127.0.0.1:{port}/health")
        return True
    except OSError:
        return False


def measure_window(args: argparse.Namespace, name: str, overrides: list[str]) -> tuple:
    """One window: a fresh run directory, broker and server with three adapters (random, or
    ``--adapters-from``'s) published as co-evolution's, one actor; the server's counters and the stored
    transitions at the window's ends."""
    from comap_async.config import load_config
    from comap_async.models import resolve_model
    from comap_async.wire.broker_client import BrokerClient
    from comap_async.wire.inference_client import InferenceClient

    run_root = REPO / "runs"
    http, lp, port = free_port(), free_port(), free_port()
    sets = [
        f"run.root={run_root}",
        f"run.name={name}",
        f"broker.actor_port={free_port()}",
        f"broker.learner_port={lp}",
        f"broker.http_port={http}",
        "env.split=train",  # the broker and actor are training processes: never an evaluation split
        f"inference.port={port}",
        f"inference.endpoints=['http://127.0.0.1:{port}']",
        *overrides,
    ]
    cfg = load_config(args.config, sets)
    log_dir = run_root / name
    log_dir.mkdir(parents=True, exist_ok=True)
    adapters = {r: adapter_name(r, 1) for r in ROLES}
    if args.adapters_from is not None:
        copy_trained_adapters(args.adapters_from, args.adapter_version, cfg.adapter_root)
    else:
        write_random_adapters(
            resolve_model(cfg.model.name_or_path, cfg.model.cache_dir),
            cfg.adapter_root,
            list(adapters.values()),
            r=cfg.learner.lora_r,
        )
    env = {**os.environ, "COMAP_LOG_JSON": "1", "OMP_NUM_THREADS": "1"}
    common = ["--config", args.config, *sum((["--set", s] for s in sets), [])]
    started = {}
    try:
        for role in ("broker", "serve"):
            started[start_comap(role, [role, *common], env, log_dir)] = log_dir / f"{role}.log"
        wait_for(lambda: _healthy(port), 300, "the server did not come up", started)

        async def publish() -> None:
            async with InferenceClient([f"http://127.0.0.1:{port}"], timeout_s=120) as c:
                for name_ in adapters.values():
                    await c.load_adapter(name_, str(cfg.adapter_root / name_))
            async with BrokerClient(f"tcp://127.0.0.1:{lp}", timeout_s=10, retries=30) as bc:
                await bc.announce(COEVOLVE, {r_: 1 for r_ in ROLES}, adapters, 0)

        asyncio.run(publish())
        start = stored_transitions(http)
        started[start_comap("actor", ["actor", *common], env, log_dir)] = log_dir / "actor.log"
        wait_for(lambda: stored_transitions(http) >= start + 4, 900, "the actor stored no transitions", started)
        n0, c0, t0 = stored_transitions(http), _server(port), time.monotonic()
        # the same steps of each episode in every setting: a window of 8 environments is twice as long
        window = args.steps * cfg.actor.envs // 4
        wait_for(lambda: stored_transitions(http) >= n0 + window, 3600, "the window did not fill", started)
        n1, c1, t1 = stored_transitions(http), _server(port), time.monotonic()
    finally:
        for proc in reversed(list(started)):
            stop_group(proc, 60)
    return c0, c1, n0, n1, t0, t1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--steps", type=int, default=40, help="transitions timed per window of 4 environments")
    ap.add_argument("--rounds", type=int, default=2, help="0: only check that every setting loads over --config")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument(
        "--adapters-from",
        type=Path,
        help="a run's adapter directory (RUN/adapters): its --adapter-version adapters are played instead of random "
        "ones (random adapters loop or not by chance, so the same setting varies 1.3-2x between windows)",
    )
    ap.add_argument("--adapter-version", type=int, default=1)
    ap.add_argument(
        "--settings",
        nargs="+",
        choices=list(SETTINGS),
        default=list(SETTINGS),
        help="which settings to measure (the last line is fast's, else the first's)",
    )
    args = ap.parse_args()
    settings = {k: SETTINGS[k] for k in args.settings}
    from comap_async.config import ConfigError, load_config

    for name, overrides in settings.items():  # a setting the config refuses ends the run here, before any window
        try:
            load_config(args.config, [*args.overrides, *overrides])
        except ConfigError as err:
            raise SystemExit(f"coevolve_throughput: setting {name}: {err}") from None
    if args.rounds == 0:  # only the check above
        print(f"coevolve_throughput: {len(settings)} settings load over {args.config}")
        return 0

    results: dict[str, list[tuple[float, float, float]]] = {f: [] for f in settings}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for r in range(args.rounds):
        for forward in list(settings) if r % 2 == 0 else list(settings)[::-1]:
            # a run directory and broker per window: a setting may change what the run records as its
            # method (env.prompt_form), and every process of a run must agree on it
            c0, c1, n0, n1, t0, t1 = measure_window(
                args, f"coevolve-tp-{stamp}-r{r}-{forward}", [*args.overrides, *settings[forward]]
            )
            d = {k: c1[k] - c0.get(k, 0.0) for k in c1}
            rate, calls = (n1 - n0) / (t1 - t0), d["completions"] / (n1 - n0)
            steps = max(1.0, d["decode_steps"])
            computed = max(1.0, d["prompt_tokens"] - d["prefix_cache_hit_tokens"])
            results[forward].append((rate, calls, computed / (n1 - n0)))
            print(
                f"round {r} {forward:9s}: {rate:.3f} env steps/s, {calls:.2f} model calls per step; server: "
                f"decode {d['decode_seconds'] / (t1 - t0):.0%} of the window "
                f"({1000 * d['decode_seconds'] / steps:.1f} ms per step of {d['decode_rows'] / steps:.1f} rows, "
                f"attention over {d.get('columns:all', 0.0) / max(1.0, d['decode_rows']):.0f} columns a row, "
                f"{d.get('columns:real', 0.0) / max(1.0, d.get('columns:all', 0.0)):.0%} of them unmasked), "
                f"prefill {d['prefill_seconds'] / (t1 - t0):.0%} "
                f"({1000 * d['prefill_seconds'] / computed:.2f} ms per computed token, "
                f"{d['prompt_tokens'] / max(1.0, d['completions']):.0f} prompt tokens per call, "
                f"{d['prefix_cache_hit_tokens'] / max(1.0, d['prompt_tokens']):.0%} from the prefix cache, "
                f"{d.get('mixed_prefills', 0.0) / max(1.0, d['completions']):.0%} of prompts in a shared forward), "
                f"{d['generation_tokens'] / max(1.0, d['completions']):.0f} tokens generated per call, "
                f"{computed / (n1 - n0):.0f} prompt tokens prefilled per env step ("
                + _by_role(d, "computed", n1 - n0, ".0f")
                + "), tokens generated per env step ("
                + _by_role(d, "generated", n1 - n0, ".1f")
                + ")"
                + (
                    f", speculative: {d['speculative:accepted'] / (n1 - n0):.1f} of "
                    f"{d['speculative:proposed'] / (n1 - n0):.1f} proposed tokens per env step confirmed"
                    if d.get("speculative:proposed")
                    else ""
                ),
                flush=True,
            )
    med = {f: tuple(statistics.median(x[i] for x in v) for i in range(3)) for f, v in results.items()}
    for f in settings:
        print(
            f"{f}: coevolve_env_steps_per_s={med[f][0]:.3f} model_calls_per_step={med[f][1]:.2f} "
            f"prefill_tokens_per_step={med[f][2]:.0f}"
        )
    for other in (s for s in med if s.startswith("fast_") and "fast" in med):
        print(f"coevolve_{other}_vs_fast={med[other][0] / med['fast'][0]:.2f}")
    head = "fast" if "fast" in med else next(iter(med))
    print(
        f"coevolve_env_steps_per_s={med[head][0]:.3f} model_calls_per_step={med[head][1]:.2f}"
        + ("" if head == "fast" else f" setting={head}")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
