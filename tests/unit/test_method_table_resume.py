"""``benchmarks/method_table.py --resume``: which forks are kept, forked again or forked anew."""

from __future__ import annotations

import pytest

from benchmarks.method_table import plan_forks, set_aside, variant_overrides


def test_a_trained_fork_is_kept_and_one_cut_short_is_forked_again():
    done = {"r27-comap": {"name": "r27-comap", "wall_s": 1800}, "r27-frozen_wm": {"name": "r27-frozen_wm"}}
    plan = plan_forks(["comap", "frozen_wm", "no_action_gate", "comap"], "r27", done)
    assert plan == [
        ("r27-comap", "comap", "keep"),
        ("r27-frozen_wm", "frozen_wm", "refork"),
        ("r27-no_action_gate", "no_action_gate", "fork"),
        ("r27-comap-again", "comap", "fork"),
    ]


def test_a_variant_is_its_ablations_and_settings():
    assert variant_overrides("comap") == []
    assert variant_overrides("frozen_wm+learner.policy_wm_aux=0.2") == [
        "ablation.frozen_wm=true",
        "learner.policy_wm_aux=0.2",
    ]
    with pytest.raises(SystemExit, match="unknown ablation frozen"):
        variant_overrides("frozen")


def test_the_table_says_how_far_each_fork_trained(tmp_path):
    import json

    from benchmarks.method_table import trained_to
    from comap_async.wire.messages import ROLES, adapter_name

    run = tmp_path / "r27-frozen_wm"
    for version, step in ((7, 107), (13, 167)):
        for role in ROLES:
            d = run / "adapters" / adapter_name(role, version)
            d.mkdir(parents=True)
            (d / "comap.json").write_text(json.dumps({"version": version, "step": step}))
    record = {"version": 7, "step": 107}
    assert trained_to(run, record) == ", v7 -> v13 (learner steps 107 -> 167)"
    assert trained_to(tmp_path / "gone", record) == ""


def test_a_forks_training_wait_ends_at_its_time_or_when_the_system_stops(tmp_path):
    import subprocess
    import time

    import pytest

    from experiments.system import wait_with_bar

    running = subprocess.Popen(["sleep", "30"])
    try:
        t0 = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):  # still running at the end of its time: train() stops it
            wait_with_bar(running, "fork", 0.05, tmp_path)
        assert 2.5 < time.monotonic() - t0 < 10
    finally:
        running.kill()
        running.wait()
    stopped = subprocess.Popen(["true"])
    t0 = time.monotonic()
    wait_with_bar(stopped, "fork", 0.5, tmp_path)  # stopped by itself: returns at once (train() says so)
    assert time.monotonic() - t0 < 5


def test_the_table_says_how_often_each_forks_action_gate_opened(tmp_path):
    """Counted over the gate's samples the fork stored itself (after its fork point), by version."""
    import msgpack

    from benchmarks.method_table import gate_by_version, gate_line
    from broker.ingest import Ingest
    from broker.store import ReplayStore
    from comap_async.wire.protocol import decode
    from tests.fixtures.broker import make_transition

    revised = dict(decision="REVISE", a_ref="go to fridge 1", a_exec="go to fridge 1", p_revise=0.9, q_ref=0.9)
    steps = [(1, 18, 5.0, {}), (2, 19, 50.0, revised), (3, 19, 51.0, {}), (4, 20, 52.0, {}), (5, 20, 53.0, {})]
    ingest, items = Ingest(), []
    for i, version, ts, over in steps:
        raw = msgpack.packb({**make_transition(i, policy_version=version, ts=ts, **over), "seq": i})
        items.append(ingest.prepare(decode(raw), raw))
    store = ReplayStore(tmp_path / "replay", {"transitions": 10, "reflections": 10})
    store.write(items)
    store.close()
    rows = gate_by_version(tmp_path, since_ts=10.0)  # the version-18 sample is the source's
    assert rows == [(19, 1, 2), (20, 0, 2)]
    assert gate_line(rows) == "; action gate opened on 1 of 4 samples (v19 1/2, v20 0/2)"
    assert gate_line([]) == ""


def test_the_comparison_plays_under_the_forks_config_and_settings(tmp_path):
    """The forks train under ``--config`` (honcho's ``COMAP_CONFIG``); the comparison must read the same
    file (a session's table once trained on configs/local.yaml and compared on the built-in defaults,
    which name no ALFWorld data), then ``--set`` and ``--eval-set`` in that order."""
    import argparse

    from benchmarks.method_table import compare_command

    args = argparse.Namespace(
        split="valid_seen", games=20, methods="draft_only", out=tmp_path, resume=True,
        config="/repo/configs/local.yaml", overrides=["run.root=/runs"], eval_overrides=["model.torch_threads=2"],
        envs=8,
    )  # fmt: skip
    cmd = compare_command(args, [tmp_path / "r-comap"], tmp_path / "r", 19)
    assert cmd[cmd.index("--envs") + 1] == "8"
    assert "--envs" not in compare_command(argparse.Namespace(**{**vars(args), "envs": None}), [], tmp_path / "r", 19)
    assert cmd[cmd.index("--config") + 1] == "/repo/configs/local.yaml"
    assert cmd[cmd.index("--methods-from") + 1] == f"{tmp_path / 'r'}:19" and "--resume" in cmd
    sets = [cmd[i + 1] for i, x in enumerate(cmd) if x == "--set"]
    assert sets == ["run.root=/runs", "model.torch_threads=2"]


def test_refork_replaces_a_trained_fork_and_refuses_a_name_the_table_lacks():
    done = {
        "r27-comap": {"name": "r27-comap", "wall_s": 1800},
        "r27-frozen_wm": {"name": "r27-frozen_wm", "wall_s": 1200},
    }
    plan = plan_forks(["comap", "frozen_wm"], "r27", done, frozenset({"r27-frozen_wm"}))
    assert plan == [("r27-comap", "comap", "keep"), ("r27-frozen_wm", "frozen_wm", "replace")]
    with pytest.raises(SystemExit, match="--refork r27-no_wmsd names no fork"):
        plan_forks(["comap", "frozen_wm"], "r27", done, frozenset({"r27-no_wmsd"}))


def test_a_replaced_forks_run_directory_is_kept_beside_it(tmp_path):
    run = tmp_path / "r27-comap"
    (run / "adapters").mkdir(parents=True)
    (run / "adapters" / "latest.json").write_text("{}")
    aside = set_aside(run)
    assert not run.exists()
    assert aside.name.startswith("r27-comap.replaced-") and (aside / "adapters" / "latest.json").is_file()
    assert set_aside(run) is None


def test_a_warm_up_sitting_stopped_by_a_signal_still_counts_its_wall_time(tmp_path, monkeypatch):
    import json
    import time

    import experiments.system as mt

    def stopped(*args, **kwargs):
        time.sleep(1.1)
        raise SystemExit(143)  # SIGTERM's handler in main()

    monkeypatch.setattr(mt, "run_system", stopped)
    monkeypatch.setattr(mt, "first_version_in_phase", lambda run_dir, phase: None)
    ledger = tmp_path / "source.json"
    ledger.write_text(json.dumps({"name": "sw", "wall_s": 600}))
    with pytest.raises(SystemExit):
        mt.run_to_phase("sw", "coevolve", "cfg.yaml", [], 1.0, tmp_path, tmp_path, ledger)
    assert json.loads(ledger.read_text())["wall_s"] == 601


def test_a_long_variant_names_its_run_within_a_file_names_length():
    from benchmarks.method_table import run_slug

    assert run_slug("learner.bce_gate_labels=false") == "learner-bce_gate_labels-false"
    share = "+".join(f"learner.demo_loss_share.{w}=0.2" for w in ("go", "open", "close", "look"))
    long, other = run_slug("actor.admissible_choice=true+" + share), run_slug("actor.admissible_choice=false+" + share)
    assert len(long) == 96 and long.startswith("actor-admissible_choice-true-learner-demo_loss_share-go")
    assert long != other and long == run_slug("actor.admissible_choice=true+" + share)


def test_a_variant_the_config_refuses_stops_the_table_before_any_run():
    from pathlib import Path

    from benchmarks.method_table import refuse_bad_variants

    config = str(Path(__file__).resolve().parents[2] / "configs" / "scienceworld-local.yaml")
    refuse_bad_variants(
        config, [], ["comap", "frozen_wm", "learner.policy_wm_aux=0.2+learner.policy_wm_aux_entropy=acting"]
    )
    with pytest.raises(SystemExit, match="variant 'learner.policy_wm_aux=0.2'.*policy_wm_aux_entropy"):
        refuse_bad_variants(config, [], ["comap", "learner.policy_wm_aux=0.2"])
    with pytest.raises(SystemExit, match="unknown ablation frozen"):
        refuse_bad_variants(config, [], ["frozen"])


def test_the_trained_runs_rows_are_played_before_the_prompting_methods(tmp_path):
    from actors.compare import plan_cells, play_order
    from comap_async.config import CoMapConfig
    from comap_async.run_files import write_run_ablation

    fork, other = tmp_path / "src-comap", tmp_path / "src-frozen_wm"
    write_run_ablation(fork, [], [])
    write_run_ablation(other, ["frozen_wm"], [])
    source = tmp_path / "src"
    write_run_ablation(source, [], [])
    staged = [(5, [], "rm"), (5, ["frozen_wm"], "rm")]
    cells = plan_cells(
        CoMapConfig(), [fork, other], ["draft_only", "lookahead"], "valid_seen", [], staged, (source, 4, "rm")
    )
    assert [c.kind for c in cells] == ["method", "method", "run", "run"]  # the table's order is kept
    assert [c.what for c in play_order(cells)] == [str(fork), str(other), "draft_only", "lookahead"]
