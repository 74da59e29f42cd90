"""The whole system on the vLLM backend: broker + vLLM + learner + one actor
with the default model, each its own process as the Procfile starts it. Opt-in (marker ``vllm``):
vLLM's CPU build in its own virtualenv (``COMAP_VLLM_PYTHON``, docs/inference.md).

What it shows: a warm-up publish reaches vLLM (loaded under its new name, announced), the actor's
next episode is played by vLLM with that version, and a learner stopped and started again reloads
the registry's adapters (never in place) and publishes the next version. Figures (publish-to-live, tokens/s
before and right after a publish) are printed and, with ``COMAP_E2E_FIGURES=path``, written as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.fixtures.broker import stored
from tests.fixtures.core import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.alfworld, pytest.mark.slow, pytest.mark.timeout(3000)]  # minutes on 2 cores
REPO = Path(__file__).resolve().parents[2]
PROMPT = "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a desk 1."


def _require_vllm() -> None:
    """Skip unless ``COMAP_VLLM_PYTHON`` names a vLLM virtualenv's python (the processes inherit it)."""
    if not os.environ.get("COMAP_VLLM_PYTHON"):
        pytest.skip("set COMAP_VLLM_PYTHON to a vLLM virtualenv's python (docs/inference.md)")


class Run:
    """One run's processes, started one by one (so the learner alone can be stopped and restarted)."""

    def __init__(self, tmp: Path, data: Path) -> None:
        self.tmp = tmp
        self.port, self.http = free_port(), free_port()
        overrides = [
            f"run.root={tmp / 'runs'}",
            "run.name=vllm-e2e",
            f"env.data_dir={data}",
            "env.max_steps=4",
            f"broker.actor_port={free_port()}",
            f"broker.learner_port={free_port()}",
            f"broker.http_port={self.http}",
            "inference.backend=vllm",
            f"inference.port={self.port}",
            f"inference.endpoints=['http://127.0.0.1:{self.port}']",
            "actor.envs=1",
            # a short warm-up: a publish after 2 steps, co-evolution after 4 (no reflection-mode init)
            "learner.phases.warmup.steps=4",
            "learner.phases.warmup.epochs=null",
            "learner.phases.warmup.min_samples=4",
            "learner.phases.warmup.publish_every=2",
            "learner.batch_size=1",
            "learner.max_seq_len=512",
            "learner.publish_every=2",
            "learner.checkpoint_every=1",
            "method.ablation=no_reflect_init",
            "broker.max_staleness=100",
        ]
        self.env = {
            **os.environ,
            "COMAP_CONFIG": "configs/local.yaml",
            "COMAP_OVERRIDES": " ".join(overrides),
            "COMAP_LOG_JSON": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(self, role: str, tag: str = "") -> None:
        self.logs[role] = self.tmp / f"{role}{tag}.log"
        self.procs[role] = subprocess.Popen(
            [sys.executable, "-m", "comap_async", role],
            stdout=open(self.logs[role], "wb"),
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=REPO,
            start_new_session=True,
        )

    def stop(self, role: str, timeout: float = 120) -> int:
        proc = self.procs.pop(role)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                return proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return -9
        return proc.returncode

    def stop_all(self) -> None:
        for role in list(self.procs):
            self.stop(role, 60)

    def events(self, role: str, name: str) -> list[dict]:
        out = []
        for line in self.logs[role].read_text(errors="replace").splitlines():
            if f'"{name}"' in line:
                try:
                    out.append(json.loads(line[line.index("{") :]))
                except ValueError:
                    continue
        return out

    def wait(self, what: str, cond, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for role, proc in self.procs.items():
                if proc.poll() is not None:
                    tail = self.logs[role].read_text(errors="replace")[-3000:]
                    raise AssertionError(f"{role} exited while waiting for {what}:\n{tail}")
            value = cond()
            if value:
                return value
            time.sleep(2)
        tails = {r: p.read_text(errors="replace")[-2000:] for r, p in self.logs.items()}
        raise AssertionError(f"timed out waiting for {what}: {tails}")

    def models(self) -> set[str]:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as r:
            return {m["id"] for m in json.loads(r.read())["data"]}

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def tokens_per_s(self, model: str, n: int = 4, max_tokens: int = 32) -> float:
        """``n`` concurrent greedy completions of ``max_tokens`` tokens: generated tokens per second."""

        def one(_: int) -> int:
            body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            req = urllib.request.Request(
                self.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=300) as r:
                return json.loads(r.read())["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            tokens = sum(pool.map(one, range(n)))
        return tokens / (time.perf_counter() - t0)

    def episodes(self) -> list[dict]:
        replay = self.tmp / "runs" / "vllm-e2e" / "replay"
        return stored(replay, "episodes") if replay.is_dir() else []


def test_the_system_runs_on_vllm_publishes_and_resumes(tmp_path, alfworld_data):
    from comap_async.models import DEFAULT_MODEL, ModelError, resolve_model

    _require_vllm()
    try:
        resolve_model(DEFAULT_MODEL, "~/.cache/comap-async/models")
    except ModelError as exc:
        pytest.skip(f"needs the default model: {exc}")
    run = Run(tmp_path, alfworld_data)
    figures: dict[str, float | int] = {}
    try:
        t0 = time.monotonic()
        run.start("serve")
        run.start("broker")
        run.wait("vLLM to answer", run.healthy, 900)
        figures["vllm_start_s"] = round(time.monotonic() - t0)
        base = next(iter(run.models()))
        figures["tokens_per_s_base"] = round(run.tokens_per_s(base), 2)
        run.start("learner")
        run.start("actor")

        # a warm-up publish: saved, loaded into vLLM under its new name, announced
        first = run.wait("a warm-up publish", lambda: [e for e in run.events("learner", "publish.done")], 1200)[0]
        assert first["phase"] == "warmup" and first["version"] == 1
        figures["publish_live_ms"] = first["publish_live_ms"]
        assert {"policy-v1", "wm-v1", "wm_teacher-v1"} <= run.models()
        # right after the publish, under the learner's and the actor's load: the new adapter against the
        # base model back to back (the figure before the publish was taken on an idle machine)
        figures["tokens_per_s_after_publish"] = round(run.tokens_per_s("policy-v1"), 2)
        figures["tokens_per_s_base_after_publish"] = round(run.tokens_per_s(base), 2)

        # co-evolution: the actor's next episode is played by vLLM with the newest warm-up version
        def coevolve_episode():
            return [e for e in run.episodes() if e["phase"] == "coevolve"]

        ep = run.wait("a co-evolution episode", coevolve_episode, 1800)[0]
        assert ep["policy_version"] >= first["version"] and ep["steps"] >= 1, ep

        # the learner stopped and started again: the registry's adapters reloaded (vLLM lists them), then a new version
        before = max(e["version"] for e in run.events("learner", "publish.done"))
        assert run.stop("learner") == 0
        run.start("learner", tag="-resumed")
        reloaded = run.wait(
            "the resumed learner's reload", lambda: run.events("learner", "learner.live_adapters_reloaded"), 600
        )[0]
        assert reloaded["adapters"]["policy"] == f"policy-v{before}"
        after = run.wait(
            "a publish after the resume",
            lambda: [e for e in run.events("learner", "publish.done") if e["version"] > before],
            1200,
        )[0]
        assert f"policy-v{after['version']}" in run.models()
        figures["publish_live_ms_resumed"] = after["publish_live_ms"]
        figures["wall_s"] = round(time.monotonic() - t0)
    finally:
        run.stop_all()
        print("vllm_e2e " + json.dumps(figures))
        if os.environ.get("COMAP_E2E_FIGURES"):
            Path(os.environ["COMAP_E2E_FIGURES"]).write_text(json.dumps(figures, indent=1) + "\n")
