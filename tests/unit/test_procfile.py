"""``comap procfile``: the Procfile of a 1-GPU and a 4-GPU host from the config's
device plan, and the vLLM command each inference line starts."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from comap_async.commands.procfile import plan, render
from comap_async.config import SHARED_GPU_MEMORY, ConfigError, load_config
from comap_async.inference import vllm

REPO = Path(__file__).resolve().parents[2]
QWEN = str(REPO / "configs" / "alfworld-qwen3-4b.yaml")


def lines(*overrides: str) -> dict[str, tuple[dict[str, str], list[str]]]:
    """name -> (environment assignments, argv) of each Procfile line."""
    cfg = load_config(QWEN, list(overrides))
    out = {}
    for line in render(plan(cfg), QWEN, list(overrides)).splitlines():
        name, rest = line.split(": ", 1)
        words = shlex.split(rest)
        env = dict(w.split("=", 1) for w in words[: words.index("exec")])
        out[name] = (env, words[words.index("exec") + 1 :])
    return out


def sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, w in enumerate(argv) if w == "--set"]


def vllm_argv(line: tuple[dict[str, str], list[str]]) -> list[str]:
    """The vLLM command ``comap serve --backend vllm`` would exec for one Procfile line (its
    ``CUDA_VISIBLE_DEVICES`` tells the server its GPUs)."""
    env, argv = line
    cfg = load_config(QWEN, sets(argv))
    return vllm.build_command(cfg, "/models/qwen3-4b", "/venv/bin/python", gpus=vllm.visible_gpus(env))[0]


def test_one_gpu_host_shares_the_card_between_vllm_and_the_learner():
    procs = lines("inference.gpus=[0]", "learner.gpus=[0]")
    assert list(procs) == ["broker", "inference0", "learner", "actor", "evaluator"]
    assert procs["inference0"][0]["CUDA_VISIBLE_DEVICES"] == "0" == procs["learner"][0]["CUDA_VISIBLE_DEVICES"]
    for name in ("broker", "actor", "evaluator"):
        assert procs[name][0]["CUDA_VISIBLE_DEVICES"] == ""  # no process takes a GPU it was not given
    argv = vllm_argv(procs["inference0"])
    assert argv[argv.index("--port") + 1] == "8000"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == str(SHARED_GPU_MEMORY)
    assert procs["inference0"][1][:4] == ["comap", "serve", "--backend", "vllm"]
    for name in ("learner", "actor", "evaluator"):
        cfg = load_config(QWEN, sets(procs[name][1]))
        assert cfg.inference.endpoints == ["http://127.0.0.1:8000"]


def test_four_gpu_host_three_servers_and_a_learner_of_its_own():
    procs = lines("inference.gpus=[0,1,2]", "learner.gpus=[3]")
    servers = [n for n in procs if n.startswith("inference")]
    assert servers == ["inference0", "inference1", "inference2"]
    for i, name in enumerate(servers):
        env, argv = procs[name]
        assert env["CUDA_VISIBLE_DEVICES"] == str(i)
        cmd = vllm_argv((env, argv))
        assert cmd[cmd.index("--port") + 1] == str(8000 + i)
        assert "--gpu-memory-utilization" not in cmd  # a card of its own: vLLM's default
        assert cmd[cmd.index("--max-loras") + 1] == "12" and cmd[cmd.index("--max-num-seqs") + 1] == "256"
    assert procs["learner"][0]["CUDA_VISIBLE_DEVICES"] == "3"
    expected = [f"http://127.0.0.1:{8000 + i}" for i in range(3)]
    for name in ("learner", "actor", "evaluator"):
        assert load_config(QWEN, sets(procs[name][1])).inference.endpoints == expected


def test_tensor_parallel_groups_the_gpus_of_one_server():
    procs = lines("inference.gpus=[0,1,2,3]", "inference.tensor_parallel=2", "learner.gpus=[3]")
    assert [procs[n][0]["CUDA_VISIBLE_DEVICES"] for n in ("inference0", "inference1")] == ["0,1", "2,3"]
    cmd = vllm_argv(procs["inference1"])
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == str(SHARED_GPU_MEMORY)  # shares GPU 3
    assert "--gpu-memory-utilization" not in vllm_argv(procs["inference0"])  # GPUs 0 and 1 are its own


def test_several_learner_gpus_are_torchrun_ranks():
    procs = lines("inference.gpus=[0,1]", "learner.gpus=[2,3]")
    env, argv = procs["learner"]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert argv[:6] == ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "comap_async"]
    assert argv[6] == "learner"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["inference.gpus=[]"], "inference.gpus is empty"),
        (["inference.gpus=[0,0]"], "twice"),
        (["inference.gpus=[0,1,2]", "inference.tensor_parallel=2"], "not a multiple"),
        (["inference.gpus=[0]", "inference.backend=embedded"], "inference.backend: vllm"),
        (["inference.gpus=[0]", "learner.gpus=[1]", "learner.device=cpu"], "learner.device: cuda"),
    ],
)
def test_a_plan_that_cannot_run_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan(load_config(QWEN, overrides))


def test_the_command_prints_it_or_one_error_line():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "comap_async",
            "procfile",
            "--config",
            QWEN,
            "--set",
            "inference.gpus=[0,1,2]",
            "--set",
            "learner.gpus=[3]",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") == 7 and "inference2: CUDA_VISIBLE_DEVICES=2" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "comap_async", "procfile", "--config", QWEN, "--set", "inference.gpus=[]"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "inference.gpus is empty" in out.stderr
