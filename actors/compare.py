"""``comap compare``: the newest adapter version of each run, and the prompting baselines on the
base model, played on the same games of one split; one Markdown table and one bar chart.

Each run is evaluated as it trained: its ``ablation.json`` is applied (``no_action_gate`` and
``no_future_state`` change how the agent acts). The runs' adapters are copied under
``OUT/adapters`` with a prefix per run (``r1-policy-v7``), the adapter root of the embedded server
this command starts, so versions of different runs never share a name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from comap_async.cli import add_config_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    from comap_async.config import EVAL_METHODS

    add_config_arguments(p)
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="run directories (each with ablation.json and adapters/ as the learner writes them)",
    )
    p.add_argument("--split", required=True, help="train, valid_seen, valid_unseen or valid_train")
    p.add_argument(
        "--games", type=int, default=None, help="N games drawn with run.seed over the task types (default: all)"
    )
    p.add_argument("--data", default=None, help="ALFWorld data root (default: env.data_dir or $ALFWORLD_DATA)")
    p.add_argument(
        "--methods",
        default="react,imagine_and_act",
        help=f"prompting baselines played with the base model, comma-separated from "
        f"{', '.join(m for m in EVAL_METHODS)}; '' for none (default: react,imagine_and_act)",
    )
    p.add_argument(
        "--methods-from",
        default=None,
        metavar="RUN_DIR[:VERSION]",
        help="play the prompting baselines with this run's adapters (its newest version, or VERSION: "
        "e.g. the warm-up version the runs were forked from) instead of the base model",
    )
    p.add_argument("--out", required=True, help="directory for compare.json, compare.md, compare.png")
    p.add_argument("--envs", type=int, default=None, help="concurrent episodes (default: actor.envs)")
    p.add_argument(
        "--serve-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="how long to wait for the embedded server this command starts (default 600 s)",
    )


def stage_run(
    run_dir: Path, index: int | str, adapter_root: Path, spec: str = "latest", with_ablation: bool = True
) -> tuple[int, list[str], str]:
    """Copy ``run_dir``'s version ``spec`` (default its newest complete one) under ``adapter_root``
    with the prefix ``r<index>-``; returns (version, the run's ablation, the prefix). ValueError when
    the run has no such version."""
    from actors.eval_runner import resolve_version
    from comap_async.run_files import read_run_ablation
    from comap_async.wire.messages import ROLES, adapter_name

    ablation = read_run_ablation(run_dir) if with_ablation else []
    source = run_dir / "adapters"
    version = resolve_version(spec, source) if source.is_dir() else 0
    if not version:
        raise ValueError(f"{run_dir} has no published adapter version under {source}")
    prefix = f"r{index}-"
    for role in ROLES:
        target = adapter_root / adapter_name(role, version, prefix)
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source / adapter_name(role, version), target)
    return version, ablation, prefix


async def compare(
    cfg: Any,
    runs: list[Path],
    methods: list[str],
    split: str,
    n_games: int | None,
    envs: int | None,
    server: Any,
    serve_timeout: float,
    log: Any,
    staged: list[tuple[int, list[str], str]],
    methods_from: tuple[str, int, str] | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Play every method (the base model, or ``methods_from``'s staged adapters: (its name, version,
    prefix)) and every staged run on the same games; the rows and the game count."""
    from actors.compare_report import METHOD_LABELS, row, run_label
    from actors.eval_report import summarize
    from actors.eval_runner import check_complete, play_games, wait_for_server
    from comap_async.config import AblationConfig
    from comap_async.envs import games_from_config
    from comap_async.envs.base import spread_sample
    from comap_async.run_files import read_run_methods
    from comap_async.wire.inference_client import InferenceClient
    from comap_async.wire.messages import Registry

    games = games_from_config(cfg.model_copy(update={"env": cfg.env.model_copy(update={"max_games": None})}), split)
    games = spread_sample(games, n_games, cfg.run.seed)
    if not games:
        raise ValueError(f"no games in split {split!r}")
    await wait_for_server(cfg, server, serve_timeout, log)

    async def play(run_cfg: Any, registry: Registry, method: str, what: str) -> dict[str, Any]:
        t0 = time.time()
        results = await play_games(run_cfg, games, registry, log, envs=envs, method=method)
        check_complete(results, games, what)
        report = summarize(results, split, registry.versions.get("policy", 0), time.time() - t0)
        log.info("compare.row", what=what, success_rate=report["success_rate"], delta_f1=report["delta_f1"])
        return report

    rows = []
    async with InferenceClient.from_config(cfg) as client:
        base = Registry.serving(0)
        if methods_from is not None:
            base = Registry.serving(methods_from[1], methods_from[2])
            for name in base.adapters.values():
                await client.load_adapter(name, str(cfg.adapter_root / name))
        adapters = "base model" if methods_from is None else f"{methods_from[0]} v{methods_from[1]}"
        for method in methods:
            rows.append(
                row(f"{METHOD_LABELS[method]} ({adapters})", "method", method, await play(cfg, base, method, method))
            )
        for name in base.adapters.values():
            await client.unload_adapter(name, missing_ok=True)
        for run_dir, (version, ablation, prefix) in zip(runs, staged):
            registry = Registry.serving(version, prefix)
            for name in registry.adapters.values():
                await client.load_adapter(name, str(cfg.adapter_root / name))
            run_cfg = cfg.model_copy(update={"ablation": AblationConfig(**dict.fromkeys(ablation, True))})
            rows.append(
                row(
                    run_label(ablation, run_dir.name, read_run_methods(run_dir)),
                    "run",
                    "comap",
                    await play(run_cfg, registry, "comap", str(run_dir)),
                    run=str(run_dir),
                    ablation=ablation,
                )
            )
            for name in registry.adapters.values():
                await client.unload_adapter(name, missing_ok=True)
    return rows, len(games)


def run(args: argparse.Namespace) -> int:
    from actors.compare_report import bar_chart, markdown
    from actors.eval_runner import EvalIncomplete, ServerStartError, start_server, stop_server
    from comap_async.config import EVAL_METHODS, load_config
    from comap_async.logsetup import configure_logging

    out = Path(args.out)
    adapter_root = (out / "adapters").resolve()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in EVAL_METHODS or m == "comap"]
    runs = [Path(r) for r in args.runs]

    def fail(message: str) -> int:
        print(f"comap compare: error: {message}", file=sys.stderr)
        return 2

    if unknown:
        return fail(
            f"--methods: {', '.join(unknown)} is not a prompting baseline "
            f"(choose from {', '.join(m for m in EVAL_METHODS if m != 'comap')}; runs are played with comap)"
        )
    overrides = (
        list(args.overrides)
        + ([f"env.data_dir={args.data}"] if args.data else [])
        + [f"inference.adapter_root={adapter_root}"]
    )
    cfg = load_config(args.config, overrides)
    log = configure_logging("compare", run=cfg.run.name)
    adapter_root.mkdir(parents=True, exist_ok=True)
    try:
        staged = [stage_run(r, i + 1, adapter_root) for i, r in enumerate(runs)]
        methods_from = None
        if args.methods_from:
            source, _, spec = args.methods_from.partition(":")
            version, _, prefix = stage_run(Path(source), "m", adapter_root, spec or "latest", with_ablation=False)
            methods_from = (Path(source).name, version, prefix)
    except ValueError as exc:
        return fail(str(exc))
    cfg, server = start_server(args.config, overrides, log)
    try:
        rows, n_games = asyncio.run(
            compare(
                cfg,
                runs,
                methods,
                args.split,
                args.games,
                args.envs,
                server,
                args.serve_timeout,
                log,
                staged,
                methods_from,
            )
        )
    except (ValueError, ServerStartError, EvalIncomplete) as exc:
        return fail(str(exc))
    finally:
        stop_server(server)
    report = {"split": args.split, "games": n_games, "rows": rows}
    (out / "compare.json").write_text(json.dumps(report, indent=2))
    table = markdown(rows, args.split, n_games)
    (out / "compare.md").write_text(table)
    chart = bar_chart(rows, out / "compare.png", f"{args.split}, {n_games} games")
    print(table)
    log.info("compare.done", out=str(out), rows=len(rows), chart=str(chart))
    return 0
