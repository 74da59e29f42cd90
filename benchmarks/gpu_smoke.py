#!/usr/bin/env python3
"""Is the GPU path whole on this host? One command, a few minutes, nothing downloaded.

    python3 benchmarks/gpu_smoke.py                # on a GPU host
    python3 benchmarks/gpu_smoke.py --device cpu   # the same flow on a CPU (a dry run of the script)

1. The environment: python, torch and its CUDA, the device, the NVIDIA driver (``nvidia-smi``),
   transformers and peft, and whether vLLM imports (in the interpreter ``comap serve --backend vllm``
   would use: ``$COMAP_VLLM_PYTHON``, else this one).
2. ``python3 -m pytest -q tests/gpu`` (on a CPU its tests skip themselves).
3. A whole system on the tiny model (``comap model prepare --tiny``: built here, not downloaded) and
   the toy environment (``tests.fixtures.toy_env:TOY``, a row of rooms, no game files): broker, inference
   server, learner (``learner.device`` as ``--device``), one actor, each its own process as the Procfile
   starts them. The server is vLLM where it imports and the embedded server otherwise (``--backend``);
   with vLLM the learner and the server share card 0 (vLLM's share of it, and the learner waiting for its
   health, as ``comap procfile`` sets them up). It waits for the learner's first publish, for the server to
   list the published policy (the publish delivered), and for an episode the actor played on that version
   (the broker's ``/records``), then stops every process.

Last line: ``gpu_smoke=ok ...`` with the timings, or ``gpu_smoke=failed: <reason>`` (exit status 1).
Each process's log is kept under ``--workdir`` (default: a new temporary directory) for a failure's reading.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOY = "tests.fixtures.toy_env:TOY"


class Failed(RuntimeError):
    """A step of the smoke test failed: ``reason`` goes on the last line, ``detail`` (logs) before it."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_version(timeout: float = 180.0) -> tuple[str | None, str]:
    """(vLLM's version where it imports, else None; why not). Imported in a child: a broken vLLM
    install may hang or kill the interpreter, and importing it here would load CUDA before the test
    processes do."""
    try:
        from comap_async.inference.vllm import find_vllm_python

        python = find_vllm_python()
    except FileNotFoundError as exc:
        return None, str(exc).split(":")[0]
    try:
        out = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None, f"`import vllm` took over {timeout:.0f} s"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"`import vllm` failed: {last}"
    return out.stdout.strip().splitlines()[-1], python


def environment(device: str) -> dict[str, Any]:
    """What the GPU path depends on, printed one ``key=value`` a line."""
    import peft
    import torch
    import transformers

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }
    if torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
        env["device_count"] = torch.cuda.device_count()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        env["bf16"] = torch.cuda.is_bf16_supported()
        env["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        env["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "?"
    else:
        env["driver"] = "no nvidia-smi"
    version, where = vllm_version()
    env["vllm"] = version or f"no ({where})"
    for key, value in env.items():
        print(f"env {key}={value}", flush=True)
    if device == "cuda" and not torch.cuda.is_available():
        raise Failed(f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}); a dry run: --device cpu")
    return env


def gpu_tests(timeout: float) -> str:
    """``pytest -q tests/gpu``: its summary line; a failure raises."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise Failed(f"tests/gpu ran over {timeout:.0f} s") from None
    lines = [x for x in out.stdout.strip().splitlines() if x.strip()]
    summary = lines[-1] if lines else "no output"
    if out.returncode not in (0, 5):  # 5: nothing collected
        raise Failed(f"tests/gpu: {summary}", out.stdout[-4000:] + out.stderr[-2000:])
    return summary


class System:
    """broker, server, learner and actor, each its own process (as the Procfile starts them)."""

    def __init__(self, work: Path, model_dir: str, device: str, backend: str) -> None:
        self.work, self.backend = work, backend
        self.port, self.http = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        overrides = [
            f"run.root={work / 'runs'}",
            "run.name=gpu-smoke",
            f"model.name_or_path={model_dir}",
            f"env.name={TOY}",
            "env.max_steps=6",
            f"broker.actor_port={free_port()}",
            f"broker.learner_port={free_port()}",
            f"broker.http_port={self.http}",
            f"inference.backend={backend}",
            f"inference.port={self.port}",
            f"inference.endpoints=['{self.url}']",
            "actor.envs=2",
            f"learner.device={device}",
            # the shortest warm-up that publishes: its first publish ends it, then co-evolution plays on it
            "learner.phases.warmup.steps=2",
            "learner.phases.warmup.min_samples=4",
            "learner.publish_every=2",
            "learner.checkpoint_every=1000",
            "method.ablation=no_reflect_init",
            "broker.max_staleness=100",
        ]
        if backend == "vllm":  # one card shared as the GPU configs share it: vLLM's share, the learner waits
            overrides += ["inference.gpus=[0]", "learner.gpus=[0]", "model.dtype=bfloat16"]
        self.args = ["--config", str(ROOT / "configs" / "test.yaml")] + [a for o in overrides for a in ("--set", o)]
        self.env = {**os.environ, "COMAP_LOG_JSON": "1", "PYTHONUNBUFFERED": "1"}
        self.env.pop("COMAP_CONFIG", None)
        self.env.pop("COMAP_OVERRIDES", None)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(self, role: str) -> None:
        self.logs[role] = self.work / f"{role}.log"
        with open(self.logs[role], "wb") as log:
            self.procs[role] = subprocess.Popen(
                [sys.executable, "-m", "comap_async", role, *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=ROOT,
                start_new_session=True,  # its own process group: vLLM's children stop with it
            )

    def stop_all(self, timeout: float = 60.0) -> dict[str, int | None]:
        """SIGTERM to every process group (the actor first: it flushes to the broker), SIGKILL after ``timeout``."""
        codes: dict[str, int | None] = {}
        for role in ("actor", "learner", "serve", "broker"):
            proc = self.procs.pop(role, None)
            if proc is None:
                continue
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                except ProcessLookupError:
                    pass
            codes[role] = proc.returncode
        return codes

    def tail(self, role: str, chars: int = 1500) -> str:
        path = self.logs.get(role)
        return path.read_text(errors="replace")[-chars:] if path and path.is_file() else ""

    def wait(self, what: str, cond: Any, deadline: float) -> Any:
        """Poll ``cond`` until it returns something true; a process that exits or the deadline fails it."""
        while time.monotonic() < deadline:
            for role, proc in self.procs.items():
                if proc.poll() is not None:
                    raise Failed(f"{role} exited ({proc.returncode}) while waiting for {what}", self.tail(role))
            try:
                value = cond()
            except OSError:  # not listening yet
                value = None
            if value:
                return value
            time.sleep(1.0)
        tails = "\n".join(f"--- {r}\n{self.tail(r, 800)}" for r in self.procs)
        raise Failed(f"timed out waiting for {what}", tails)

    def get(self, url: str) -> Any:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())

    def healthy(self) -> bool:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
            return r.status == 200

    def served(self) -> set[str]:
        return {m["id"] for m in self.get(self.url + "/v1/models")["data"]}

    def publishes(self) -> list[dict]:
        out = []
        for line in self.logs["learner"].read_text(errors="replace").splitlines():
            if '"publish.done"' in line:
                try:
                    out.append(json.loads(line[line.index("{") :]))
                except ValueError:
                    continue
        return out

    def episodes(self) -> list[dict]:
        return self.get(f"http://127.0.0.1:{self.http}/records?store=episodes&limit=200")["items"]


def run_system(work: Path, device: str, backend: str, model: str, timeout: float) -> dict[str, float]:
    from comap_async.models import resolve_model
    from comap_async.wire.messages import POLICY, adapter_family, adapter_name, adapter_version

    t0 = time.monotonic()
    deadline = t0 + timeout
    model_dir = resolve_model(model, "~/.cache/comap-async/models")  # tiny: built here (no download)
    system = System(work, model_dir, device, backend)
    times: dict[str, float] = {}
    try:
        system.start("broker")
        system.start("serve")
        system.wait(f"the {backend} server's health", system.healthy, deadline)
        times["server_ready_s"] = time.monotonic() - t0
        system.start("learner")
        system.start("actor")
        first = system.wait("the learner's first publish", system.publishes, deadline)[0]
        version = int(first["version"])
        times["publish_s"] = time.monotonic() - t0

        # the learner may publish again before the next poll and the server drop the older version:
        # any published policy from this version on shows the publish delivered
        def delivered() -> int | None:
            live = [adapter_version(m) for m in system.served() if adapter_family(m) == POLICY]
            return min((v for v in live if v >= version), default=None)

        version = system.wait(f"the server to list {adapter_name(POLICY, version)} or a later one", delivered, deadline)
        times["delivered_s"] = time.monotonic() - t0

        def on_version() -> list[dict]:
            return [e for e in system.episodes() if (e.get("policy_version") or 0) >= version]

        episode = system.wait(f"an episode played on {adapter_name(POLICY, version)} or later", on_version, deadline)[0]
        times["episode_s"] = time.monotonic() - t0
        print(
            f"system first_publish={first['version']} delivered={adapter_name(POLICY, version)} "
            f"publish_live_ms={first.get('publish_live_ms')} "
            f"episode phase={episode.get('phase')} policy_version={episode.get('policy_version')} "
            f"steps={episode.get('steps')} won={episode.get('won')}",
            flush=True,
        )
    finally:
        codes = system.stop_all()
        print(f"system stopped exit_codes={json.dumps(codes)} logs={work}", flush=True)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the learner's device")
    ap.add_argument("--backend", choices=("auto", "vllm", "embedded"), default="auto", help="auto: vLLM if it imports")
    ap.add_argument(
        "--model", default="tiny", help="tiny (built here), smollm2-135m-instruct (prepared) or a directory"
    )
    ap.add_argument("--skip-tests", action="store_true", help="leave out pytest tests/gpu")
    ap.add_argument("--tests-timeout", type=float, default=240.0)
    ap.add_argument("--system-timeout", type=float, default=300.0, help="seconds for the system's part")
    ap.add_argument("--workdir", type=Path, help="run directory and logs (default: a new temporary directory)")
    args = ap.parse_args()
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    try:
        env = environment(args.device)
        backend = args.backend
        if backend == "auto":
            backend = "vllm" if not env["vllm"].startswith("no") and args.device == "cuda" else "embedded"
        elif backend == "vllm" and env["vllm"].startswith("no"):
            raise Failed(f"--backend vllm: vLLM does not import ({env['vllm']})")
        why = "vLLM imports" if backend == "vllm" else "--backend" if args.backend != "auto" else f"vLLM {env['vllm']}"
        if backend == "embedded" and args.backend == "auto" and args.device == "cpu":
            why = "a dry run on the CPU"
        print(f"backend={backend} ({why}) device={args.device} model={args.model}", flush=True)
        timings["env_s"] = time.monotonic() - t0
        if not args.skip_tests:
            t = time.monotonic()
            summary = gpu_tests(args.tests_timeout)
            timings["tests_s"] = time.monotonic() - t
            print(f"tests/gpu: {summary}", flush=True)
        work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
        work.mkdir(parents=True, exist_ok=True)
        t = time.monotonic()
        times = run_system(work, args.device, backend, args.model, args.system_timeout)
        timings.update({f"system_{k}": v for k, v in times.items()})
        timings["system_s"] = time.monotonic() - t
    except Failed as exc:
        if exc.detail:
            print(exc.detail, flush=True)
        print(f"gpu_smoke=failed: {exc.reason}", flush=True)
        return 1
    except Exception as exc:  # an unexpected error is a failed smoke test too, said on the last line
        print(f"gpu_smoke=failed: {type(exc).__name__}: {exc}", flush=True)
        return 1
    timings["total_s"] = time.monotonic() - t0
    figures = " ".join(f"{k}={v:.1f}" for k, v in timings.items())
    print(f"gpu_smoke=ok backend={backend} device={args.device} {figures}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
