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
        # a new version is an ordinary load under its new name (vLLM re-reads an in-place adapter every step)
        assert not inplace


async def test_every_published_version_records_its_ablation(tiny_model_dir, tmp_path):
    """A saved version says what produced it (``comap.json`` beside peft's files)."""
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


async def test_a_server_restarted_between_two_loads_gets_the_version_again_before_the_announce(
    tiny_model_dir, tmp_path
):
    """A server that restarts after the first role's load comes back without it: the publish finds it
    unlisted just before the announce and loads it again, so the version is announced only when the
    endpoint lists all three."""
    trainer = make_trainer(tiny_model_dir)

    class Restarting(RecordingEndpoint):
        def __init__(self):
            super().__init__()
            self.served: set[str] = set()
            self.listed_at_announce: set[str] | None = None

        async def load_adapter(self, name, path, load_inplace=False, endpoint=None, retry=None):
            await super().load_adapter(name, path, load_inplace, endpoint, retry)
            self.served.add(name)
            if len(self.loads) == 2:  # killed and restarted by its supervisor: serves nothing
                self.served.clear()

        async def models(self, endpoint=None):
            return sorted(self.served)

        async def announce(self, **kw):
            self.listed_at_announce = set(self.served)
            return kw

    rec = Restarting()
    await publish_adapters(
        trainer.model,
        4,
        "coevolve",
        8,
        root=tmp_path,
        inference=rec,
        endpoints=["http://e"],
        broker=rec,
        log=QuietLog(),
    )
    names = {"policy-v4", "wm-v4", "wm_teacher-v4"}
    assert rec.listed_at_announce == names
    loads = [n for n, _, _ in rec.loads]
    assert loads.count("policy-v4") == 2 and loads[-1] == "policy-v4"  # the role lost before the others loaded


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
    # the endpoint never listed it: each attempt is an ordinary load, none in place
    assert [inplace for _, _, inplace in rec.loads] == [False, False]


class ListingServer:
    """An inference server as the learner sees it: it lists what it serves, refuses an ordinary load
    of a name it already serves (as vLLM and the embedded server do) and records every load and unload.
    ``lose_answers``: that many loads land but their answers are lost (the client sees an error)."""

    def __init__(self, served=(), lose_answers=0):
        self.served = dict.fromkeys(served, "earlier")
        self.loads, self.unloads, self.lose_answers = [], [], lose_answers

    async def models(self, endpoint=None):
        return ["base", *self.served]

    async def load_adapter(self, name, path, load_inplace=False, endpoint=None, retry=None):
        self.loads.append((name, path, load_inplace))
        if name in self.served and not load_inplace:
            raise RuntimeError(f"HTTP 400: the lora adapter '{name}' has already been loaded")
        self.served[name] = path
        if self.lose_answers:
            self.lose_answers -= 1
            raise RuntimeError("connection reset: the answer was lost")

    async def unload_adapter(self, name, missing_ok=False, endpoint=None, retry=None):
        self.unloads.append(name)
        self.served.pop(name, None)


async def test_a_retry_after_a_load_that_landed_does_not_load_it_again(tmp_path):
    from learner.publish import load_everywhere

    server = ListingServer(lose_answers=1)
    await load_everywhere(server, ["http://e"], "policy-v3", tmp_path, retries=2, log=QuietLog())
    assert server.loads == [("policy-v3", str(tmp_path), False)]  # the retry saw it listed: no second load
    assert server.served["policy-v3"] == str(tmp_path) and server.unloads == []


async def test_a_new_version_left_listed_by_an_unannounced_publish_is_replaced_without_an_in_place_load(tmp_path):
    """The learner died between loading v3 and announcing it, and numbers its next version 3 again:
    the server still serves the old v3 from files saved over since."""
    from learner.publish import load_everywhere

    server = ListingServer(served=["policy-v3"])
    await load_everywhere(server, ["http://e"], "policy-v3", tmp_path, retries=1, log=QuietLog())
    assert server.unloads == ["policy-v3"]
    assert server.loads == [("policy-v3", str(tmp_path), False)] and server.served["policy-v3"] == str(tmp_path)


async def test_a_restarted_learner_reloads_only_what_a_server_does_not_list_and_never_in_place(tmp_path):
    from types import SimpleNamespace

    from comap_async.config import load_config
    from learner.loop import Learner

    cfg = load_config(None, ['inference.endpoints=["http://kept","http://restarted"]'])
    registry = {"adapters": {"policy": "policy-v7", "wm": "wm-v7", "wm_teacher": "wm_teacher-v7"}}
    for name in registry["adapters"].values():
        (tmp_path / name).mkdir()
    kept = ListingServer(served=registry["adapters"].values())  # a server that outlived the learner
    restarted = ListingServer()
    servers = {"http://kept": kept, "http://restarted": restarted}

    class Both:  # the learner's client: each call goes to the endpoint it names
        async def models(self, endpoint=None):
            return await servers[endpoint].models()

        async def load_adapter(self, name, path, load_inplace=False, endpoint=None, retry=None):
            await servers[endpoint].load_adapter(name, path, load_inplace)

        async def unload_adapter(self, name, missing_ok=False, endpoint=None, retry=None):
            await servers[endpoint].unload_adapter(name, missing_ok)

    learner = SimpleNamespace(cfg=cfg, adapter_root=tmp_path, log=QuietLog())
    await Learner.reload_live_adapters(learner, Both(), registry)
    assert kept.loads == [] and kept.unloads == []  # vLLM re-reads an in-place adapter every step: none here
    names = list(registry["adapters"].values())
    assert restarted.loads == [(n, str(tmp_path / n), False) for n in names] and restarted.unloads == []


async def test_a_server_restarted_alone_gets_the_live_adapters_back_from_the_running_learner(tmp_path, monkeypatch):
    """A server killed and restarted by its supervisor comes back serving no adapter: the learner,
    still running, loads the registry's again (not in place) instead of leaving every actor request
    to fail (404) until its next publish."""
    import asyncio
    import functools
    from types import SimpleNamespace

    from learner import loop

    monkeypatch.setattr(loop, "LIVE_CHECK_S", 0.01)
    registry = {"adapters": {"policy": "policy-v7", "wm": "wm-v7", "wm_teacher": "wm_teacher-v7"}}
    names = list(registry["adapters"].values())
    for name in names:
        (tmp_path / name).mkdir()

    class Restartable(ListingServer):
        down = False

        async def models(self, endpoint=None):
            if self.down:
                raise ConnectionError("connection refused")
            return await super().models()

    server = Restartable(served=names)
    cfg = load_config(None, ['inference.endpoints=["http://e"]'])
    learner = SimpleNamespace(
        cfg=cfg, adapter_root=tmp_path, log=QuietLog(), live=registry, _publishing=asyncio.Lock(), stop=asyncio.Event()
    )
    learner.reload_live_adapters = functools.partial(loop.Learner.reload_live_adapters, learner)
    watcher = asyncio.create_task(loop.Learner.keep_live_adapters_served(learner, server))
    try:
        await asyncio.sleep(0.1)
        assert server.loads == []  # served all along: nothing loaded
        server.down = True  # killed...
        server.served.clear()
        await asyncio.sleep(0.1)  # (checks fail meanwhile and are tried again)
        server.down = False  # ...and back, with no adapter
        for _ in range(200):
            if len(server.loads) == len(names):
                break
            await asyncio.sleep(0.01)
    finally:
        learner.stop.set()
        watcher.cancel()
    assert server.loads == [(n, str(tmp_path / n), False) for n in names]
    assert set(names) <= set(server.served)
