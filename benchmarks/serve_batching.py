"""Decode rate of the embedded server with the real default model (SmolLM2-135M-Instruct): the fused
forward (what the server runs the Llama family on) against the reference (transformers' forward), both
served at once and measured in alternating rounds so the ratio is taken under the same machine load.

Each server is a real ``comap serve`` (torch_threads=1, max_batch_size=8). Requests are actor draft
prompts (~140 tokens: the shared chat header and system prompt, then a state that differs per
request) with 64 generated tokens each (``ignore_eos`` so every request does the same work), from 1
client, then from 8 concurrent clients. Aggregate tokens/s = generated tokens / wall time (prefill
included); the server's own counters give the decode-step time per step and the prefill time per
prompt token. A last measurement runs the 8 clients over 4 adapters plus the base (one mixed batch).

The bandwidth bound is the decode rate at batch 8 if a step cost only streaming the weights once:
8 / (weight bytes / memory read rate), the read rate measured here (one thread summing 256 MiB).

    python benchmarks/serve_batching.py [--rounds 2] [--max-tokens 64]
    COMAP_VLLM_PYTHON="$VLLM_VENV/bin/python" python benchmarks/serve_batching.py --pair vllm,fused

Last line: ``decode_speedup_vs_reference=X`` (fused / reference aggregate tokens/s at 8 clients).
With ``--pair vllm,fused`` (the peer a CPU user would pick instead, vLLM's CPU build,
docs/inference.md "vLLM on this CPU") the reference is vLLM served by ``comap serve --backend vllm``
on the same model, adapters and requests, pinned to as many cores as the embedded server has
threads (``--threads``); the last line is then ``fused_over_vllm_1=X fused_over_vllm_8=Y``. vLLM's
engine counters are not ours, so its decode-step and prefill columns read n/a.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _inference import served, write_random_adapters  # noqa: E402

from comap_async.config import load_config  # noqa: E402
from comap_async.models import resolve_model  # noqa: E402
from comap_async.prompts import ChatTemplate, Prompts  # noqa: E402
from comap_async.wire.inference_client import ENGINE_COUNTERS, InferenceClient, parse_engine_counters  # noqa: E402
from comap_async.wire.messages import POLICY, adapter_name  # noqa: E402

OBJECTS = ["apple", "bread", "knife", "mug", "egg", "lettuce", "potato", "tomato", "spoon", "cup"]
PLACES = ["countertop", "cabinet", "drawer", "shelf", "fridge", "sinkbasin", "microwave", "desk"]
PATHS = {
    "reference": ([], "transformers"),
    "fused": ([], "fused"),
    "vllm": (["inference.backend=vllm"], None),
}
"""Each server: its overrides and the embedded server's forward (None: not the embedded server)."""


def state(i: int) -> str:
    """A distinct ALFWorld-like state per request (prompts share only the header and system prompt)."""
    o, p = OBJECTS[i % len(OBJECTS)], PLACES[(i // len(OBJECTS)) % len(PLACES)]
    return (
        f"Task: put a clean {o} in {PLACES[(i + 3) % len(PLACES)]}.\nRecent history:\n> go to {p} {i % 3 + 1}\n"
        f"You arrive at {p} {i % 3 + 1}. On the {p} {i % 3 + 1}, you see a {o} {i % 4 + 1}, a bread 2, a knife 1.\n"
        f"Current observation: You pick up the {o} {i % 4 + 1} from the {p} {i % 3 + 1}.\n"
        f"Admissible commands: go to fridge 1, go to sinkbasin 1, inventory, look, examine {p} {i % 3 + 1}"
    )


async def rate(
    client: InferenceClient,
    prompts: Prompts,
    concurrency: int,
    per_client: int,
    max_tokens: int,
    models: list[str | None],
    offset: int,
) -> float:
    tokens = 0

    async def worker(w: int) -> None:
        nonlocal tokens
        for i in range(per_client):
            prompt = prompts.draft(state(offset + w * per_client + i))
            r = await client.complete(
                prompt,
                model=models[w % len(models)],
                max_tokens=max_tokens,
                temperature=0.7,
                seed=100 * w + i,
                ignore_eos=True,
            )
            tokens += r.usage["completion_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return tokens / (time.perf_counter() - t0)


async def counters(url: str) -> dict[str, float]:
    """The engine's counters from ``/metrics``."""
    import urllib.request

    def get() -> str:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            return r.read().decode()

    counted = parse_engine_counters(await asyncio.to_thread(get))
    return {name: counted.get(name, 0.0) for name in ENGINE_COUNTERS}


def read_gb_per_s() -> float:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(64 << 20)
    best = 0.0
    for _ in range(4):
        t0 = time.perf_counter()
        a.sum()
        best = max(best, a.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def weight_bytes(model_dir: str, dtype_bytes: int) -> int:
    """Bytes of the weights a decode step streams: every Linear of the layers and the LM head."""
    import json

    c = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    qkvo = h * d * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    return dtype_bytes * (layers * (qkvo + 3 * h * inter) + h * c["vocab_size"])


async def measure(args: argparse.Namespace, prompts: Prompts, urls: dict[str, str], names: list[str]) -> dict:
    res: dict[str, dict[str, list[float]]] = {
        p: {"one": [], "eight": [], "step_ms": [], "rows": [], "prefill_ms": []} for p in urls
    }
    clients = {path: InferenceClient([url], timeout_s=900) for path, url in urls.items()}
    try:
        for path, c in clients.items():
            for name in names:
                await c.load_adapter(name, str(args.adapter_root / name))
            await rate(c, prompts, 2, 1, 8, [None], 0)  # warm-up
        for r in range(args.rounds):
            order = list(urls) if r % 2 == 0 else list(reversed(urls))
            for path in order:
                c = clients[path]
                res[path]["one"].append(await rate(c, prompts, 1, 3, args.max_tokens, [None], 1000 + 100 * r))
                before = await counters(urls[path])
                res[path]["eight"].append(await rate(c, prompts, 8, 2, args.max_tokens, [None], 2000 + 100 * r))
                after = await counters(urls[path])
                d = {k: after[k] - before[k] for k in after}
                engine = ""
                if d["decode_steps"] > 0:  # the embedded server's counters (vLLM has its own)
                    res[path]["step_ms"].append(1000 * d["decode_seconds"] / d["decode_steps"])
                    res[path]["rows"].append(d["decode_rows"] / d["decode_steps"])
                    computed = max(1.0, d["prompt_tokens"] - d["prefix_cache_hit_tokens"])
                    res[path]["prefill_ms"].append(1000 * d["prefill_seconds"] / computed)
                    engine = (
                        f", decode step {res[path]['step_ms'][-1]:6.1f} ms ({res[path]['rows'][-1]:.1f} rows), "
                        f"prefill {res[path]['prefill_ms'][-1]:.2f} ms/token"
                    )
                print(
                    f"round {r} {path:9s}: 1 client {res[path]['one'][-1]:6.1f} tok/s, 8 clients "
                    f"{res[path]['eight'][-1]:6.1f} tok/s{engine}",
                    flush=True,
                )
        for path, c in clients.items():
            res[path]["mixed"] = [await rate(c, prompts, 8, 2, args.max_tokens, [None, *names], 5000)]
    finally:
        for c in clients.values():
            await c.close()
    return res


async def main(args: argparse.Namespace) -> None:
    pair = [x.strip() for x in args.pair.split(",") if x.strip()]
    if len(pair) != 2 or any(x not in PATHS for x in pair):
        raise SystemExit(f"--pair takes two of {list(PATHS)}, not {args.pair!r}")
    cfg = load_config(args.config)
    model_dir = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
    prompts = Prompts(ChatTemplate.from_model_dir(model_dir))
    with tempfile.TemporaryDirectory() as tmp:
        root = args.adapter_root = Path(tmp)
        names = [adapter_name(POLICY, i) for i in range(4)]
        write_random_adapters(model_dir, root, names)
        base = [f"model.name_or_path={cfg.model.name_or_path}", f"model.torch_threads={args.threads}"] + (
            args.set or []
        )
        # vLLM's CPU engine takes the cores listed here (its default binds all of them)
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}" if args.threads > 1 else "0"}
        timeout = {p: 900 if p == "vllm" else 180 for p in pair}
        a, b = pair
        with (
            served(base + PATHS[a][0], root, root / f"{a}.log", timeout[a], env, forward=PATHS[a][1]) as url_a,
            served(base + PATHS[b][0], root, root / f"{b}.log", timeout[b], env, forward=PATHS[b][1]) as url_b,
        ):
            res = await measure(args, prompts, {pair[0]: url_a, pair[1]: url_b}, names)
            logs = {p: (root / f"{p}.log").read_text() for p in pair}
    mean = {p: {k: sum(v) / len(v) if v else None for k, v in r.items()} for p, r in res.items()}
    gbs = read_gb_per_s()
    for path in pair:
        m = re.search(r'"dtype": "(\w+)"', logs[path]) if path == "fused" else None
        dtype = m.group(1) if m else ("float32" if path == "fused" else cfg.model.dtype)
        r = mean[path]
        wb = weight_bytes(model_dir, 2 if dtype in ("bfloat16", "float16") else 4)
        bound = 8 / (wb / (gbs * 1e9))
        engine = "decode_step_ms_8=n/a prefill_ms_per_token=n/a"
        if r["step_ms"] is not None:
            engine = (
                f"decode_step_ms_8={r['step_ms']:.1f} (mean rows {r['rows']:.1f}, engine decode "
                f"{1000 * r['rows'] / r['step_ms']:.1f} tok/s) prefill_ms_per_token={r['prefill_ms']:.2f}"
            )
        print(
            f"{path} ({dtype}): tokens_per_s_1={r['one']:.1f} tokens_per_s_8={r['eight']:.1f} "
            f"tokens_per_s_8_mixed_adapters={r['mixed']:.1f} {engine} bandwidth_bound_tokens_per_s_8={bound:.0f} "
            f"({wb / 2**20:.0f} MiB of weights at {gbs:.1f} GB/s)"
        )
    a, b = pair
    print(f"batching_speedup={mean[b]['eight'] / mean[b]['one']:.2f} ({b}, 8 clients / 1 client)")
    if pair == ["reference", "fused"]:
        print(f"decode_step_speedup_vs_reference={mean['reference']['step_ms'] / mean['fused']['step_ms']:.2f}")
        print(f"decode_speedup_vs_reference={mean['fused']['eight'] / mean['reference']['eight']:.2f}")
    else:
        print(
            f"{b}_over_{a}_1={mean[b]['one'] / mean[a]['one']:.2f} "
            f"{b}_over_{a}_8={mean[b]['eight'] / mean[a]['eight']:.2f}"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="config file (default: built-in defaults, the real default model)")
    p.add_argument("--set", action="append", help="extra --set overrides for both servers")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pair", default="reference,fused", help=f"the two servers, A,B (B over A), of {list(PATHS)}")
    p.add_argument("--threads", type=int, default=1, help="threads (cores) of each server")
    asyncio.run(main(p.parse_args()))
