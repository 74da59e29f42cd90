"""Readable configuration errors; every field documented."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from comap_async.config import CoMapConfig, ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_are_valid(name):
    load_config(CONFIGS / name)


def test_misspelled_field_names_file_field_and_suggestion(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump({"broker": {"max_stalenes": 3}}))
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    msg = str(exc.value)
    assert str(f) in msg and "broker.max_stalenes" in msg and "unknown field" in msg
    assert "did you mean 'max_staleness'" in msg


def test_a_removed_field_is_one_line_naming_its_replacement(tmp_path, monkeypatch):
    """Every entry of ``REMOVED_FIELDS`` (and one put there for the test): a config or an override that
    names it is refused with the line saying what replaced it, not "unknown field"."""
    from comap_async import config

    monkeypatch.setitem(config.REMOVED_FIELDS, "broker.old_knob", "the broker decides this itself now")
    for dotted, replacement in config.REMOVED_FIELDS.items():
        section, _, key = dotted.partition(".")
        f = tmp_path / "old.yaml"
        f.write_text(yaml.safe_dump({section: {key: 1}} if key else {section: 1}))  # a top-level key has no dot
        with pytest.raises(ConfigError) as exc:
            load_config(f)
        assert str(exc.value) == f"{f}: {dotted}: removed: {replacement}"
        with pytest.raises(ConfigError, match=f"{dotted}: removed: "):
            load_config(None, [f"{dotted}=1"])


def test_the_gates_section_written_the_old_way_gets_a_line_per_threshold(tmp_path):
    """``gates:`` went into ``method``: each of its thresholds is named with its new place."""
    f = tmp_path / "old.yaml"
    f.write_text("gates:\n  tau_p: 0.7\n  tau_ws: 0.8\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    assert str(exc.value).splitlines() == [
        f"{f}: gates.tau_p: removed: now method.tau_p",
        f"{f}: gates.tau_ws: removed: now method.tau_ws",
    ]
    assert load_config(None, ["method.tau_p=0.7"]).method.tau_p == 0.7


def test_a_flat_phase_setting_names_its_section_in_one_line(tmp_path):
    """The per-phase settings moved into ``learner.phases.<phase>``: an old config's flat name gets the
    line naming the new one, and ``--set`` reaches a setting three levels down."""
    f = tmp_path / "old.yaml"
    f.write_text("learner:\n  warmup_steps: 180\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    assert str(exc.value) == f"{f}: learner.warmup_steps: removed: now learner.phases.warmup.steps"
    cfg = load_config(None, ["learner.phases.warmup.steps=180", "learner.phases.coevolve.lr=1e-4"])
    assert cfg.learner.phases.warmup.steps == 180 and cfg.learner.phases.coevolve.lr == 1e-4
    assert cfg.learner.phases.reflect_init.steps == 100  # a sibling keeps its default


def test_out_of_range_threshold(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("method:\n  tau_q: 1.7\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: method.tau_q: .*less than or equal to 1"):
        load_config(f)


def test_invariant_capacity_vs_batch_size():
    with pytest.raises(ConfigError, match=r"broker.capacity \(4\) must be larger than learner.batch_size \(8\)"):
        load_config(None, ["broker.capacity=4", "learner.batch_size=8"])


def test_invariant_non_loopback_needs_curve():
    with pytest.raises(ConfigError, match="broker.curve"):
        load_config(None, ["broker.host=0.0.0.0", "broker.http_token=x"])
    cfg = load_config(None, ["broker.host=0.0.0.0", "broker.curve=true", "broker.http_token=x"])
    assert cfg.broker.curve


def test_port_clash_is_reported():
    with pytest.raises(ConfigError, match="each listener needs its own port"):
        load_config(None, ["broker.actor_port=9000", "broker.learner_port=9000"])


def test_overrides_parse_yaml_values():
    cfg = load_config(CONFIGS / "test.yaml", ["env.tasks=[look_at_obj_in_light]", "learner.lr=3e-4", "run.name=x"])
    assert cfg.env.tasks == ["look_at_obj_in_light"] and cfg.learner.lr == 3e-4 and cfg.run.name == "x"


@pytest.mark.parametrize("bad", ["novalue", "=3", "a.b=[unclosed"])
def test_bad_override_is_clear(bad):
    with pytest.raises(ConfigError, match="--set"):
        load_config(None, [bad])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(f)
    f.write_text("broker: {host: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)


def test_every_field_has_a_docstring():
    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no docstring"
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, f"{prefix}{name}.")

    walk(CoMapConfig)


def test_eval_method_is_validated():
    assert load_config(None, ["eval.method=react"]).eval.method == "react"
    with pytest.raises(ValueError, match="eval.method"):
        load_config(None, ["eval.method=reflexion"])


def test_handcoded_demonstrations_are_recorded_and_need_alfworld():
    on = load_config(None, ["actor.demonstrations=handcoded"])
    assert "handcoded_demos" in on.method_switches and "handcoded_demos" not in load_config(None).method_switches
    with pytest.raises(ConfigError, match="handcoded needs ALFWorld"):
        load_config(None, ["env.name=scienceworld", "env.split=dev", "actor.demonstrations=handcoded"])


def test_admissible_choice_is_recorded_and_keys_a_compared_row_only_when_on():
    from evaluator.compare_cells import cell_key

    off, on = load_config(None), load_config(None, ["actor.admissible_choice=true"])
    assert "admissible_choice" in on.method_switches and "admissible_choice" not in off.method_switches
    key_off = cell_key(off, "src", 7, "draft_only", "valid_seen", [])
    assert "admissible_choice" not in key_off["settings"]["actor"]  # rows stored before the switch keep their keys
    assert cell_key(on, "src", 7, "draft_only", "valid_seen", []) != key_off


def test_extends_merges_sections_key_by_key(tmp_path):
    (tmp_path / "base.yaml").write_text("learner:\n  lr: 0.001\n  batch_size: 4\nenv:\n  tasks: [a, b]\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nlearner:\n  lr: 0.0002\nenv:\n  tasks: [c]\n")
    cfg = load_config(tmp_path / "child.yaml", ["learner.batch_size=2"])
    assert cfg.learner.lr == 2e-4  # the child's value
    assert cfg.learner.batch_size == 2  # the base's, then the override's
    assert cfg.env.tasks == ["c"]  # a list replaces, never appends


def test_extends_chain_and_relative_path(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.yaml").write_text("learner:\n  lr: 0.001\n  batch_size: 4\n")
    (tmp_path / "sub" / "b.yaml").write_text("extends: ../a.yaml\nlearner:\n  batch_size: 3\n")
    (tmp_path / "sub" / "c.yaml").write_text("extends: b.yaml\nlearner:\n  lr: 0.0005\n")
    cfg = load_config(tmp_path / "sub" / "c.yaml")
    assert (cfg.learner.lr, cfg.learner.batch_size) == (5e-4, 3)


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({"c.yaml": "extends: missing.yaml\n"}, r"c.yaml <- .*missing.yaml: config file not found"),
        ({"c.yaml": "extends: d.yaml\n", "d.yaml": "extends: c.yaml\n"}, "loops back"),
        ({"c.yaml": "extends: [a.yaml]\n"}, "extends: expected a file name"),
        ({"c.yaml": "extends: d.yaml\n", "d.yaml": "- 1\n"}, "top level must be a mapping"),
    ],
)
def test_extends_errors_are_one_line(tmp_path, files, match):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=match) as exc:
        load_config(tmp_path / "c.yaml")
    assert "\n" not in str(exc.value)


def test_quick_profile_is_the_default_with_short_phases():
    local, quick = load_config(CONFIGS / "local.yaml"), load_config(CONFIGS / "local-quick.yaml")
    quick_phases, local_phases = quick.learner.phases, local.learner.phases
    assert quick_phases.warmup.max_minutes + quick_phases.reflect_init.max_minutes < 10
    assert quick_phases.warmup.min_samples < local_phases.warmup.min_samples
    # everything else the CPU default decides is inherited, not restated
    assert quick.model == local.model and quick.inference == local.inference and quick.method == local.method
    assert quick.env == local.env and quick.learner.lr == local.learner.lr
