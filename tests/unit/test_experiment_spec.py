"""Experiment specs (one-line errors for what cannot run) and the report written from played games (the
figures per seed and pooled, the comparisons, the noise floor between seeds, the README block)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from experiments.report import readme_tables, write_report
from experiments.spec import SpecError, load_spec

REPO = Path(__file__).resolve().parents[2]
BASE = {
    "config": "configs/local.yaml",
    "train": {"steps": 40},
    "arms": {"comap": {"seeds": [0, 1]}, "frozen_wm": {"ablation": ["frozen_wm"]}},
    "evaluation": {"pairs": [["comap/comap", "comap/draft_only"]]},
}


def spec_file(tmp_path: Path, **change) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({**BASE, **change}))
    return path


def test_the_committed_specs_load():
    for path in sorted((REPO / "experiments").glob("*.yaml")):
        spec = load_spec(path)
        assert spec.name == path.stem and (not spec.arms or spec.train.steps >= 1)


def test_a_table_of_the_fork_point_alone_needs_no_training(tmp_path):
    """No arms: every row plays the fork point, each in one of ``evaluation.source``'s ways."""
    path = tmp_path / "exp.yaml"
    body = {"config": "configs/local.yaml", "evaluation": {"source": ["draft_only", "comap", "comap_oracle"]}}
    path.write_text(yaml.safe_dump(body))
    spec = load_spec(path)
    assert spec.forks() == [] and spec.row_names() == ["source/draft_only", "source/comap", "source/comap_oracle"]
    path.write_text(yaml.safe_dump({**body, "evaluation": {"source": []}}))
    with pytest.raises(SpecError, match="the table would have no row"):
        load_spec(path)


def test_a_spec_names_its_rows_and_forks(tmp_path):
    spec = load_spec(spec_file(tmp_path))
    assert spec.name == "exp"
    assert spec.forks() == [("comap", 0), ("comap", 1), ("frozen_wm", 0)]
    assert spec.row_names() == [
        "source/draft_only",
        "comap/comap",
        "comap/draft_only",
        "frozen_wm/comap",
        "frozen_wm/draft_only",
    ]
    assert "comap/comap@s1" in spec.seed_row_names()


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"train": {"steps": 0}}, "train.steps: Input should be greater than or equal to 1"),
        ({"train": {"minutes": 15}}, "train.steps: Field required"),
        ({"train": None}, "train: required with arms"),
        ({"arms": {"x": {"ablation": ["frozen"]}}}, "arms.x.ablation: unknown frozen; known: frozen_wm"),
        ({"arms": {"source": {}}}, "arm 'source'"),
        ({"evaluation": {"arms": ["comap", "guess"]}}, "evaluation.arms: unknown method guess"),
        ({"evaluation": {"reference": "comap/react"}}, "row 'comap/react' is not played"),
        ({"evaluation": {"games": 0}}, "games must be 'all' or a positive number"),
        ({"arms": {"comap": {"seeds": [1, 1]}}}, "seeds must be distinct"),
        ({"name": "a b"}, "letters, digits"),
        ({"budget": 3}, "budget: Extra inputs are not permitted"),
        ({"evaluation": {"judged": ["frozen_wm/react"]}}, "row 'frozen_wm/react' is not played"),
        ({"evaluation": {"judged": ["comap/draft_only"]}}, "evaluation.judged: 'comap/draft_only' is not a CoMap row"),
        ({"source": {"experiment": "t", "run_dir": "runs/x"}}, "source: run_dir and experiment exclude each other"),
        ({"source": {"experiment": "t", "from_empty": True}}, "source: from_empty and experiment exclude each other"),
        ({"source": {"experiment": "t", "version": 3}}, "source.version needs source.run_dir"),
        ({"keep_state": "sometimes"}, "keep_state: Input should be a valid boolean"),
    ],
)
def test_a_spec_that_cannot_run_is_one_line_naming_the_field(tmp_path, change, says):
    with pytest.raises(SpecError) as err:
        load_spec(spec_file(tmp_path, **change))
    assert says in str(err.value) and "\n" not in str(err.value) and str(err.value).startswith(str(tmp_path))


def test_judged_rows_name_each_seed_of_a_pooled_row(tmp_path):
    spec = load_spec(spec_file(tmp_path, evaluation={"judged": ["comap/comap", "frozen_wm/comap"]}))
    assert spec.judged_rows() == {"comap/comap@s0", "comap/comap@s1", "frozen_wm/comap"}
    assert load_spec(spec_file(tmp_path, evaluation={"judged": ["comap/comap@s1"]})).judged_rows() == {"comap/comap@s1"}


def test_a_judged_games_record_counts_its_steps_and_the_report_computes_the_papers_rates(tmp_path):
    """URR, HRR, BRP of a judged row come from its games' step counts by the one definition
    (``comap_async.method.labels.reflection_diagnostics``), pooled over games and seeds."""
    from comap_async.method.labels import reflection_diagnostics
    from experiments.runner import game_record

    steps = [(1, 1, 0), (1, 0, 1), (0, 1, 1), (0, 0, 0), (1, 0, 1)]
    record = game_record({"won": False, "steps": 5}, steps)
    assert record["judged"] == {"000": 1, "011": 1, "101": 2, "110": 1}
    assert "judged" not in game_record({"won": True, "steps": 3}, [])  # an unjudged row's game
    spec = load_spec(spec_file(tmp_path, evaluation={"judged": ["comap/comap"]}))
    results = {
        "experiment": "exp",
        "spec": "experiments/exp.yaml",
        "split": "valid_seen",
        "games": ["g0", "g1"],
        "source": {"version": 3, "step": 100, "phase": "coevolve"},
        "forks": {},
        "train_steps": 40,
        "decoding": "greedy",
        "rows": {
            "source/draft_only": played([0, 0], "source", None, "draft_only", 100),
            "comap/comap@s0": played([0, 1], "comap", 0, "comap", 140),
            "comap/comap@s1": played([0, 0], "comap", 1, "comap", 140),
        },
    }
    results["rows"]["comap/comap@s0"]["episodes"]["g0"]["judged"] = record["judged"]
    results["rows"]["comap/comap@s0"]["episodes"]["g1"]["judged"] = {"010": 2}
    results["rows"]["comap/comap@s1"]["episodes"]["g0"]["judged"] = {"101": 1}
    out = write_report(spec, results, tmp_path)
    want = reflection_diagnostics([*steps, (0, 1, 0), (0, 1, 0), (1, 0, 1)])
    pooled = out["figures"]["comap/comap"]["reflection"]
    assert pooled["steps"] == 8 and pooled["urr"] == round(want["urr"], 4) and pooled["brp"] == round(want["brp"], 4)
    assert out["figures"]["comap/comap"]["per_seed"]["comap/comap@s1"]["reflection"]["sum_m"] == 1
    assert "reflection" not in out["figures"]["source/draft_only"]
    md = (tmp_path / "results.md").read_text()
    assert "## Reflection: URR, HRR, BRP" in md and "HRR 0.08, BRP 0.92" in md and "| `comap/comap` | 8 |" in md


def test_a_missing_or_broken_file_is_one_line(tmp_path):
    with pytest.raises(SpecError, match="No such file"):
        load_spec(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("arms: [")
    with pytest.raises(SpecError, match="not YAML"):
        load_spec(tmp_path / "bad.yaml")


def played(won: list[int], arm: str, seed: int | None, method: str, step: int) -> dict:
    games = {f"g{i}": {"won": bool(w), "steps": 10 if w else 50, "revisions": 1} for i, w in enumerate(won)}
    return {"arm": arm, "seed": seed, "method": method, "step": step, "episodes": games, "wall_s": 60.0}


def test_the_report_pools_seeds_compares_rows_and_prints_the_noise_floor(tmp_path):
    spec = load_spec(spec_file(tmp_path))
    n = 20
    results = {
        "experiment": "exp",
        "spec": "experiments/alfworld-quick.yaml",
        "split": "valid_seen",
        "games": [f"g{i}" for i in range(n)],
        "source": {"version": 3, "step": 100, "phase": "coevolve"},
        "forks": {"comap-s0": {"version": 5, "step": 140, "wall_s": 600}},
        "train_steps": 40,
        "decoding": "greedy",
        "rows": {
            "source/draft_only": played([0] * n, "source", None, "draft_only", 100),
            "comap/comap@s0": played([1] * 12 + [0] * 8, "comap", 0, "comap", 140),
            "comap/comap@s1": played([1] * 10 + [0] * 10, "comap", 1, "comap", 140),
            "comap/draft_only@s0": played([1] * 2 + [0] * 18, "comap", 0, "draft_only", 140),
            "comap/draft_only@s1": played([0] * n, "comap", 1, "draft_only", 140),
            "frozen_wm/comap": played([1] * 3 + [0] * 17, "frozen_wm", 0, "comap", 140),
        },
    }
    out = write_report(spec, results, tmp_path)
    pooled = out["figures"]["comap/comap"]
    assert pooled["won"] == 22 and pooled["played"] == 40 and pooled["success"] == 0.55
    assert pooled["per_seed"]["comap/comap@s0"]["won"] == 12
    assert "frozen_wm/draft_only" not in out["figures"]  # not played: no row, no comparison
    by_pair = {(c["row"], c["reference"]): c for c in out["comparisons"]}
    against_drafts = by_pair[("comap/comap", "comap/draft_only")]  # seed with seed
    assert (against_drafts["only_row"], against_drafts["only_reference"]) == (20, 0)
    assert against_drafts["verdict"].startswith("comap/comap ahead of comap/draft_only at 95 %")
    assert by_pair[("frozen_wm/comap", "source/draft_only")]["verdict"].startswith(
        "frozen_wm/comap not distinguishable from source/draft_only: +0.15"
    )
    (noise,) = [c for c in out["noise"] if c["row"] == "comap/comap@s0"]
    assert noise["reference"] == "comap/comap@s1" and noise["difference"] == 0.1
    md = (tmp_path / "results.md").read_text()
    assert "`comap/comap` pooled (2 seeds) | 40 | 22/40 | 0.55" in md and "Noise floor" in md
    assert (tmp_path / "results.png").stat().st_size > 1000
    assert json.loads((tmp_path / "results.json").read_text())["verdicts"] == out["verdicts"]

    readme = "intro\n<!-- results: results.json -->\nstale\n<!-- /results -->\nend\n"
    generated = readme_tables(readme, tmp_path)
    assert "stale" not in generated and "| `comap/comap@s0` | 40 | 12/20 | 0.60" in generated
    assert generated.endswith("<!-- /results -->\nend\n") and readme_tables(generated, tmp_path) == generated


def test_an_experiment_whose_training_reads_an_evaluation_split_is_refused_before_it_starts(tmp_path):
    from experiments.runner import Experiment

    for change in (
        {"set": ["env.split=valid_seen"]},  # every process's setting: the source trains on it
        {"arms": {"comap": {"set": ["env.split=valid_unseen"]}}},  # one arm's fork trains on it
    ):
        path = spec_file(tmp_path, **change)
        with pytest.raises(SpecError) as err:
            Experiment(load_spec(path), path, tmp_path / "out")
        assert "training must never read an evaluation split" in str(err.value) and "\n" not in str(err.value)


def test_a_report_of_an_unfinished_table_shows_what_is_played_and_compares_nothing_unfinished(tmp_path):
    spec = load_spec(spec_file(tmp_path))
    results = {
        "experiment": "exp",
        "spec": "experiments/alfworld-quick.yaml",
        "split": "valid_seen",
        "games": ["g0", "g1", "g2"],
        "source": {"version": 3, "step": 100, "phase": "coevolve"},
        "forks": {},
        "train_steps": 40,
        "decoding": "greedy",
        "rows": {
            "source/draft_only": played([1, 0, 0], "source", None, "draft_only", 100),
            "comap/comap@s0": played([1, 1], "comap", 0, "comap", 140),  # stopped after two games
            "comap/comap@s1": played([], "comap", 1, "comap", 140),
        },
    }
    out = write_report(spec, results, tmp_path)
    assert out["comparisons"] == [] and out["verdicts"] == []
    md = (tmp_path / "results.md").read_text()
    assert "| `comap/comap@s0` (partial: 2 of 3) | 40 | 2/2 |" in md
    assert "| `comap/comap@s1` (not played yet) |" in md
    assert "| `comap/comap` pooled (2 seeds) (partial) | 40 | 2/2 |" in md
    assert "No comparison yet" in md


def test_an_arms_ablation_forks_with_the_method_sections_list(tmp_path):
    """An arm's ``ablation:`` stays the spec's own key; its forks are started with ``method.ablation``."""
    from experiments.runner import Experiment

    path = spec_file(tmp_path, set=[f"run.root={tmp_path}"])
    experiment = Experiment(load_spec(path), path, tmp_path / "out")
    assert "method.ablation=[frozen_wm]" in experiment.fork_overrides("frozen_wm", 0)
    assert not any(o.startswith("method.ablation=") for o in experiment.fork_overrides("comap", 0))


def test_a_source_from_another_experiment_that_has_not_trained_it_is_one_line(tmp_path):
    """``source.experiment`` forks the source another spec trained; before it has, one line says how."""
    from experiments.runner import Experiment

    other = {**BASE, "set": [f"run.root={tmp_path / 'runs'}"], "keep_state": True}
    (tmp_path / "table.yaml").write_text(yaml.safe_dump(other))
    path = tmp_path / "lever.yaml"
    path.write_text(yaml.safe_dump({**BASE, "source": {"experiment": "table", "phase": "reflect_init"}}))
    experiment = Experiment(load_spec(path), path, tmp_path / "out")
    with pytest.raises(SpecError) as err:
        experiment.source({"source": None, "forks": {}})
    assert str(err.value) == (
        "source.experiment: table has not trained its source yet: run "
        f"`comap experiment run {tmp_path / 'table.yaml'} --train-only` first"
    )


def test_a_row_takes_the_finished_games_of_the_same_cell_from_another_table(tmp_path, monkeypatch):
    """The same adapters played the same way on the same games are one cell: a second table (the oracle
    bound's drafts at the method table's fork point) takes its finished games instead of playing them."""
    import experiments.runner as runner

    path = spec_file(tmp_path, set=[f"run.root={tmp_path}"])
    experiment = runner.Experiment(load_spec(path), path, tmp_path / "results" / "exp")
    monkeypatch.setattr(runner, "REPO", tmp_path)  # the tables under results/ here
    games = ["g0", "g1", "g2"]
    for name, rows in {
        "other": {"source/draft_only": {"key": "K", "episodes": {"g0": {"won": True}, "g1": {"won": False}}}},
        "partial": {"source/draft_only": {"key": "K", "episodes": {"g0": {"won": True}}}},
        "different": {"source/draft_only": {"key": "Z", "episodes": {g: {"won": True} for g in games}}},
    }.items():
        (tmp_path / "results" / name).mkdir(parents=True)
        (tmp_path / "results" / name / "results.json").write_text(json.dumps({"rows": rows}))
    held = {"key": "K", "episodes": {"g2": {"won": True}}}
    experiment.take_shared_games("source/draft_only", held, games)
    assert held["episodes"] == {"g0": {"won": True}, "g1": {"won": False}, "g2": {"won": True}}
    assert held["taken_from"] == "results/other"
    alone = {"key": "Q", "episodes": {}}  # no table holds its cell: nothing taken
    experiment.take_shared_games("source/draft_only", alone, games)
    assert alone == {"key": "Q", "episodes": {}}
