"""``comap experiment run SPEC``: a spec's table end to end, resumable at any point.

1. **Source.** Train run ``source`` from empty (the Procfile's processes but the evaluator) until it
   publishes its first version of ``source.phase``; that version is the fork point. A source already
   there is resumed from its checkpoint, one that reached the phase is kept.
2. **Forks.** Each (arm, seed) is forked from that version (``comap fork``) and trained alone on the
   machine with ``run.seed`` = the seed and its ablation, until the learner publishes the version at
   exactly ``train.steps`` steps past the fork point (``learner.publish_every`` = the budget, so every
   arm is measured at the same step count). A fork stopped short of its steps is forked and trained
   again from the fork point, so every fork trains alike.
3. **Evaluation.** One embedded server; each row (the fork point and every fork's end, played by each
   method the spec names) plays the same games. Each finished game is written to
   ``results/NAME/results.json`` at once, keyed by what decides its figure (the adapters' content, the
   method, the games and the settings of play): stopped and started again, a row plays only the games
   it has not finished, and a row whose adapters changed (a fork trained again) is played again.
4. **Statistics.** :mod:`experiments.report` writes the figures, the paired comparisons and their
   verdicts into ``results.json``, ``results.md`` and ``results.png``.

The work (runs, logs, staged adapters) lives in ``run.root/experiments/NAME``; only ``results/NAME``
is meant to be committed. With the spec's ``keep_state`` the fork point and each fork's end are also packed
into ``results/NAME/state`` (:mod:`experiments.state`), from which a machine without the work goes on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.spec import ExperimentSpec, SpecError
from experiments.state import (
    STATE_DIR,
    bundle_bytes,
    bundle_name,
    pack_fork_end,
    pack_fork_point,
    remove_bundles,
    restore_ledgers,
    save_ledgers,
    unpack,
)
from experiments.system import write_json

REPO = Path(__file__).resolve().parents[1]
SOURCE = "source"


def say(name: str, text: str) -> None:
    """The progress line (stderr): one per phase, fork and game."""
    print(f"experiment {name} | {text}", file=sys.stderr, flush=True)


def adapters_digest(adapter_root: Path, version: int) -> str:
    """What a row's adapters are, by content: a fork trained again gets another digest, so its old rows
    are not taken for its new ones (names and version numbers repeat across trainings)."""
    from comap_async.wire.messages import ROLES, adapter_name

    h = hashlib.sha256()
    for role in ROLES:
        folder = adapter_root / adapter_name(role, version)
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            h.update(str(path.relative_to(folder)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:20]


def version_at_step(run_dir: Path, step: int) -> int | None:
    """The run's published version whose learner step is ``step`` (every role's adapter written), or None."""
    from comap_async.run_files import VERSION_META
    from comap_async.wire.messages import ROLES, adapter_name

    adapters = run_dir / "adapters"
    for meta_file in adapters.glob(f"policy-v*/{VERSION_META}"):
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):  # being written
            continue
        version = int(meta["version"])
        if int(meta["step"]) == step and all((adapters / adapter_name(r, version)).is_dir() for r in ROLES):
            return version
    return None


def newest_step(run_dir: Path) -> int | None:
    """The learner step of the run's newest published version (None before any)."""
    from comap_async.run_files import VERSION_META

    steps = []
    for meta_file in (run_dir / "adapters").glob(f"policy-v*/{VERSION_META}"):
        try:
            steps.append(int(json.loads(meta_file.read_text())["step"]))
        except (OSError, ValueError, KeyError):
            continue
    return max(steps) if steps else None


@dataclass
class Row:
    """One row still to be played or read back: a run's version played by one method."""

    name: str  # ARM/METHOD or ARM/METHOD@sSEED
    arm: str
    seed: int | None
    method: str
    run_dir: Path
    version: int
    step: int


class Experiment:
    def __init__(
        self,
        spec: ExperimentSpec,
        spec_path: Path,
        out: Path,
        *,
        split: str | None = None,
        games: int | str | None = None,
        data: str | None = None,
        state: Path | None = None,
    ) -> None:
        from comap_async.config import ConfigError, load_config

        self.spec, self.spec_path, self.out = spec, spec_path, out
        ev = spec.evaluation
        self.split = split or ev.split
        self.games_arg = games if games is not None else ev.games
        self.data = data or ev.data
        self.config = str((REPO / spec.config).resolve())
        try:
            # the source and every fork train: an evaluation split as their env.split is refused here, and a bad
            # arm stops the experiment now, not after a warm-up of hours
            cfg = load_config(self.config, spec.set, training=True)
            for arm in spec.arms:
                for seed in spec.arms[arm].seeds:
                    load_config(self.config, self.fork_overrides(arm, seed), training=True)
        except ConfigError as exc:
            raise SpecError(f"{spec_path}: {exc}") from None
        root = Path(cfg.run.root).expanduser()
        self.work = (root if root.is_absolute() else REPO / root).resolve() / "experiments" / spec.name
        self.logs = self.work / "logs"
        self.ledger_path = self.work / "ledger.json"
        self.results_path = out / "results.json"
        # spec.keep_state: what is trained is packed here too (results/NAME/state, committed)
        self.state = (state or out / STATE_DIR) if spec.keep_state else None

    # ---- settings ------------------------------------------------------------------------------

    def common_overrides(self) -> list[str]:
        return [*self.spec.set, f"run.root={self.work}"]

    def fork_overrides(self, arm: str, seed: int) -> list[str]:
        a = self.spec.arms[arm]
        return [
            *self.spec.set,
            *([f"method.ablation=[{','.join(a.ablation)}]"] if a.ablation else []),
            *a.set,
            f"run.seed={seed}",
            # the learner publishes at the fork point's step + k * steps: the version at exactly the
            # budget is the arm's end, whatever its wall time
            f"learner.publish_every={self.spec.train.steps}",
        ]

    def eval_overrides(self) -> list[str]:
        ev = self.spec.evaluation
        temperature = 0.0 if ev.decoding == "greedy" else ev.temperature
        return [
            *self.spec.set,
            *ev.set,
            *([f"env.data_dir={self.data}"] if self.data else []),
            f"inference.adapter_root={self.work / 'eval-adapters'}",
            f"run.root={self.work}",
            f"run.seed={ev.seed}",
            f"eval.temperature={temperature}",
        ]

    # ---- state ---------------------------------------------------------------------------------

    def ledger(self) -> dict[str, Any]:
        """What was trained; on a machine without the work directory, the ledgers kept in the state."""
        if self.state is not None and restore_ledgers(self.work, self.state):
            say(self.spec.name, f"no work directory here: its ledgers restored from {self.shown(self.state)}")
        if self.ledger_path.exists():
            return json.loads(self.ledger_path.read_text())
        return {"source": None, "forks": {}}

    def save_ledger(self, ledger: dict[str, Any]) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        write_json(self.ledger_path, ledger)
        if self.state is not None:
            save_ledgers(self.work, self.state)

    def restore(self, run_dir: Path, version: int, what: str) -> None:
        """``run_dir`` at ``version``, which this machine lacks, unpacked from the table's state if it is there."""
        manifest = self.state / bundle_name(run_dir.name, version) if self.state is not None else None
        if manifest is not None and manifest.is_file():
            unpack(manifest, run_dir)
            say(self.spec.name, f"{what}: restored from {self.shown(manifest)} (not trained again)")

    def pack(self, packer: Any, run_dir: Path, version: int, what: str) -> None:
        if self.state is None or (self.state / bundle_name(run_dir.name, version)).is_file():
            return
        remove_bundles(self.state, run_dir.name)
        say(self.spec.name, f"{what}: packing v{version} into {self.shown(self.state)}")
        path = packer(run_dir, version, self.state)
        say(self.spec.name, f"{what}: packed into {self.shown(path)} ({bundle_bytes(path) / 2**20:.1f} MB)")

    @staticmethod
    def shown(path: Path) -> str:
        return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)

    def results(self) -> dict[str, Any]:
        if self.results_path.exists():
            return json.loads(self.results_path.read_text())
        return {}

    # ---- 1. the source -------------------------------------------------------------------------

    def restore_source(self, ledger: dict[str, Any]) -> Path:
        """The source trained from empty, unpacked from the table's state where this machine lacks it."""
        from experiments.system import first_version_in_phase

        run_dir = self.work / SOURCE
        held = (ledger.get("source") or {}).get("version")
        if held is not None and first_version_in_phase(run_dir, self.spec.source.phase) is None:
            self.restore(run_dir, int(held), "source")
        return run_dir

    def other_source(self, name: str) -> Path:
        """The source that experiment ``name`` (``NAME.yaml`` beside this spec) trained, restored from its
        ``results/NAME/state`` where this machine lacks it; one line when it has not been trained."""
        from experiments.spec import load_spec
        from experiments.system import first_version_in_phase

        path = self.spec_path.parent / f"{name}.yaml"  # beside this spec
        other = Experiment(load_spec(path), path, REPO / "results" / name)
        if not other.spec.source.from_empty:
            raise SpecError(f"source.experiment: {name} trains no source of its own (its source is another run)")
        run_dir = other.restore_source(other.ledger())
        if first_version_in_phase(run_dir, other.spec.source.phase) is None:
            raise SpecError(
                f"source.experiment: {name} has not trained its source yet: run "
                f"`comap experiment run {self.shown(path)} --train-only` first"
            )
        return run_dir

    def source(self, ledger: dict[str, Any]) -> dict[str, Any]:
        from experiments.system import first_version_in_phase, run_to_phase

        src = self.spec.source
        name = self.spec.name
        if src.run_dir is not None or src.experiment is not None:
            if src.experiment is not None:
                run_dir = self.other_source(src.experiment)
            else:
                run_dir = Path(src.run_dir).expanduser()
                run_dir = run_dir if run_dir.is_absolute() else (REPO / run_dir).resolve()
            if src.version is not None:
                from experiments.fork import forkable_versions

                meta = forkable_versions(run_dir).get(src.version)
                if meta is None:
                    raise SpecError(f"source: version {src.version} of {run_dir} cannot be forked (no checkpoint)")
                reached = {"version": src.version, "step": int(meta["step"]), "phase": meta.get("phase")}
            else:
                reached = first_version_in_phase(run_dir, src.phase)
                if reached is None:
                    raise SpecError(f"source: {run_dir} has no forkable {src.phase} version")
            record = {"run_dir": str(run_dir), **reached}
        else:
            run_dir = self.work / SOURCE
            self.logs.mkdir(parents=True, exist_ok=True)
            self.restore_source(ledger)
            if first_version_in_phase(run_dir, src.phase) is None:
                say(
                    name,
                    f"source: training from empty to its first {src.phase} version (at most {src.max_minutes:g} min)",
                )
            record = run_to_phase(
                SOURCE,
                src.phase,
                self.config,
                self.common_overrides(),
                src.max_minutes,
                self.logs,
                self.work,
                self.work / "source.json",
            )
            record = {"run_dir": str(run_dir), **record}
            self.pack(pack_fork_point, run_dir, int(record["version"]), "source")  # with earlier phases' starts
        say(name, f"source: v{record['version']} at step {record['step']} ({record['phase']})")
        ledger["source"] = record
        self.save_ledger(ledger)
        return record

    # ---- 2. the forks --------------------------------------------------------------------------

    def forks(self, ledger: dict[str, Any], source: dict[str, Any]) -> dict[str, dict[str, Any]]:
        from experiments.fork import ForkError, fork_run
        from experiments.system import run_system

        name, steps = self.spec.name, self.spec.train.steps
        target = int(source["step"]) + steps
        for arm, seed in self.spec.forks():
            fork = f"{arm}-s{seed}"
            run_dir = self.work / fork
            record = ledger["forks"].get(fork)
            trained = record is not None and record.get("source_version") == source["version"] and "version" in record
            if trained and version_at_step(run_dir, target) != record["version"]:
                self.restore(run_dir, int(record["version"]), f"fork {fork}")
            if trained and version_at_step(run_dir, target) == record["version"]:
                if "gate_samples" not in record:  # a ledger written before the gate was counted
                    record["gate_opened"], record["gate_samples"] = training_gate(run_dir)
                    self.save_ledger(ledger)
                say(name, f"fork {fork}: trained (v{record['version']} at step {target}), kept")
                self.pack(pack_fork_end, run_dir, int(record["version"]), f"fork {fork}")
                continue
            if record is not None:
                say(name, f"fork {fork}: stopped short of its {steps} steps before: forked and trained again")
            shutil.rmtree(run_dir, ignore_errors=True)
            if self.state is not None:
                remove_bundles(self.state, fork)
            try:
                forked = fork_run(Path(source["run_dir"]), run_dir, int(source["version"]))
            except ForkError as exc:
                raise SpecError(f"fork {fork}: {exc}") from None
            record = {"arm": arm, "seed": seed, "source_version": source["version"], "fork_step": forked["step"]}
            ledger["forks"][fork] = record
            self.save_ledger(ledger)
            say(name, f"fork {fork}: training {steps} steps from step {forked['step']} (to step {target})")
            self.logs.mkdir(parents=True, exist_ok=True)
            wall = run_system(
                fork,
                self.config,
                [*self.fork_overrides(arm, seed), f"run.root={self.work}"],
                self.spec.train.max_minutes,
                self.logs,
                run_dir,
                until=lambda: version_at_step(run_dir, target) is not None,
                # the learner trains exactly the budget and stops: it publishes at it (publish_every, and its
                # budget's last step whatever the phases' cadence) and trains no step past it, so the
                # version there is not rotated away before it is read
                learner_args=["--max-steps", str(steps)],
            )
            version = version_at_step(run_dir, target)
            if version is None:
                reached = newest_step(run_dir)
                raise SpecError(
                    f"fork {fork}: no version at step {target} after {wall / 60:.1f} minutes (newest published: "
                    f"step {reached}); raise train.max_minutes, or see {self.logs / (fork + '.log')}"
                )
            opened, samples = training_gate(run_dir)
            # a CoMap arm is CoMap only while its action gate opens: how often it did in the fork's own training
            record.update(version=version, step=target, wall_s=round(wall), gate_opened=opened, gate_samples=samples)
            self.pack(pack_fork_end, run_dir, version, f"fork {fork}")
            self.save_ledger(ledger)
            say(
                name,
                f"fork {fork}: v{version} at step {target} in {wall / 60:.1f} minutes (its action gate opened on "
                f"{opened} of {samples} samples)",
            )
        return ledger["forks"]

    # ---- 3. the evaluation ---------------------------------------------------------------------

    def rows(self, source: dict[str, Any], forks: dict[str, dict[str, Any]]) -> list[Row]:
        out = [
            Row(f"source/{m}", SOURCE, None, m, Path(source["run_dir"]), int(source["version"]), int(source["step"]))
            for m in self.spec.plays(SOURCE)
        ]
        for arm, spec in self.spec.arms.items():
            for method in self.spec.plays(arm):
                for seed in spec.seeds:
                    f = forks[f"{arm}-s{seed}"]
                    row_name = f"{arm}/{method}" + (f"@s{seed}" if len(spec.seeds) > 1 else "")
                    out.append(Row(row_name, arm, seed, method, self.work / f"{arm}-s{seed}", f["version"], f["step"]))
        return out

    def evaluate(self, rows: list[Row], ledger: dict[str, Any]) -> dict[str, Any]:
        from comap_async.config import load_config
        from comap_async.logsetup import configure_logging
        from comap_async.run_files import read_run_ablation, read_run_methods
        from evaluator.compare import split_games, stage_run
        from evaluator.compare_cells import cell_key, key_digest, with_ablation
        from evaluator.eval_runner import stop_server

        overrides = self.eval_overrides()
        cfg = load_config(self.config, overrides)
        # the progress lines say what happens; the episodes' own log lines would bury them (COMAP_LOG_LEVEL=INFO
        # brings them back)
        log = configure_logging("experiment", level=os.environ.get("COMAP_LOG_LEVEL", "WARNING"), run=self.spec.name)
        games_n = None if self.games_arg == "all" else int(self.games_arg)
        try:
            games = split_games(cfg, self.split, games_n)
        except ValueError as exc:
            raise SpecError(f"evaluation: {exc}") from None
        adapter_root = self.work / "eval-adapters"
        adapter_root.mkdir(parents=True, exist_ok=True)

        results = self.results()
        names = [g.name for g in games]
        if results and (results.get("games") != names or results.get("split") != self.split):
            # never dropped silently: it may be a committed table
            raise SpecError(
                f"{self.results_path} holds {len(results.get('games', []))} games of {results.get('split')}, not "
                f"these {len(names)} of {self.split}: give another --out, or remove it to start this table anew"
            )
        if not results:
            results = {"experiment": self.spec.name, "split": self.split, "games": names, "rows": {}}
        results["spec"] = str(self.spec_path)
        results["source"] = dict(ledger["source"])
        results["forks"] = ledger["forks"]
        results["train_steps"] = self.spec.train.steps if self.spec.train is not None else 0
        results["decoding"] = self.spec.evaluation.decoding
        self.out.mkdir(parents=True, exist_ok=True)

        plan = []
        judged_rows = self.spec.judged_rows()
        for i, row in enumerate(rows):
            ablation = read_run_ablation(row.run_dir) if row.arm != SOURCE else []
            methods = read_run_methods(row.run_dir)
            prefix_id = row.name.replace("/", "-").replace("@", "-")
            version, _, prefix = stage_run(row.run_dir, prefix_id, adapter_root, str(row.version), with_ablation=False)
            digest = adapters_digest(row.run_dir / "adapters", version)
            row_cfg = with_ablation(cfg, ablation, methods)
            judged = row.name in judged_rows
            # a judged row's games carry its branch counts: it is another cell than the same row unjudged
            key = key_digest(
                {
                    **cell_key(row_cfg, digest, version, row.method, self.split, games),
                    **({"judged": True} if judged else {}),
                }
            )
            held = results["rows"].get(row.name)
            if held is not None and held.get("key") != key:
                say(self.spec.name, f"row {row.name}: its adapters or settings changed: played again")
                held = None
            if held is None:
                held = {"key": key, "arm": row.arm, "seed": row.seed, "method": row.method, "step": row.step}
                if judged:
                    held["judged"] = True
                held.update(version=version, adapters=digest, episodes={}, wall_s=0.0)
                held["sees"] = what_row_sees(row_cfg, row.method)
                results["rows"][row.name] = held
            if len(held["episodes"]) < len(games):
                self.take_shared_games(row.name, held, names)
            plan.append((row, (ablation, methods), prefix, held))
        write_json(self.results_path, results)

        todo = [item for item in plan if len(item[3]["episodes"]) < len(games)]
        if todo:
            self.logs.mkdir(parents=True, exist_ok=True)
            cfg, server = self.start_server(overrides, log)
            try:
                asyncio.run(self._play(cfg, server, todo, games, results, log))
            finally:
                stop_server(server)
        return results

    def take_shared_games(self, row: str, held: dict[str, Any], games: list[str]) -> None:
        """The finished games of the same cell (same key: adapters, method, games and settings of play) that
        another table under ``results/`` holds, taken instead of played again: the oracle bound's drafts
        at the fork point are the method table's ``source/draft_only``."""
        best: tuple[str, dict[str, Any]] | None = None
        for path in sorted((REPO / "results").glob("*/results.json")):
            if path.resolve() == self.results_path.resolve():
                continue
            try:
                other = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            for cell in other.get("rows", {}).values():
                have = {g: e for g, e in cell.get("episodes", {}).items() if g in games}
                if cell.get("key") == held["key"] and len(have) > len((best or ("", {}))[1]):
                    best = (str(path.parent.relative_to(REPO)), have)
        if best is None or len(best[1]) <= len(held["episodes"]):
            return
        taken = len(best[1]) - len(held["episodes"])
        held["episodes"] = {**best[1], **held["episodes"]}
        held["taken_from"] = best[0]  # written with the plan, before any game is played
        say(self.spec.name, f"row {row}: {taken} finished games of the same cell taken from {best[0]}")

    def start_server(self, overrides: list[str], log: Any) -> tuple[Any, Any]:
        """The evaluation's embedded server on a free port, its output in ``logs/eval-server.log``, tied to
        this process (it stops when this process dies, however)."""
        import subprocess

        from comap_async.config import load_config
        from comap_async.lifetime import tied_env
        from comap_async.ports import free_port
        from evaluator.eval_runner import server_command

        port = free_port()
        cfg = load_config(
            self.config, overrides + [f"inference.port={port}", f"inference.endpoints=['http://127.0.0.1:{port}']"]
        )
        with open(self.logs / "eval-server.log", "ab") as out:
            server = subprocess.Popen(
                server_command(self.config, overrides, port), env=tied_env(), stdout=out, stderr=subprocess.STDOUT
            )
        say(self.spec.name, f"evaluation: server on port {port} (log: {self.logs / 'eval-server.log'})")
        return cfg, server

    async def _play(self, cfg: Any, server: Any, todo: list, games: list, results: dict[str, Any], log: Any) -> None:
        from comap_async.wire.inference_client import InferenceClient
        from comap_async.wire.messages import Registry
        from evaluator.compare_cells import with_ablation
        from evaluator.eval_report import episode_record
        from evaluator.eval_runner import check_complete, play_games, wait_for_server

        await wait_for_server(cfg, server, 600.0, log)
        async with InferenceClient.from_config(cfg) as client:
            for row, (ablation, methods), prefix, held in todo:
                row_cfg = with_ablation(cfg, ablation, methods)  # played against the server started here
                registry = Registry.serving(held["version"], prefix)
                left = [g for g in games if g.name not in held["episodes"]]
                say(
                    self.spec.name,
                    f"row {row.name}: {len(games) - len(left)} of {len(games)} games held, playing {len(left)}",
                )
                t0, wall_before, held_before = time.time(), held["wall_s"], len(held["episodes"])

                def on_result(game: Any, stats: Any, held: dict = held, name: str = row.name) -> None:
                    held["episodes"][game.name] = game_record(episode_record(game, stats), stats.judged_steps)
                    held["wall_s"] = round(wall_before + time.time() - t0, 1)
                    write_json(self.results_path, results)
                    won = sum(e["won"] for e in held["episodes"].values())
                    # the rate of this sitting's games: an earlier sitting may have run on a busier machine
                    done_now, left = len(held["episodes"]) - held_before, len(games) - len(held["episodes"])
                    eta = f", ~{(time.time() - t0) / done_now * left / 60:.0f} min left" if left and done_now else ""
                    say(
                        self.spec.name,
                        f"row {name}: game {len(held['episodes'])}/{len(games)} {'won' if stats.won else 'lost'} "
                        f"({won} won so far, {held['wall_s'] / 60:.1f} min{eta})",
                    )

                for name in registry.adapters.values():
                    await client.load_adapter(name, str(cfg.adapter_root / name))
                played = await play_games(
                    row_cfg,
                    left,
                    registry,
                    log,
                    envs=self.spec.evaluation.envs,
                    method=row.method,
                    on_result=on_result,
                    reflection_metrics=bool(held.get("judged")),
                )
                check_complete(played, left, row.name)
                # a finished row lists its games in the split's order, so its part of the file is the same
                # whichever order the games ended in and however often the run was stopped
                held["episodes"] = {g.name: held["episodes"][g.name] for g in games}
                write_json(self.results_path, results)
                for name in registry.adapters.values():
                    await client.unload_adapter(name, missing_ok=True)

    # ---- all of it -----------------------------------------------------------------------------

    def run(self, train_only: bool = False) -> dict[str, Any]:
        from experiments.report import write_report

        ledger = self.ledger()
        source = self.source(ledger)
        forks = self.forks(ledger, source)
        if train_only:
            say(self.spec.name, "trained; `comap experiment run` without --train-only evaluates")
            return {}
        results = self.evaluate(self.rows(source, forks), ledger)
        results = write_report(self.spec, results, self.out)
        for line in results["verdicts"]:
            say(self.spec.name, line)
        return results


def training_gate(run_dir: Path) -> tuple[int, int]:
    """(samples whose reflected action the action gate executed, gated samples) over the reflection samples
    the fork stored itself (stamped after its fork point, ``fork.json``'s ``cut_ts``)."""
    from broker.ingest import record_from_store
    from broker.store import ReplayStore
    from comap_async.commands.stats import gates_by_version
    from comap_async.wire.messages import STORES
    from experiments.fork import FORK_FILE

    store = ReplayStore(run_dir / "replay", dict.fromkeys(STORES, 1 << 40), readonly=True)
    try:
        records = [record_from_store("reflections", raw) for raw in store.iter_store("reflections")]
    finally:
        store.close()
    since_ts = float(json.loads((run_dir / FORK_FILE).read_text())["cut_ts"])
    own = [rec for rec in records if float(rec.get("ts") or 0.0) > since_ts]
    gates = gates_by_version(own)
    return sum(round(g["revision_accepted"] * g["samples"]) for g in gates), sum(g["samples"] for g in gates)


def game_record(record: dict[str, Any], judged_steps: list[tuple[int, int, int]] | None = None) -> dict[str, Any]:
    """What results.json keeps of a game: its outcome and how the loop played it (no action list: the
    file stays small enough to commit); a judged row's game also its steps counted by ``(m, z_draft,
    z_ref)`` (``"101": 2``: two executed revisions whose draft would have lost and whose action wins),
    from which the row's URR, HRR and BRP are computed (:func:`experiments.report.reflection_figures`)."""
    keep = ("won", "steps", "score", "revisions", "invalid", "loops", "parse_problems", "gate_reasons")
    f1 = record.get("delta_f1") or []
    judged: dict[str, int] = {}
    for step in judged_steps or ():
        code = "".join(str(int(v)) for v in step)
        judged[code] = judged.get(code, 0) + 1
    return {
        **{k: record[k] for k in keep if k in record},
        **({"delta_f1": round(sum(f1) / len(f1), 4)} if f1 else {}),
        **({"judged": dict(sorted(judged.items()))} if judged else {}),
    }


def what_row_sees(cfg: Any, method: str) -> dict[str, Any]:
    """What each role of ``method`` reads and how its action is decoded, found by playing the method's own
    code on a probe game (:func:`evaluator.roles_read.what_roles_read`), so the table says what differs."""
    from evaluator.roles_read import what_roles_read

    return what_roles_read(cfg, method)
