"""``comap compare --resume``: a row is reused only for the same adapters, method, games and playing
settings; where files and servers live does not count, and a file cut short is measured again."""

from __future__ import annotations

import json

import pytest

from comap_async.config import load_config
from comap_async.envs.base import GameInfo
from evaluator.compare_cells import CellStore, cell_key

GAMES = [GameInfo(f"/data/valid_seen/g{i}/game.tw-pddl", "valid_seen", 1, f"valid_seen/g{i}/t0") for i in range(3)]


def key(*overrides: str, source: str = "/runs/a", version: int = 7, method: str = "comap", games=GAMES) -> dict:
    return cell_key(load_config("configs/local.yaml", list(overrides)), source, version, method, "valid_seen", games)


def test_the_key_ignores_where_things_live_and_sees_what_changes_play():
    assert key() == key(
        "env.data_dir=/elsewhere",
        "model.cache_dir=/cache",
        "inference.port=9999",
        "run.name=x",
        "model.torch_threads=2",
        "actor.envs=8",
        "actor.env_workers=2",
        "eval.envs=8",
    )
    for other in (
        key("eval.lookahead_k=4"),
        key("env.max_steps=30"),
        key("method.tau_p=0.7"),
        key("method.ablation=no_action_gate"),
        key("run.seed=1"),
        key(version=8),
        key(source="/runs/b"),
        key(method="draft_only"),
        key(games=GAMES[:2]),
    ):
        assert other != key()


@pytest.mark.parametrize(
    ("form", "on"),
    [("window", []), ("draft_turns", ["draft_turns"]), ("all_turns", ["draft_turns", "reflect_turns", "wm_turns"])],
)
def test_the_prompt_form_keys_a_row_as_the_switches_it_replaced_did(form, on):
    """Rows stored while the form was four booleans keep their keys (and so ``--resume``): each on
    one named true, the ones off absent."""
    env = key(f"env.prompt_form={form}", "learner.demo_loss_share={}")["settings"]["env"]
    assert "prompt_form" not in env
    turns = {"draft_turns", "reflect_turns", "wm_turns", "task_every_turn"}
    assert {k: v for k, v in env.items() if k in turns} == dict.fromkeys(on, True)


def test_a_stored_row_is_read_back_only_for_its_own_key(tmp_path):
    store = CellStore(tmp_path)
    report = {"success_rate": 0.15, "games": 3}
    assert store.load(key()) is None
    store.save(key(), report)
    assert store.load(key()) == report
    assert store.load(key("eval.lookahead_k=4")) is None
    assert not list(store.root.glob("*.tmp"))


def test_a_row_file_cut_short_is_measured_again(tmp_path):
    store = CellStore(tmp_path)
    store.save(key(), {"success_rate": 0.15})
    (path,) = store.root.glob("*.json")
    path.write_text(path.read_text()[:20])
    assert store.load(key()) is None


def test_a_rows_finished_episodes_are_read_back_for_its_own_key_until_the_row_is_saved(tmp_path):
    store = CellStore(tmp_path)
    assert store.load_partial(key()) == ({}, 0.0)
    episodes = [{"game": "valid_seen/g0/t0", "won": True, "steps": 5}]
    store.save_partial(key(), episodes, 12.5)
    assert store.load_partial(key()) == ({"valid_seen/g0/t0": episodes[0]}, 12.5)
    assert store.load_partial(key("eval.lookahead_k=4")) == ({}, 0.0)
    store.save(key(), {"success_rate": 1.0})
    assert store.load_partial(key()) == ({}, 0.0) and store.load(key()) == {"success_rate": 1.0}


def test_a_row_measured_before_its_adapters_were_written_is_played_again(tmp_path):
    """A key names a run directory and version, not weights: a run forked again under the same name
    reaches the same versions with other adapters, and its old rows must not stand for them."""
    import os

    run = tmp_path / "runs" / "a"
    (run / "adapters" / "policy-v7").mkdir(parents=True)
    (run / "adapters" / "policy-v7" / "adapter_model.safetensors").write_bytes(b"old")
    (run / "adapters" / "policy-v8").mkdir()  # another version: does not count
    store = CellStore(tmp_path / "out")
    k = key(source=str(run))
    store.save(k, {"success_rate": 0.15})
    store.save_partial(key("eval.lookahead_k=4", source=str(run)), [{"game": "g0"}], 3.0)
    assert store.load(k) == {"success_rate": 0.15} and store.stale == []
    (run / "adapters" / "policy-v8" / "adapter_model.safetensors").write_bytes(b"later, another version")
    assert store.load(k) == {"success_rate": 0.15}
    newer = max(p.stat().st_mtime for p in store.root.iterdir()) + 10
    weights = run / "adapters" / "policy-v7" / "adapter_model.safetensors"
    weights.write_bytes(b"new")  # the run forked again and published v7 anew
    os.utime(weights, (newer, newer))
    assert store.load(k) is None
    assert store.load_partial(key("eval.lookahead_k=4", source=str(run))) == ({}, 0.0)
    assert len(store.stale) == 2 and len(list(store.root.glob("*.stale"))) == 2  # kept aside, not deleted
    assert store.load(key(source="base")) is None and CellStore.published_at(key(source="base")) == 0.0


def test_the_report_from_stored_records_equals_the_report_from_episodes():
    from actors.episodes import EpisodeStats
    from evaluator.eval_report import episode_record, summarize, summarize_records

    results = [
        (GAMES[0], EpisodeStats(steps=6, won=True, reward=1.0, revisions=1, invalid=2, delta_f1=[0.5, 1.0])),
        (GAMES[1], EpisodeStats(steps=50, reward=0.333, invalid=3, delta_f1=[0.25])),
    ]
    for _, stats in results:
        stats.gate_reasons = {"keep": stats.steps - stats.revisions, **({"revised": 1} if stats.revisions else {})}
    stored = [json.loads(json.dumps(episode_record(g, s))) for g, s in results]  # through a file
    assert summarize_records(stored, "valid_seen", 7, 3.0) == summarize(results, "valid_seen", 7, 3.0)
    report = summarize(results, "valid_seen", 7, 3.0)
    assert report["mean_score"] == pytest.approx(66.65) and report["delta_f1"] == pytest.approx(0.5833333)
    assert report["episodes"][1]["score"] == 33.3 and "delta_f1" not in report["episodes"][0]
    assert report["gate_reasons"] == {"keep": 55, "revised": 1}


def test_an_episodes_record_keeps_the_actions_it_executed_in_order():
    from actors.episodes import EpisodeStats
    from evaluator.eval_report import episode_record, summarize

    stats = EpisodeStats(steps=3)
    stats.state_actions = [
        (frozenset({"a"}), "go to desk 1"),
        (frozenset({"b"}), "take pen 1"),
        (frozenset({"b"}), "look"),
    ]
    assert episode_record(GAMES[0], stats)["actions"] == ["go to desk 1", "take pen 1", "look"]
    assert summarize([(GAMES[0], stats)], "valid_seen", 7, 1.0)["episodes"][0]["actions"][1] == "take pen 1"
