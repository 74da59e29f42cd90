"""Model names -> local directories: paths that do not exist, hub ids through the local hub cache
(issue 27: a hub id used to reach the chat-template reader as a relative path)."""

from __future__ import annotations

import shutil

import pytest

from comap_async.models import ModelError, hub_snapshot, resolve_model
from comap_async.prompts import ChatTemplate, DecisionTokens


def test_a_missing_directory_is_named_as_one(tmp_path):
    for name in (str(tmp_path / "nope"), "./nope/model", "~/no/such/model"):
        with pytest.raises(ModelError, match="does not exist"):
            resolve_model(name, tmp_path)
    with pytest.raises(ModelError, match="unknown model"):
        resolve_model("qwen3", tmp_path)


def test_a_hub_id_resolves_to_its_cached_snapshot(tmp_path, tiny_model_dir):
    cache = tmp_path / "hub"
    snap = cache / "models--org--tiny" / "snapshots" / "0123abc"
    shutil.copytree(tiny_model_dir, snap)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("0123abc")
    path = hub_snapshot("org/tiny", cache_dir=cache)
    assert path == str(snap)
    ChatTemplate.from_model_dir(path)  # what actors, evaluator and learner read from it
    DecisionTokens.from_model_dir(path)
    with pytest.raises(ModelError, match="not in the Hugging Face cache.*huggingface-cli download org/other"):
        hub_snapshot("org/other", cache_dir=cache)
