"""``config.jsonl``: each learner start appends the config it trained with; tokens never reach the file."""

from __future__ import annotations

from comap_async.config import load_config
from comap_async.run_files import RUN_CONFIGS, append_run_config, read_run_configs


def test_each_start_appends_its_config_and_tokens_stay_out(tmp_path):
    assert read_run_configs(tmp_path) == []  # a run from before the file was written
    first = load_config(None, ["learner.lr=0.0003", "broker.http_token=s3cret-value"]).model_dump(mode="json")
    second = load_config(None, ["learner.demo_loss_share.go=0.2", "env.prompt_form=draft_turns"]).model_dump(
        mode="json"
    )
    append_run_config(tmp_path, first, step=0, phase="warmup")
    append_run_config(tmp_path, second, step=150, phase="coevolve")
    starts = read_run_configs(tmp_path)
    assert [(s["step"], s["phase"]) for s in starts] == [(0, "warmup"), (150, "coevolve")]
    assert starts[0]["config"]["learner"]["lr"] == 0.0003
    assert starts[1]["config"]["learner"]["demo_loss_share"] == {"go": 0.2}
    assert starts[0]["config"]["broker"]["http_token"] is True and starts[1]["config"]["broker"]["http_token"] is False
    assert "s3cret-value" not in (tmp_path / RUN_CONFIGS).read_text()
