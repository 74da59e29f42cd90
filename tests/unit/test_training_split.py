"""Training must never read an evaluation split: the processes that train or make training data refuse
a config whose ``env.split`` is one of the environment's evaluation splits or ``eval.split``, in one
line; the evaluation commands, which name their split themselves, load the same configs unrefused."""

from __future__ import annotations

from pathlib import Path

import pytest

from comap_async.config import ConfigError, load_config
from comap_async.envs.registry import ENVS, EnvSpec, env_spec
from comap_async.prompts import ALFWORLD

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TOY = "tests.fixtures.toy_env:TOY"


def refusal(path: Path | None, *overrides: str) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(path, list(overrides), training=True)
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def test_the_evaluation_splits_are_every_held_out_split_of_the_built_ins():
    assert env_spec("alfworld").eval_splits == ("valid_seen", "valid_unseen", "valid_train")
    assert env_spec("scienceworld").eval_splits == ("dev", "test")
    for spec in ENVS.values():
        assert spec.held_out_split in spec.eval_splits and spec.train_split not in spec.eval_splits


def test_an_entry_holds_out_every_split_but_train_unless_it_names_its_evaluation_splits():
    assert env_spec(TOY).eval_splits == ("held_out",)
    entry = dict(env="m:E", games="m:g", facts="m", wording=ALFWORLD, train_split="train", held_out_split="dev")
    with pytest.raises(ValueError, match="evaluation splits must be among"):
        EnvSpec(name="x", splits=("train", "dev"), eval_splits=("train", "dev"), **entry)
    with pytest.raises(ValueError, match="held-out split must be one of its evaluation splits"):
        EnvSpec(name="x", splits=("train", "dev", "test"), eval_splits=("test",), **entry)


def test_valid_seen_is_refused_in_one_line_naming_env_split_and_the_rule():
    message = refusal(CONFIGS / "local.yaml", "env.split=valid_seen")
    assert message == (
        f"{CONFIGS / 'local.yaml'} (with --set): env.split='valid_seen' is an evaluation split of alfworld "
        "(valid_seen, valid_unseen, valid_train): training must never read an evaluation split; train on 'train'"
    )


@pytest.mark.parametrize(
    ("env", "split"),
    [(name, split) for name in ENVS for split in ENVS[name].eval_splits] + [(TOY, "held_out")],
)
def test_every_evaluation_split_is_refused_for_training(env, split):
    assert f"env.split={split!r} is an evaluation split of {env}" in refusal(
        None, f"env.name={env}", f"env.split={split}"
    )


def test_training_on_the_split_it_is_evaluated_on_is_refused():
    message = refusal(None, "eval.split=train")
    assert message == (
        "<defaults> (with --set): env.split='train' is also eval.split: training must never read the split "
        "it is evaluated on; train on 'train' or evaluate another split"
    )


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_trains_on_a_training_split(name):
    cfg = load_config(CONFIGS / name, training=True)
    assert cfg.env.split not in env_spec(cfg.env.name).eval_splits and cfg.env.split != cfg.eval.split


def test_an_evaluation_command_loads_a_config_whatever_its_env_split():
    # `comap eval --split valid_seen` plays the split it names; env.split is what the actors train on
    cfg = load_config(CONFIGS / "local.yaml", ["env.split=valid_seen"])
    assert cfg.env.split == cfg.eval.split == "valid_seen"
    assert load_config(None, ["env.name=scienceworld", "env.split=dev"]).env.split == "dev"


class Loaded(Exception):
    """Raised by the stand-in ``load_config``: the command has said how it loads its config."""


@pytest.mark.parametrize(
    ("argv", "training"),
    [
        (["learner"], True),
        (["actor"], True),
        (["broker"], True),
        (["fork", "src", "--name", "f"], True),
        (["eval", "--split", "valid_seen", "--out", "OUT"], False),
        (["evaluator", "--once"], False),
        (["compare", "RUN", "--split", "valid_seen", "--out", "OUT"], False),
    ],
)
def test_the_training_processes_check_the_split_and_the_evaluation_commands_do_not(
    argv, training, monkeypatch, tmp_path
):
    import importlib

    import comap_async.config
    from comap_async.cli import build_parser

    calls: list[bool] = []

    def load(path=None, overrides=(), *, training=False):
        calls.append(training)
        raise Loaded

    monkeypatch.setattr(comap_async.config, "load_config", load)
    args = build_parser(argv[0]).parse_args([a.replace("OUT", str(tmp_path / "out")) for a in argv])
    with pytest.raises(Loaded):
        importlib.import_module(args._module).run(args)
    assert calls == [training]
