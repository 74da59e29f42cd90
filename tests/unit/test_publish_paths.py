"""Publishing sends absolute adapter paths, even from a relative run directory."""

from __future__ import annotations

import os

from comap_async.config import load_config
from learner.publish import publish_adapters
from tests.fixtures.learner import QuietLog, RecordingEndpoint, make_trainer


async def test_relative_run_dir_publishes_absolute_paths(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["run.root=runs", "run.name=x"])
    assert cfg.adapter_root.is_absolute() and cfg.adapter_root == (tmp_path / "runs" / "x" / "adapters")
    trainer = make_trainer(tiny_model_dir)
    rec = RecordingEndpoint()
    await publish_adapters(
        trainer.model,
        1,
        "coevolve",
        5,
        root=cfg.adapter_root,
        inference=rec,
        endpoints=["http://e"],
        broker=rec,
        log=QuietLog(),
    )
    assert [n for n, _, _ in rec.loads] == ["policy-v1", "wm-v1", "wm_teacher-v1"]
    for _, path, inplace in rec.loads:
        assert os.path.isabs(path) and os.path.isfile(os.path.join(path, "adapter_model.safetensors"))
        assert not inplace  # a new version is an ordinary load under its new name (vLLM #33791)


async def test_every_published_version_records_its_ablation(tiny_model_dir, tmp_path):
    """Issue 17: a saved version says what produced it (``comap.json`` beside peft's files)."""
    import json

    from comap_async.run_files import VERSION_META

    trainer = make_trainer(tiny_model_dir)
    rec = RecordingEndpoint()
    for version, ablation in ((1, None), (2, ["frozen_wm"])):
        await publish_adapters(
            trainer.model,
            version,
            "coevolve",
            5 * version,
            root=tmp_path,
            inference=rec,
            endpoints=["http://e"],
            broker=rec,
            log=QuietLog(),
            ablation=ablation,
        )
        for role in ("policy", "wm", "wm_teacher"):
            meta = json.loads((tmp_path / f"{role}-v{version}" / VERSION_META).read_text())
            assert meta == {"version": version, "phase": "coevolve", "step": 5 * version, "ablation": ablation or []}
    assert json.loads((tmp_path / "latest.json").read_text())["ablation"] == ["frozen_wm"]


class Forgetful(RecordingEndpoint):
    """Answers every load with success but lists none of them (an adapter never delivered)."""

    async def models(self, endpoint=None):
        return ["base"]


async def test_a_load_the_endpoint_does_not_list_fails_the_publish_loudly(tmp_path):
    import pytest

    from learner.publish import PublishError, load_everywhere

    rec = Forgetful()
    with pytest.raises(PublishError, match="does not list it"):
        await load_everywhere(rec, ["http://e"], "policy-v3", tmp_path, retries=1, log=QuietLog())
    # the retry replaces in place (the first attempt may have landed); the first never does
    assert [inplace for _, _, inplace in rec.loads] == [False, True]
    rec = RecordingEndpoint()
    await load_everywhere(rec, ["http://e"], "policy-v3", tmp_path, retries=1, log=QuietLog(), inplace=True)
    assert rec.loads == [("policy-v3", str(tmp_path), True)]  # a restarted learner's reload of a live name
