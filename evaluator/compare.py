"""``comap compare``: the newest adapter version of each run, and the prompting baselines on the
base model, played on the same games of one split; one Markdown table and one bar chart.

Each run is evaluated as it trained: its ``ablation.json`` is applied (``no_action_gate`` and
``no_future_state`` change how the agent acts). The runs' adapters are copied under
``OUT/adapters`` with a prefix per run (``r1-policy-v7``), the adapter root of the embedded server
this command starts, so versions of different runs never share a name. Each finished episode, and
each row's report, is stored under ``OUT/cells`` as soon as it exists, so a comparison stopped
half-way (a table on a CPU takes hours) goes on with ``--resume`` from the next unplayed game.
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
from evaluator.compare_cells import Cell, CellStore, cell_key, with_ablation


def add_arguments(p: argparse.ArgumentParser) -> None:
    from comap_async.config import EVAL_METHODS

    add_config_arguments(p)
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR[:VERSION]",
        help="run directories (each with ablation.json and adapters/ as the learner writes them), each played "
        "at its newest version or at VERSION (e.g. a fork's first co-evolution version)",
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
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse the rows and episodes OUT/cells already holds for the same adapters, method, games and "
        "settings (each episode is stored there as soon as it ends); no server is started when all rows are held",
    )


def run_and_version(arg: str) -> tuple[Path, str]:
    """``RUN_DIR[:VERSION]`` -> (the run directory, the version spec: VERSION or ``latest``)."""
    run, _, spec = arg.partition(":")
    return Path(run), spec or "latest"


def stage_run(
    run_dir: Path, index: int | str, adapter_root: Path, spec: str = "latest", with_ablation: bool = True
) -> tuple[int, list[str], str]:
    """Copy ``run_dir``'s version ``spec`` (default its newest complete one) under ``adapter_root``
    with the prefix ``r<index>-``; returns (version, the run's ablation, the prefix). ValueError when
    the run has no such version."""
    from comap_async.run_files import read_run_ablation
    from comap_async.wire.messages import ROLES, adapter_name
    from evaluator.eval_runner import resolve_version

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


def split_games(cfg: Any, split: str, n_games: int | None) -> list:
    """The games every row plays: ``n_games`` of ``split`` drawn with ``run.seed``; ValueError when none."""
    from comap_async.envs import games_from_config
    from comap_async.envs.base import spread_sample

    games = games_from_config(cfg.model_copy(update={"env": cfg.env.model_copy(update={"max_games": None})}), split)
    games = spread_sample(games, n_games, cfg.run.seed)
    if not games:
        raise ValueError(f"no games in split {split!r}")
    return games


def plan_cells(
    cfg: Any,
    runs: list[Path],
    methods: list[str],
    split: str,
    games: list,
    staged: list[tuple[int, list[str], str]],
    methods_from: tuple[Path, int, str] | None = None,
) -> list[Cell]:
    """The rows in table order: every prompting method (the base model, or ``methods_from``'s staged
    adapters: (its directory, version, prefix)), then every staged run with the CoMap loop."""
    from comap_async.run_files import read_run_methods
    from comap_async.wire.messages import Registry
    from evaluator.compare_report import METHOD_LABELS, run_label

    cells = []
    played_as = None
    if methods_from is None:
        base, source, adapters = Registry.serving(0), "base", "base model"
    else:
        base = Registry.serving(methods_from[1], methods_from[2])
        source, adapters = str(methods_from[0].resolve()), f"{methods_from[0].name} v{methods_from[1]}"
        played_as = read_run_methods(methods_from[0])
    for method in methods:
        cell = Cell(method, f"{METHOD_LABELS[method]} ({adapters})", "method", method, base, {}, played_as=played_as)
        cell.key = cell_key(cell.config(cfg), source, base.versions["policy"], method, split, games)
        cells.append(cell)
    for run_dir, (version, ablation, prefix) in zip(runs, staged):
        run_methods = read_run_methods(run_dir)
        label = run_label(ablation, run_dir.name, run_methods)
        key = cell_key(
            with_ablation(cfg, ablation, run_methods), str(run_dir.resolve()), version, "comap", split, games
        )
        registry = Registry.serving(version, prefix)
        cells.append(Cell(str(run_dir), label, "run", "comap", registry, key, str(run_dir), ablation, run_methods))
    return cells


def play_order(cells: list[Cell]) -> list[Cell]:
    """The cells to play, the staged runs' before the prompting methods' (each group in table order)."""
    return [c for c in cells if c.kind == "run"] + [c for c in cells if c.kind != "run"]


async def play_cells(
    cfg: Any,
    cells: list[Cell],
    games: list,
    envs: int | None,
    server: Any,
    serve_timeout: float,
    log: Any,
    store: CellStore,
    resume: bool = False,
) -> dict[str, dict[str, Any]]:
    """Play each cell on the same games against the server this command started; each finished
    episode is stored at once, and each report as soon as it is complete (``resume``: a row's
    episodes already stored are kept and only its other games played). Returns the reports by
    :attr:`Cell.id`."""
    from tqdm import tqdm

    from comap_async.wire.inference_client import InferenceClient
    from evaluator.compare_report import server_per_step
    from evaluator.eval_report import episode_record, summarize_records
    from evaluator.eval_runner import check_complete, play_games, wait_for_server

    await wait_for_server(cfg, server, serve_timeout, log)
    reports = {}
    async with InferenceClient.from_config(cfg) as client:
        for cell in cells:
            held, wall_before = store.load_partial(cell.key) if resume else ({}, 0.0)
            todo = [g for g in games if g.name not in held]
            if held:
                log.info("compare.row_resumed", what=cell.what, episodes_kept=len(held), games_left=len(todo))
            t0 = time.time()
            bar = tqdm(total=len(games), initial=len(games) - len(todo), desc=cell.label, unit="game", file=sys.stderr)
            steps = [0]

            def on_result(game: Any, stats: Any) -> None:  # called while this cell is played
                held[game.name] = episode_record(game, stats)
                store.save_partial(cell.key, list(held.values()), wall_before + time.time() - t0)
                bar.update(1)

            def on_step() -> None:  # a game is minutes on a CPU: the bar moves with environment steps too
                steps[0] += 1
                bar.set_postfix_str(f"steps={steps[0]} ({steps[0] / max(time.time() - t0, 1e-9):.2f}/s)")

            for name in cell.registry.adapters.values():
                await client.load_adapter(name, str(cfg.adapter_root / name))
            run_cfg = cell.config(cfg)
            counters_before = await client.engine_counters()
            try:  # every game may be held already (stopped between its last episode and its report)
                results = (
                    await play_games(
                        run_cfg,
                        todo,
                        cell.registry,
                        log,
                        envs=envs,
                        method=cell.method,
                        on_result=on_result,
                        on_step=on_step,
                    )
                    if todo
                    else []
                )
            finally:
                bar.close()
            check_complete(results, todo, cell.what)
            version = cell.registry.versions.get("policy", 0)
            records = [held[g.name] for g in games]
            report = summarize_records(records, cell.key["split"], version, wall_before + time.time() - t0)
            report["server_per_step"] = server_per_step(counters_before, await client.engine_counters(), steps[0])
            store.save(cell.key, report)
            log.info("compare.row", what=cell.what, success_rate=report["success_rate"], delta_f1=report["delta_f1"])
            reports[cell.id] = report
            for name in cell.registry.adapters.values():
                await client.unload_adapter(name, missing_ok=True)
    return reports


def run(args: argparse.Namespace) -> int:
    from comap_async.config import EVAL_METHODS, load_config
    from comap_async.envs.registry import env_spec
    from comap_async.logsetup import configure_logging
    from evaluator.compare_report import bar_chart, markdown, row
    from evaluator.eval_runner import EvalIncomplete, ServerStartError, start_server, stop_server

    out = Path(args.out)
    adapter_root = (out / "adapters").resolve()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in EVAL_METHODS or m == "comap"]
    run_specs = [run_and_version(a) for a in args.runs]
    runs = [r for r, _ in run_specs]

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
        staged = [stage_run(r, i + 1, adapter_root, spec) for i, (r, spec) in enumerate(run_specs)]
        methods_from = None
        if args.methods_from:
            source, spec = run_and_version(args.methods_from)
            version, _, prefix = stage_run(source, "m", adapter_root, spec, with_ablation=False)
            methods_from = (source, version, prefix)
        games = split_games(cfg, args.split, args.games)
    except ValueError as exc:
        return fail(str(exc))
    cells = plan_cells(cfg, runs, methods, args.split, games, staged, methods_from)
    store = CellStore(out, log)
    reports = {c.id: r for c in cells if args.resume and (r := store.load(c.key)) is not None}
    for cell in cells:
        if cell.id in reports:
            log.info("compare.row_reused", what=cell.what, cells=str(store.root))
    # the trained runs' rows are played first: they are what a table is made for, and a slow prompting
    # method (look-ahead) played first would hold them back for an hour
    todo = play_order([c for c in cells if c.id not in reports])
    if todo:
        cfg, server = start_server(args.config, overrides, log)
        try:
            reports |= asyncio.run(
                play_cells(cfg, todo, games, args.envs, server, args.serve_timeout, log, store, args.resume)
            )
        except (ValueError, ServerStartError, EvalIncomplete) as exc:
            return fail(str(exc))
        finally:
            stop_server(server)
    rows = [
        row(c.label, c.kind, c.method, reports[c.id], **({"run": c.run, "ablation": c.ablation} if c.run else {}))
        for c in cells
    ]
    report = {"split": args.split, "games": len(games), "rows": rows}
    (out / "compare.json").write_text(json.dumps(report, indent=2))
    table = markdown(rows, args.split, len(games))
    (out / "compare.md").write_text(table)
    scored = env_spec(cfg.env.name).scored
    chart = bar_chart(rows, out / "compare.png", f"{args.split}, {len(games)} games", scored=scored)
    print(table)
    log.info("compare.done", out=str(out), rows=len(rows), reused=len(cells) - len(todo), chart=str(chart))
    return 0
