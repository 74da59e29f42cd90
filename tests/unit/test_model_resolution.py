"""Model names -> local directories: paths that do not exist, hub ids through the local hub cache
(a hub id once reached the chat-template reader as a relative path)."""

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


def test_the_kv_cache_argument_is_what_the_installed_transformers_takes_and_returns(tiny_model_dir):
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the GPU image has 5.17): the name
    read from the forward's signature is the output's field too, for the decoder (the learner's
    prompt-detached path) and the causal LM (the embedded engine)."""
    import torch

    from comap_async.models import kv_cache_argument, load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(tiny_model_dir)
    ids = torch.tensor([[1, 2, 3]])
    for module in (model.get_decoder(), model):
        name = kv_cache_argument(module)
        assert name in ("cache", "past_key_values")
        with torch.no_grad():
            first = module(input_ids=ids, use_cache=True)
            cache = getattr(first, name)
            assert cache is not None and cache.get_seq_length() == 3
            module(input_ids=torch.tensor([[4]]), use_cache=True, **{name: cache})
        assert cache.get_seq_length() == 4  # the cache passed under that name was the one extended

    class Renamed(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=False): ...

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False): ...

    assert kv_cache_argument(Renamed()) == "cache" and kv_cache_argument(Older()) == "past_key_values"
