"""`comap model prepare` gives a directory transformers loads offline,
and the real model answers a question sensibly through its chat template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    if os.environ.get("COMAP_MODEL_CACHE"):
        cache = os.environ["COMAP_MODEL_CACHE"]
    else:
        cache = str(tmp_path_factory.mktemp("cache"))
    cmd = [sys.executable, "-m", "comap_async", "model", "prepare", "--set", f"model.cache_dir={cache}"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    t = time.time()
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    return first.stdout.strip().splitlines()[-1], time.time() - t


def test_prepare_is_idempotent_and_fast_second_time(prepared):
    path, second_s = prepared
    assert second_s < 10, f"second prepare took {second_s:.1f}s"
    assert json.loads(open(os.path.join(path, "comap-model.json")).read())["architecture"] == "llama"
    assert not any(name.endswith(".gguf") for name in os.listdir(path))


def test_generates_sensible_answer_offline(prepared):
    path, _ = prepared
    code = f"""
import os, torch
os.environ['HF_HUB_OFFLINE'] = '1'
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained({path!r}, local_files_only=True)
m = AutoModelForCausalLM.from_pretrained({path!r}, local_files_only=True)
msgs = [{{"role": "user", "content": "What is the capital of France? Answer in one word."}}]
ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = m.generate(**ids, max_new_tokens=12, do_sample=False)
print(tok.decode(out[0][ids["input_ids"].shape[1]:], skip_special_tokens=True))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "paris" in r.stdout.lower(), r.stdout
