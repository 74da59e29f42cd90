"""``env.show_location`` is a play switch (docs/environments.md, "Where the agent is"): recorded with a
run, played as trained by ``comap compare`` (a run's own rows, and prompting methods on its adapters),
and absent from a row's key while off, so rows stored before it existed keep their keys."""

from __future__ import annotations

from comap_async.config import CoMapConfig
from comap_async.run_files import write_run_ablation
from evaluator.compare import plan_cells
from evaluator.compare_cells import cell_key


def test_a_prompting_method_on_a_runs_adapters_is_played_with_that_runs_switches(tmp_path):
    cfg = CoMapConfig.model_validate({"env": {"show_location": True}})
    assert "show_location" in cfg.method_switches
    old, new = tmp_path / "old", tmp_path / "new"
    write_run_ablation(old, [], [])  # trained before the switch: states without the location
    write_run_ablation(new, [], ["show_location"])
    for run, shown in ((old, False), (new, True)):
        (cell,) = plan_cells(cfg, [], ["draft_only"], "valid_seen", [], [], (run, 3, "rm"))
        assert cell.config(cfg).env.show_location is shown
        assert ("show_location" in cell.key["settings"]["env"]) is shown
    (base,) = plan_cells(cfg, [], ["draft_only"], "valid_seen", [], [], None)
    assert base.config(cfg) is cfg  # the base model: played with the config's settings


def test_the_key_holds_the_switch_only_while_it_is_on():
    off = CoMapConfig()
    on = CoMapConfig.model_validate({"env": {"show_location": True}})
    assert "show_location" not in cell_key(off, "src", 7, "draft_only", "valid_seen", [])["settings"]["env"]
    assert cell_key(on, "src", 7, "draft_only", "valid_seen", []) != cell_key(
        off, "src", 7, "draft_only", "valid_seen", []
    )
