"""``experiments/studies/learner_setting.py``: two learner settings train a policy on the same samples read from
a real LMDB replay (tiny model), warm-up SFT from the base model and reflection-mode initialisation
from the warm-up's adapter; each version is probed on real held-out games, ``--resume`` trains
nothing again, and a replay too small is refused in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.broker import write_records
from tests.fixtures.system import honcho_settings

pytestmark = [pytest.mark.alfworld, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def write_samples(path: Path, n: int) -> None:
    """``n`` demonstrations, ``n`` suffix-labelled reflection samples and one the action gate labelled."""
    state = "Task: put a mug in the fridge.\nCurrent observation: You see a mug {}."
    demos = [{"s": state.format(i), "target": "take mug 1"} for i in range(n)]
    refl = [
        {"s": state.format(i), "a_draft": "look", "s_bar": "Nothing happens.", "target": "take mug 1", "y": i % 2}
        for i in range(n + 1)
    ]
    for i, r in enumerate(refl):
        r["source"] = "suffix" if i < n else "gate"
    records = [("demos", f"d{i}".encode(), d) for i, d in enumerate(demos)]
    write_records(path, records + [("reflections", f"r{i}".encode(), r) for i, r in enumerate(refl)])


def test_two_settings_train_the_same_demos_and_are_probed(tmp_path, tiny_model_dir, alfworld_data):
    write_samples(tmp_path / "replay", 6)
    out = tmp_path / "sft"
    evals = sum((["--eval-set", s] for s in honcho_settings(tmp_path, tiny_model_dir, alfworld_data)), [])
    cmd = [sys.executable, "experiments/studies/learner_setting.py", "--replay", str(tmp_path / "replay")]
    cmd += ["--samples", "4"]
    cmd += ["--steps", "3", "--games", "1", "--model", str(tiny_model_dir), "--config", "configs/test.yaml"]
    cmd += ["--out", str(out), *evals]
    # a setting the config refuses: one line, before training
    refused = subprocess.run(
        [*cmd, "--variants", "lr=1e-4,lr=0"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert refused.returncode != 0 and "--variants lr=0: " in refused.stderr
    assert "Traceback" not in refused.stderr and not out.exists()
    cmd += ["--variants", "gradient_checkpointing=true,gradient_checkpointing=false+chunk_tokens=0"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    for variant in ("gradient_checkpointing-true", "gradient_checkpointing-false_chunk_tokens-0"):
        result = json.loads((out / variant / "result.json").read_text())
        assert result["samples"] == 3 * 2  # steps x configs/test.yaml's batch size
        assert result["states"] > 0 and 0 <= result["draft_accuracy"] <= 1
        assert (out / variant / "adapters" / "policy-v1" / "adapter_model.safetensors").exists()
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(
        "learner_setting gradient_checkpointing=true -> gradient_checkpointing=false+chunk_tokens=0: draft"
    )
    assert "speedup=" in last

    before = (out / "gradient_checkpointing-true" / "result.json").stat().st_mtime_ns
    again = subprocess.run([*cmd, "--resume"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "gradient_checkpointing-true" / "result.json").stat().st_mtime_ns == before

    short = [*cmd[:5], "50", *cmd[6:]]
    refused = subprocess.run(short, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "holds 6 demos samples to train, fewer than --samples 50" in refused.stderr
    assert "Traceback" not in refused.stderr

    # reflection-mode initialisation from the warm-up's adapter, on the 6 suffix samples (not the gate's)
    init = out / "gradient_checkpointing-true" / "adapters" / "policy-v1"
    refl = [*cmd[:6], "--phase", "reflect_init", "--init-adapter", str(init), *cmd[6:]]
    refl[refl.index("--out") + 1] = str(tmp_path / "refl")
    done = subprocess.run(refl, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "refl" / "gradient_checkpointing-false_chunk_tokens-0" / "result.json").read_text())
    assert result["samples"] == 3 * 2  # steps x the phase's batch_size (configs/test.yaml: learner.batch_size's 2)
    assert "p_auc" in result and result["reflection_problem_rate"] is not None
    assert "p_auc" in done.stdout.strip().splitlines()[-1]
    too_many = [*refl[:5], "7", *refl[6:]]
    refused = subprocess.run(too_many, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "holds 6 reflections samples to train, fewer than --samples 7" in refused.stderr


def test_same_actions_train_identical_demonstrations_in_both_prompt_forms(tmp_path, tiny_model_dir, alfworld_data):
    """Two walkthrough paths (turn_demos) and their steps' warm-up transitions: the window form trains
    the 4 actions as 2 steps of 2 demonstrations, the turns form as 1 step of 2 paths; each epoch-sized."""
    paths, transitions = [], []
    for e, actions in {"e1": ["go to desk 1", "take pen 1 from desk 1"], "e2": ["look", "go to shelf 1"]}.items():
        turns = [[a, f"You did {a}."] for a in actions]
        paths.append({"id": e, "episode": e, "game": "g", "goal": "put a pen on a shelf.", "first": "A room."})
        paths[-1] |= {"turns": turns, "targets": [True, True]}
        for t, a in enumerate(actions):
            s = f"Task: put a pen on a shelf.\nCurrent observation: step {t} of {e}."
            transitions.append({"id": f"{e}:{t}", "episode": e, "t": t, "phase": "warmup", "game": "g", "s": s})
            transitions[-1] |= {"goal": "put a pen on a shelf.", "a_exec": a}
    records = [("demos", f"d:{p['id']}".encode(), p) for p in paths]
    write_records(tmp_path / "replay", records + [("transitions", f"t:{r['id']}".encode(), r) for r in transitions])
    evals = sum((["--eval-set", s] for s in honcho_settings(tmp_path, tiny_model_dir, alfworld_data)), [])
    out = tmp_path / "same"
    cmd = [sys.executable, "experiments/studies/learner_setting.py", "--replay", str(tmp_path / "replay")]
    cmd += ["--same-actions"]
    cmd += ["--samples", "4", "--epochs", "1", "--games", "1", "--model", str(tiny_model_dir)]
    cmd += ["--config", "configs/test.yaml", "--out", str(out), *evals]
    cmd += ["--variants", "env.prompt_form=window,env.prompt_form=draft_turns"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    window = json.loads((out / "env.prompt_form-window" / "result.json").read_text())
    turns = json.loads((out / "env.prompt_form-draft_turns" / "result.json").read_text())
    assert window["samples"] == turns["samples"] == 4
    assert (window["steps"], turns["steps"]) == (2, 1)
    assert window["states"] > 0 and turns["states"] > 0
    eval_log = (out / "env.prompt_form-window" / "eval.log").read_text()
    assert "Traceback" not in eval_log

    # the paths alone (no warm-up transitions): the window form has nothing to train, said before any training
    write_records(tmp_path / "paths-only", [("demos", f"d:{p['id']}".encode(), p) for p in paths])
    alone = [*cmd[:3], str(tmp_path / "paths-only"), *cmd[4:]]
    alone[alone.index("--out") + 1] = str(tmp_path / "refused")
    refused = subprocess.run(alone, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    said = refused.stderr.strip().splitlines()[-1]  # the first path in the seed's order
    assert re.search(r"episode (e1's step 0 \('go to desk 1'\)|e2's step 0 \('look'\)) has no warm-up transition", said)
    assert not (tmp_path / "refused").exists()
