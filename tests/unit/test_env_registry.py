"""The environment registry: names, import paths, splits as defaults, clear errors."""

from __future__ import annotations

import pytest

from comap_async.config import ConfigError, load_config
from comap_async.envs.registry import ENVS, EnvSpec, env_spec
from comap_async.prompts import ALFWORLD

TOY = "tests.fixtures.toy_env:TOY"


def test_built_ins_are_registered_by_name_and_others_by_import_path():
    assert list(ENVS) == ["alfworld", "scienceworld"]
    assert env_spec("alfworld").held_out_split == "valid_seen" and env_spec("scienceworld").held_out_split == "dev"
    toy = env_spec(TOY)
    assert toy.name == "toy" and toy.splits == ("train", "held_out") and TOY not in ENVS


def test_an_environment_config_takes_its_splits_from_the_entry():
    cfg = load_config(None, [f"env.name={TOY}"])
    assert (cfg.env.split, cfg.eval.split) == ("train", "held_out")
    with pytest.raises(ConfigError, match=r"env.split='valid_seen' is not a split of tests.fixtures.toy_env:TOY"):
        load_config(None, [f"env.name={TOY}", "env.split=valid_seen"])


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("webshop", "unknown environment 'webshop'; known: alfworld, scienceworld"),
        ("no_such_module:SPEC", "environment 'no_such_module:SPEC': cannot import it"),
        ("comap_async.prompts:ALFWORLD", "is a Wording, not an EnvSpec"),
    ],
)
def test_a_name_that_is_no_environment_is_one_clear_line(name, message):
    with pytest.raises(ValueError, match=message):
        env_spec(name)
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"env.name={name}"])


def test_an_entry_whose_default_splits_are_not_its_own_is_refused():
    with pytest.raises(ValueError, match="must be among"):
        EnvSpec(
            name="x",
            env="m:E",
            games="m:g",
            facts="m",
            splits=("a",),
            train_split="a",
            held_out_split="b",
            wording=ALFWORLD,
        )
