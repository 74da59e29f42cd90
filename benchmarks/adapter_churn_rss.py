"""Memory of the embedded server under a storm of adapter publishes: what each load/unload cycle retains.

Each cycle publishes as the learner does: three adapters (policy, world model, teacher) of a new
version, each from a directory of its own (copies of four random r=8 all-linear adapters), one
completion on each, then the version three back is unloaded (the learner keeps the newest three
live) and its directories removed. No pause between cycles: a publish storm, faster than the chaos
soak's publish a second.

The server runs in this process (``create_state`` and the aiohttp app of ``comap serve``, on
loopback, the client talking HTTP to it), so that besides the resident set the script can count
what the server holds: Python objects, the Python allocator's blocks (ints and strings too,
which the collector does not see), torch tensors and their bytes, the C allocator's bytes in use
(glibc ``mallinfo2``), peft adapter slots, LoRA stack rows and capacity, the structure thread's
queue, the registry's per-name locks and the slots' generation entries. The prefix cache is kept
small (``--prefix-cache-mb``) so that it is full by the end of the warm-up: its budget bounds it,
and its growth before that is not a leak.

    python benchmarks/adapter_churn_rss.py [--cycles 300] [--every 25] [--warmup 75]

Last line: ``adapter_churn_rss_mb_per_100=X`` (the least-squares slope of the resident set over
the samples after the warm-up, in MB per 100 cycles).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _inference import write_random_adapters  # noqa: E402

from comap_async.config import load_config  # noqa: E402
from comap_async.ports import free_port  # noqa: E402
from comap_async.wire.inference_client import InferenceClient  # noqa: E402
from comap_async.wire.messages import adapter_name  # noqa: E402

ROLES = ("policy", "world", "teacher")
LIVE_VERSIONS = 3  # the learner's publish keeps the newest three versions loaded


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_mb() -> tuple[float, float]:
    """(in use, free) MB of the C allocator's heap: handed out and not taken back, and freed but kept
    (glibc only; zeros elsewhere)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return 0.0, 0.0
    fn.restype = _MallInfo2
    info = fn()
    return info.uordblks / 2**20, info.fordblks / 2**20


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class InProcessServer:
    """The embedded server's state and routes on a thread of their own, with its own event loop."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.state: Any = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="churn-server", daemon=True)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        from aiohttp import web

        from comap_async.inference.openai_api import build_app
        from comap_async.inference.server import create_state

        loop = asyncio.get_running_loop()
        try:
            self.state = await loop.run_in_executor(None, create_state, self.cfg, None)
            runner = web.AppRunner(build_app(self.state), access_log=None, handle_signals=False)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.cfg.inference.port, reuse_address=True).start()
        except BaseException as exc:  # reported to the waiting main thread
            self._error = exc
            self._ready.set()
            raise
        self.loop, self._stop = loop, asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await loop.run_in_executor(None, self.state.engine.stop)

    def start(self, timeout_s: float = 180) -> str:
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"the server did not start: {self._error!r}")
        return f"http://127.0.0.1:{self.cfg.inference.port}"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    def holdings(self) -> dict[str, float]:
        """What the server holds now (after a full collection)."""
        import torch

        gc.collect()
        objs = gc.get_objects()
        storages: dict[int, int] = {}
        tensors = 0
        for o in objs:
            if isinstance(o, torch.Tensor):
                tensors += 1
                try:
                    s = o.untyped_storage()
                    storages[s.data_ptr()] = s.nbytes()
                except RuntimeError:  # tensors without storage (meta, sparse)
                    pass
        del objs
        reg, slots = self.state.registry, self.state.registry.slots
        prefix = self.state.engine.prefix
        in_use, free = heap_mb()
        return {
            "rss_mb": rss_mb(),
            "heap_mb": in_use,
            "heap_free_mb": free,
            "py_blocks": sys.getallocatedblocks(),
            "objects": len(gc.get_objects()),
            "tensors": tensors,
            "tensor_mb": sum(storages.values()) / 2**20,
            "prefix_mb": prefix.bytes / 2**20 if prefix is not None else 0.0,
            "peft_slots": len(slots.peft.peft_config) if slots.peft is not None else 0,
            "stack_rows": len(slots.stacks.rows),
            "stack_capacity": slots.stacks.capacity,
            "generation_entries": len(slots.generation),
            "name_locks": len(reg._locks),
            "structure_queue": reg._structure._work_queue.qsize(),
        }


async def churn(url: str, server: InProcessServer, src: Path, root: Path, args: argparse.Namespace) -> list[dict]:
    samples: list[dict] = []
    peak = {"slots": 0, "queue": 0}
    stop = threading.Event()

    def watch() -> None:  # the peaks between samples: slots piled up while their deletes wait in the queue
        reg = server.state.registry
        while not stop.wait(0.005):
            peft = reg.slots.peft
            peak["slots"] = max(peak["slots"], len(peft.peft_config) if peft is not None else 0)
            peak["queue"] = max(peak["queue"], reg._structure._work_queue.qsize())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    async with InferenceClient([url], timeout_s=120) as client:
        await client.complete("Hello", max_tokens=2)
        for v in range(1, args.cycles + 1):
            for i, role in enumerate(ROLES):
                path = root / adapter_name(role, v)
                shutil.copytree(src / f"a{(v + i) % 4}", path)
                await client.load_adapter(adapter_name(role, v), str(path))
            prompt = f"Step {v}: you are in the middle of a room. Looking around you, you see a desk. " * 4
            await asyncio.gather(
                *(
                    client.complete(prompt + role, model=adapter_name(role, v), max_tokens=8, temperature=0.7)
                    for role in ROLES
                )
            )
            old = v - LIVE_VERSIONS
            if old >= 1:
                for role in ROLES:
                    await client.unload_adapter(adapter_name(role, old))
                    shutil.rmtree(root / adapter_name(role, old))
            if v % args.every == 0:
                row = {"cycle": v, **server.holdings(), "peak_slots": peak["slots"], "peak_queue": peak["queue"]}
                samples.append(row)
                print(
                    f"cycle {v:5d}  rss {row['rss_mb']:7.1f} MB  "
                    f"heap {row['heap_mb']:6.1f} MB (free {row['heap_free_mb']:5.1f})  "
                    f"python blocks {row['py_blocks']:8d}  "
                    f"objects {row['objects']:7d}  tensors {row['tensors']:6d} ({row['tensor_mb']:5.1f} MB, "
                    f"prefix {row['prefix_mb']:4.1f})  slots {row['peft_slots']} (peak {row['peak_slots']})  "
                    f"stack rows {row['stack_rows']}/{row['stack_capacity']}  queue peak {row['peak_queue']}  "
                    f"generations {row['generation_entries']}  name locks {row['name_locks']}",
                    flush=True,
                )
    stop.set()
    watcher.join()
    return samples


def slope_per_100(samples: list[dict], key: str, warmup: int) -> float:
    pts = [(s["cycle"], s[key]) for s in samples if s["cycle"] > warmup]
    if len(pts) < 2:
        raise SystemExit(f"fewer than two samples after the warm-up of {warmup} cycles: raise --cycles")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return 100 * sum((x - mx) * (y - my) for x, y in pts) / sxx


def main(args: argparse.Namespace) -> None:
    from comap_async.models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = build_tiny_model(work / "tiny")
        src, root = work / "src", work / "adapters"
        root.mkdir()
        write_random_adapters(str(model_dir), src, [f"a{i}" for i in range(4)], scale=0.3)
        cfg = load_config(
            args.config,
            [
                f"model.name_or_path={model_dir}",
                f"inference.port={free_port()}",
                f"inference.adapter_root={root}",
                f"inference.prefix_cache_mb={args.prefix_cache_mb}",
                *args.set,
            ],
        )
        server = InProcessServer(cfg)
        url = server.start()
        t0 = time.perf_counter()
        try:
            samples = asyncio.run(churn(url, server, src, root, args))
        finally:
            server.stop()
    elapsed = time.perf_counter() - t0
    after = [s for s in samples if s["cycle"] > args.warmup]
    print(
        f"{args.cycles} cycles ({3 * args.cycles} loads and unloads) in {elapsed:.0f} s; after the warm-up of "
        f"{args.warmup} cycles, per 100 cycles: heap in use {slope_per_100(samples, 'heap_mb', args.warmup):+.1f} MB, "
        f"heap free {slope_per_100(samples, 'heap_free_mb', args.warmup):+.1f} MB, "
        f"python blocks {slope_per_100(samples, 'py_blocks', args.warmup):+.0f}, "
        f"objects {slope_per_100(samples, 'objects', args.warmup):+.0f}, "
        f"tensors {slope_per_100(samples, 'tensors', args.warmup):+.0f}"
    )
    print(f"peak structure queue {max(s['peak_queue'] for s in samples)}")
    last = after[-1]
    print(
        f"adapter_churn_counts objects_per_100={slope_per_100(samples, 'objects', args.warmup):.0f} "
        f"tensors_per_100={slope_per_100(samples, 'tensors', args.warmup):.0f} "
        f"python_blocks_per_100={slope_per_100(samples, 'py_blocks', args.warmup):.0f} "
        f"heap_mb_per_100={slope_per_100(samples, 'heap_mb', args.warmup):.1f} "
        f"peak_slots={max(s['peak_slots'] for s in samples)} peft_slots={last['peft_slots']} "
        f"generation_entries={last['generation_entries']} name_locks={last['name_locks']} "
        f"stack_capacity={last['stack_capacity']}"
    )
    print(f"adapter_churn_rss_mb_per_100={slope_per_100(samples, 'rss_mb', args.warmup):.1f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=300)
    p.add_argument("--every", type=int, default=25, help="sample every N cycles")
    p.add_argument("--warmup", type=int, default=75, help="cycles left out of the slope")
    p.add_argument("--prefix-cache-mb", type=int, default=8)
    p.add_argument("--config", default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one more config override")
    main(p.parse_args())
