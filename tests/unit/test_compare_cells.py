"""``comap compare --resume``: a row is reused only for the same adapters, method, games and playing
settings; where files and servers live does not count, and a file cut short is measured again."""

from __future__ import annotations

from actors.compare import CellStore, cell_key
from comap_async.config import load_config
from comap_async.envs.base import GameInfo

GAMES = [GameInfo(f"/data/valid_seen/g{i}/game.tw-pddl", "valid_seen", 1, f"valid_seen/g{i}/t0") for i in range(3)]


def key(*overrides: str, source: str = "/runs/a", version: int = 7, method: str = "comap", games=GAMES) -> dict:
    return cell_key(load_config("configs/local.yaml", list(overrides)), source, version, method, "valid_seen", games)


def test_the_key_ignores_where_things_live_and_sees_what_changes_play():
    assert key() == key("env.data_dir=/elsewhere", "model.cache_dir=/cache", "inference.port=9999", "run.name=x")
    for other in (
        key("eval.repeat_guard=4"),
        key("env.max_steps=30"),
        key("gates.tau_p=0.7"),
        key("ablation.no_action_gate=true"),
        key("run.seed=1"),
        key(version=8),
        key(source="/runs/b"),
        key(method="draft_only"),
        key(games=GAMES[:2]),
    ):
        assert other != key()


def test_a_stored_row_is_read_back_only_for_its_own_key(tmp_path):
    store = CellStore(tmp_path)
    report = {"success_rate": 0.15, "games": 3}
    assert store.load(key()) is None
    store.save(key(), report)
    assert store.load(key()) == report
    assert store.load(key("eval.repeat_guard=4")) is None
    assert not list(store.root.glob("*.tmp"))


def test_a_row_file_cut_short_is_measured_again(tmp_path):
    store = CellStore(tmp_path)
    store.save(key(), {"success_rate": 0.15})
    (path,) = store.root.glob("*.json")
    path.write_text(path.read_text()[:20])
    assert store.load(key()) is None
