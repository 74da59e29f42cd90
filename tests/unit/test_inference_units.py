"""Pure pieces of the inference package: request validation, sampling, KV-cache bookkeeping, paths, vLLM argv."""

from __future__ import annotations

import random

import pytest
import torch

from comap_async.config import load_config
from comap_async.inference import vllm
from comap_async.inference.adapters import resolve_adapter_dir
from comap_async.inference.kvcache import BatchCache
from comap_async.inference.token_sampling import (
    RequestError,
    SamplingParams,
    _filter_top,
    parse_completion_request,
    sample_step,
)


def test_defaults_follow_openai():
    req = parse_completion_request({"prompt": "hi"}, max_new_tokens=64)
    assert req.prompts == ["hi"] and req.n == 1 and req.model is None
    assert req.params == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0)
    req = parse_completion_request({"prompt": [[1, 2], [3]], "stop": "\n", "top_k": -1, "logprobs": 0}, 64)
    assert req.prompts == [[1, 2], [3]] and req.params.stop == ("\n",) and req.params.top_k == 0
    assert req.params.logprobs == 0 and req.priority == 0
    assert parse_completion_request({"prompt": "hi", "priority": -1}, 64).priority == -1


def test_waiting_sequences_are_admitted_by_priority_then_arrival():
    from collections import deque

    from comap_async.inference.engine import Sequence, enqueue

    waiting: deque[Sequence] = deque()
    for name, priority in [("a", 0), ("b", 0), ("c", -1), ("d", 1), ("e", -1), ("f", 0)]:
        enqueue(waiting, Sequence([1], SamplingParams(), adapter=name, priority=priority))
    assert [s.adapter for s in waiting] == ["c", "e", "a", "b", "f", "d"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "max_tokens": 65}, "max_tokens"),
        ({"prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "seed": "1"}, "seed"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
        ({"prompt": "x", "model": 3}, "model"),
        ({"prompt": "x", "priority": 0.5}, "priority"),
        ({"prompt": "x", "priority": 2**40}, "priority"),
    ],
)
def test_invalid_values_name_the_field(body, param):
    with pytest.raises(RequestError) as err:
        parse_completion_request(body, max_new_tokens=64)
    assert err.value.status == 400 and err.value.param == param and param in str(err.value)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(_filter_top(logits, 0, 0.8))
    assert kept.tolist() == [True, True, False, False]
    assert torch.isfinite(_filter_top(logits, 0, 0.01)).tolist() == [True, False, False, False]
    assert torch.isfinite(_filter_top(logits[[2, 0, 3, 1]], 2, 1.0)).tolist() == [False, True, False, True]


def test_sample_step_reports_raw_logprobs_and_honours_seeds():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.0, 5.0, 0.0]])
    raw = torch.log_softmax(logits, -1)
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    hot = SamplingParams(temperature=5.0, logprobs=2)
    g = torch.Generator().manual_seed(0)
    out = sample_step(logits, [greedy, hot], [None, torch.Generator().manual_seed(3)], g)
    assert out[0].token == 0 and out[0].logprob == pytest.approx(float(raw[0, 0]))
    # logprobs ignore temperature: they are the model's distribution
    assert [t for t, _ in out[1].top] == [2, 0] and out[1].top[0][1] == pytest.approx(float(raw[1, 2]))
    again = sample_step(logits, [greedy, hot], [None, torch.Generator().manual_seed(3)], g)
    assert again[1].token == out[1].token
    assert sample_step(logits, [SamplingParams(), SamplingParams()], [None, None], g)[0].top == []


def _layer_rows(cache: BatchCache) -> torch.Tensor:
    return cache.layers[0].keys[:, 0, :, 0]


def test_batch_cache_merges_left_padded_and_trims():
    def filled(values: list[list[float]]) -> BatchCache:
        c = BatchCache(2)
        n = max(len(v) for v in values)
        k = torch.zeros(len(values), 1, n, 1)
        mask = torch.zeros(len(values), n, dtype=torch.long)
        for i, v in enumerate(values):
            k[i, 0, n - len(v) :, 0] = torch.tensor(v)
            mask[i, n - len(v) :] = 1
        for layer in c.layers:
            layer.update(k.clone(), k.clone())
        c.mask = mask
        return c

    a, b = filled([[1, 2, 3, 4, 5]]), filled([[7, 8]])
    a.merge(b)
    assert a.length == 5 and a.mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert _layer_rows(a).tolist() == [[1, 2, 3, 4, 5], [0, 0, 0, 7, 8]]
    a.extend_mask()
    for layer in a.layers:  # one decode step: every row gains a column
        layer.update(torch.full((2, 1, 1, 1), 9.0), torch.full((2, 1, 1, 1), 9.0))
    a.select([1])  # the long row leaves: leading padding columns go with it
    assert a.length == 3 and a.mask.tolist() == [[1, 1, 1]] and _layer_rows(a).tolist() == [[7, 8, 9]]
    a.select([])
    assert a.batch == 0 and a.length == 0


def test_adapter_paths_stay_inside_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    for d in (root / "policy-v1", outside):
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text("{}")
        (d / "adapter_model.safetensors").write_bytes(b"")
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "half").mkdir()
    (root / "half" / "adapter_config.json").write_text("{}")
    (root / "half" / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    assert resolve_adapter_dir(root, "policy-v1") == (root / "policy-v1").resolve()
    assert resolve_adapter_dir(root, str(root / "policy-v1")) == (root / "policy-v1").resolve()
    for bad, status in [
        (str(outside), 400),
        ("../outside", 400),
        ("policy-v1/../../outside", 400),
        ("link", 400),
        ("half", 400),
        ("missing", 404),
        ("", 400),
        (None, 400),
    ]:
        with pytest.raises(RequestError) as err:
            resolve_adapter_dir(root, bad)
        assert err.value.status == status, bad


def test_vllm_command_from_config(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = load_config(None, ["inference.admin_token=s3cret", "inference.port=9001", "learner.lora_r=12"])
    argv, env = vllm.build_command(cfg, "/models/smol", "/venv/bin/python", {"policy-v1": "/a/policy-v1"})
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv)
    for part in (
        "--model /models/smol",
        "--served-model-name smollm2-135m-instruct",
        "--port 9001",
        "--enable-lora",
        "--max-lora-rank 16",
        "--api-key s3cret",
        "--lora-modules policy-v1=/a/policy-v1",
        "--generation-config vllm",
        "--enable-prefix-caching",
    ):
        assert part in joined
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # vLLM's CPU backend would otherwise take ~92% of the host's memory for its KV cache
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "6")
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm.build_command(cfg, "/m", "/p")[1]  # the user's setting wins
    # every adapter that can be live at once fits a batch; the user's own options pass through, last
    assert "--max-loras 12 --max-cpu-loras 32 --tensor-parallel-size 1" in joined
    assert "--gpu-memory-utilization" not in joined
    cfg = load_config(
        None,
        [
            "inference.tensor_parallel=2",
            "inference.gpu_memory_utilization=0.45",
            "inference.vllm_args=['--enforce-eager','--max-model-len','4096']",
        ],
    )
    argv, _ = vllm.build_command(cfg, "/m", "/p")
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.45"
    assert argv[-3:] == ["--enforce-eager", "--max-model-len", "4096"]
    assert vllm.max_lora_rank(8) == 8 and vllm.max_lora_rank(9) == 16
    argv, _ = vllm.build_command(load_config(None, ["inference.prefix_cache_mb=0"]), "/m", "/p")
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    # vLLM refuses a request's priority unless it schedules by priority: only then is it asked to
    assert "--scheduling-policy" not in argv
    argv, _ = vllm.build_command(load_config(None, ["eval.priority=-1"]), "/m", "/p")
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    with pytest.raises(ValueError):
        vllm.max_lora_rank(1000)


def test_draw_follows_the_distribution_and_never_picks_zero_mass():
    from comap_async.inference.token_sampling import _draw

    p = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([_draw(p, g) for _ in range(20000)]), minlength=5) / 20000
    assert counts[1] == 0 and counts[4] == 0
    assert torch.allclose(counts, p, atol=0.015)


@pytest.mark.parametrize("scale", [8.0, 0.01])  # a peaked row (nucleus among the candidates), a flat one (full sort)
def test_top_p_top_k_sampling_picks_what_the_full_sort_picks(scale):
    """``sample_top`` samples from a batched ``topk`` instead of sorting every row: for the same
    uniform number it must pick the token the full-vocabulary sort and inverse CDF would."""
    from comap_async.inference.token_sampling import _draw, sample_top

    torch.manual_seed(0)
    logits = torch.randn(6, 5000) * scale
    params = [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.7, top_k=40),
        SamplingParams(temperature=1.3, top_p=0.95, top_k=300),
        SamplingParams(temperature=0.7, top_p=0.99),
        SamplingParams(temperature=0.5, top_k=1),
    ]
    for seed in range(60):
        got = sample_top(logits, params, [torch.Generator().manual_seed(seed + i) for i in range(6)])
        expect = [
            _draw(
                torch.softmax(_filter_top(logits[i] / p.temperature, p.top_k, p.top_p), -1),
                torch.Generator().manual_seed(seed + i),
            )
            for i, p in enumerate(params)
        ]
        assert got == expect


def test_ngram_index_proposes_what_followed_the_latest_earlier_occurrence_of_the_suffix():
    from comap_async.inference.speculative import NgramIndex

    # "you arrive at X . you arrive" -> what followed "you arrive" the last time
    idx = NgramIndex([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 5, 9, 1, 2], sizes=(3, 2))
    assert idx.propose(3) == [3, 7, 5]  # the most recent occurrence (3, 7, ...), not the first (3, 4, ...)
    assert idx.propose(0) == []
    idx.append(3)
    assert idx.propose(2) == [7, 5]  # the 3-gram (1, 2, 3) first
    idx.append(4)  # (2, 3, 4) occurred once, at the start
    assert idx.propose(9) == [5, 9, 1, 2, 3, 7, 5, 9, 1]
    idx.append(8)
    assert idx.propose(4) == []  # (3, 4, 8) and (4, 8) never occurred before
    # the suffix itself is never its own earlier occurrence
    fresh = NgramIndex([5, 6], sizes=(3, 2))
    assert fresh.propose(4) == []
    fresh.append(5)
    fresh.append(6)
    assert fresh.propose(4) == [5, 6]
    assert NgramIndex([]).propose(2) == []
    assert NgramIndex([7, 8, 9, 1, 8, 9]).propose(2) == []  # the default sizes want 3 tokens matched
    assert NgramIndex([7, 8, 9, 1, 7, 8, 9]).propose(2) == [1, 7]


def test_vllm_speculation_is_asked_for_in_vllm_args_only():
    from comap_async.config import load_config
    from comap_async.inference import vllm

    argv, _ = vllm.build_command(load_config(None, []), "/m", "/p")
    assert "--speculative-config" not in argv
    spec = '{"method": "ngram", "num_speculative_tokens": 6}'
    cfg = load_config(None, [f"inference.vllm_args=['--speculative-config', '{spec}']"])
    argv, _ = vllm.build_command(cfg, "/m", "/p")
    assert argv[-2:] == ["--speculative-config", spec]


def test_batch_cache_joins_and_leaves_in_place_as_a_repadded_batch_would():
    """Random joins (shorter and longer rows), decode and verify columns, and leaves: every layer's keys and
    values stay each row's own columns right-aligned over zeros (as re-padding the whole batch gives), and
    in place the buffers are reallocated only when the batch outgrows them."""
    rng = random.Random(0)
    heads, dim = 2, 3
    for transposed in (False, True):
        cache, rows, token = BatchCache(2, transposed=transposed, rows_hint=4), [], 0
        copies, joins_and_leaves, buffers = 0, 0, None
        for _ in range(300):
            op, before = rng.random(), len(rows)
            if (op < 0.3 and len(rows) < 4) or not rows:
                n = rng.choice([1, 3, 40, 90]) if rng.random() < 0.3 else rng.randint(1, 12)
                joiner = BatchCache(2, transposed=transposed)
                values = [float(token + i + 1) for i in range(n)]
                token += n
                kv = torch.tensor(values).view(1, 1, n, 1).expand(1, heads, n, dim).contiguous()
                for layer in joiner.layers:
                    layer.update(kv.clone(), -kv)
                joiner.mask = torch.ones(1, n, dtype=torch.long)
                cache.merge(joiner)
                rows.append(values)
                joins_and_leaves += before > 1
            elif op < 0.55:
                keep = sorted(rng.sample(range(len(rows)), rng.randint(0, len(rows) - 1)))
                rows = [rows[i] for i in cache.select(keep)]
                joins_and_leaves += before > 1 and bool(keep)
            else:
                width = rng.choice([1, 1, 1, 4])  # a decode step, or a verify step's columns
                cache.extend_mask(width)
                new = [[float(token + 1 + j + i * width) for j in range(width)] for i in range(len(rows))]
                token += width * len(rows)
                kv = torch.tensor(new).view(len(rows), 1, width, 1).expand(len(rows), heads, width, dim).contiguous()
                for layer in cache.layers:
                    layer.update(kv.clone(), -kv)
                rows = [r + n for r, n in zip(rows, new)]
            if not rows:
                assert cache.batch == 0
                continue
            total = max(map(len, rows))
            expect = torch.tensor([[0.0] * (total - len(r)) + r for r in rows])
            assert cache.length == total and cache.mask.tolist() == (expect != 0).long().tolist()
            for layer in cache.layers:
                keys = layer.keys.transpose(-1, -2) if transposed else layer.keys
                assert torch.equal(keys, expect.view(len(rows), 1, total, 1).expand(-1, heads, -1, dim))
                assert torch.equal(layer.values, -keys)
            copies += before > 1 and bool(rows) and cache.layers[0].kbuf is not buffers
            buffers = cache.layers[0].kbuf
        # re-padding would copy the batch at every join and leave (of a batch of several rows: one row is cheap)
        assert 4 * copies < joins_and_leaves, (copies, joins_and_leaves)
