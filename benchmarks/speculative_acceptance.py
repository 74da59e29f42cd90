"""How many decode steps prompt-lookup speculation (the engine's ``speculative_tokens``) would save, per role,
replayed offline over what a run's roles generated in co-evolution.

For each stored co-evolution transition the role's prompt is rendered as the actors rendered it and its
stored output tokenized (the teacher's ``s_hat_teacher``, the world model's ``s_hat_exec``, the
reflection's decision and final action); then the engine's proposer (:class:`NgramIndex`, with its
proposal budget) runs along the output as a greedy verify step would: a proposed token counts as
confirmed when it is the output's next token. No model runs, so the figures are those of a greedy
decode that produced these outputs (the world model samples: its figure is an upper bound).

    python benchmarks/speculative_acceptance.py RUN_DIR [--config configs/local.yaml] [--k 8] [--last 300]
        [--live --adapter-version N --concurrent 4]

Per role: output tokens, decode steps (the first token comes with the prefill and counts as one),
tokens confirmed, tokens proposed and not confirmed (each costs a token of compute in its verify step).
Then the decode cost with speculation over the cost without it, by a two-term model of a decode step on
the machine: ``--row-ms`` for each row's share of a step's fixed cost (reading the weights), ``--token-ms``
for each token the step computes, confirmed or not (defaults: a 4-row step of 61 ms and ~4.8 ms a token,
measured in ``coevolve_throughput.py`` windows). Last line:
``decode_steps_per_token=X decode_cost_ratio=Y`` over all roles (1.0 and 1.0 without speculation).

``--live``: the same prompts served by two engines on the real model with the run's adapters of
``--adapter-version``, one without speculation and one with ``--k``, in waves of ``--concurrent``
requests (each transition's reflection, world model and teacher calls, as an actor's step makes them;
the world model sampled with a seed per call), each wave on one engine then the other. Last line:
``speculative_decode_speedup=X`` (decode seconds without / with), after the wall-time ratio and how many
outputs were the same token for token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from comap_async.inference.speculative import NGRAM_SIZES, NgramIndex, next_budget  # noqa: E402
from comap_async.prompts.messages import reflection_target  # noqa: E402
from comap_async.wire.messages import COEVOLVE  # noqa: E402
from experiments.system import run_records  # noqa: E402


def replay(prompt_ids: list[int], out_ids: list[int], k: int, sizes: tuple[int, ...]) -> tuple[int, int, int]:
    """(decode steps, confirmed, proposed and not confirmed) for one output, as the engine would run it."""
    index = NgramIndex(prompt_ids + out_ids[:1], sizes)
    n, steps, confirmed, wasted, budget = 1, 1, 0, 0, k
    while n < len(out_ids):
        proposal = index.propose(min(budget, len(out_ids) - n - 1))
        c = 0
        while c < len(proposal) and proposal[c] == out_ids[n + c]:
            c += 1
        if proposal:
            budget = next_budget(k, c)
        for token in out_ids[n : n + c + 1]:
            index.append(token)
        n, steps, confirmed, wasted = n + c + 1, steps + 1, confirmed + c, wasted + len(proposal) - c
    return steps, confirmed, wasted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--config", default="configs/local.yaml", help="the run's config (its prompts' wording)")
    ap.add_argument("--k", type=int, default=8, help="most tokens proposed per row and step")
    ap.add_argument("--last", type=int, default=300, help="the run's last N co-evolution transitions")
    ap.add_argument("--sizes", default=",".join(map(str, NGRAM_SIZES)), help="suffix lengths looked up")
    ap.add_argument("--row-ms", type=float, default=9.0, help="a row's share of a decode step's fixed cost")
    ap.add_argument("--token-ms", type=float, default=4.8, help="the cost of each token a decode step computes")
    ap.add_argument("--live", action="store_true", help="serve the prompts with and without speculation")
    ap.add_argument("--adapter-version", type=int, help="--live: the run's adapters of this version")
    ap.add_argument("--concurrent", type=int, default=4, help="--live: requests decoded together")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from comap_async.config import load_config
    from comap_async.models import resolve_model
    from comap_async.prompts.template import Prompts

    cfg = load_config(args.config)
    path = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
    prompts, tok = Prompts.for_model(path, cfg), AutoTokenizer.from_pretrained(path)
    sizes = tuple(int(x) for x in args.sizes.split(","))
    records = run_records(args.run_dir, "transitions", "speculative_acceptance")
    records = [r for r in records if r.get("phase") == COEVOLVE][-args.last :]
    if not records:
        raise SystemExit(f"{args.run_dir}: no co-evolution transitions stored")
    roles = {
        "reflection": lambda r: (
            prompts.reflect(r["s"], r["a_draft"], r["s_hat"], r.get("draft_confidence")),
            reflection_target(r["decision"], r["a_ref"]) if r.get("a_ref") else "",
        ),
        "world model": lambda r: (prompts.world_model(r["s"], r["a_exec"]), r.get("s_hat_exec", "")),
        "teacher": lambda r: (prompts.teacher(r["s"], r["a_exec"], r["s_next"]), r.get("s_hat_teacher", "")),
    }
    if args.live:
        return live(args, cfg, path, records, roles)
    total_tokens = total_steps = total_wasted = 0
    for role, render in roles.items():
        tokens = steps = confirmed = wasted = 0
        for r in records:
            prompt, out = render(r)
            if not out.strip():
                continue
            out_ids = tok(out, add_special_tokens=False).input_ids + [tok.eos_token_id]
            s, c, w = replay(tok(prompt).input_ids, out_ids, args.k, sizes)
            tokens, steps, confirmed, wasted = tokens + len(out_ids), steps + s, confirmed + c, wasted + w
        total_tokens, total_steps, total_wasted = total_tokens + tokens, total_steps + steps, total_wasted + wasted
        print(
            f"{role}: {tokens} tokens in {steps} decode steps ({steps / max(1, tokens):.2f} a token), "
            f"{confirmed} confirmed, {wasted} proposed and not"
        )
    print(f"transitions={len(records)} k={args.k} sizes={args.sizes}")
    plain = (args.row_ms + args.token_ms) * total_tokens
    spec = args.row_ms * total_steps + args.token_ms * (total_tokens + total_wasted)
    ratio = spec / max(1e-9, plain)
    print(f"decode_steps_per_token={total_steps / max(1, total_tokens):.3f} decode_cost_ratio={ratio:.3f}")
    return 0


ROLE_ADAPTER = {"reflection": "policy", "world model": "wm", "teacher": "wm_teacher"}


def live(args, cfg, path, records, roles) -> int:
    """Both engines on the same requests, wave by wave; see the module's docstring."""
    import threading
    import time

    import torch
    from peft import LoraConfig

    from comap_async.inference.adapters import SlotManager, read_adapter
    from comap_async.inference.engine import Engine, Sequence
    from comap_async.inference.layout import prepare_for_inference
    from comap_async.inference.server import build_fused
    from comap_async.inference.token_sampling import SamplingParams, make_generator
    from comap_async.models import load_model_and_tokenizer
    from comap_async.wire.messages import adapter_name

    if args.adapter_version is None:
        raise SystemExit("--live needs --adapter-version (the run's adapters to serve)")
    torch.set_num_threads(cfg.model.torch_threads)
    lr, inf, act = cfg.learner, cfg.inference, cfg.actor

    def engine(k: int) -> tuple[Engine, dict[str, str]]:
        model, tok = load_model_and_tokenizer(path, cfg.model.dtype)
        prepare_for_inference(model)
        slots = SlotManager(
            model, LoraConfig(r=lr.lora_r, lora_alpha=lr.lora_alpha, target_modules=lr.target_modules), spares=3
        )
        eng = Engine(
            model,
            tok,
            slots,
            max_batch_size=inf.max_batch_size,
            batch_wait_ms=0,
            max_model_len=inf.max_prompt_tokens + inf.max_new_tokens,
            fused=build_fused(model, slots, inf),
            speculative_tokens=k,
            seed=0,
        )
        eng.start()
        eng.call(slots.fill_spares).result(120)
        named = {}
        for role in ROLE_ADAPTER.values():
            slot = slots.take_spare()
            adapter = args.run_dir / "adapters" / adapter_name(role, args.adapter_version)
            if slot is None or not slots.fill_spare(slot, read_adapter(adapter)):
                raise SystemExit(f"could not load {adapter}")
            named[role] = slot
        return eng, named

    plain, spec = engine(0), engine(args.k)
    tok = plain[0].tokenizer
    requests = []  # (prompt ids, params, role, seed)
    for i, r in enumerate(records):
        for role, render in roles.items():
            prompt, _ = render(r)
            sampled = role == "world model"
            budget = act.max_tokens["reflection" if role == "reflection" else "wm"]
            params = SamplingParams(
                max_tokens=budget,
                temperature=act.temperature if sampled else 0.0,
                seed=i if sampled else None,
                stop=("\n\n",) if role != "reflection" else (),
            )
            requests.append((tok(prompt).input_ids, params, role))

    def wave(eng: Engine, named: dict[str, str], batch: list) -> tuple[list[Sequence], float]:
        done = threading.Semaphore(0)
        seqs = [
            Sequence(
                ids,
                p,
                slot=named[ROLE_ADAPTER[role]],
                generator=make_generator(p.seed),
                on_done=lambda _s: done.release(),
            )
            for ids, p, role in batch
        ]
        t0 = time.perf_counter()
        eng.submit(seqs)
        for _ in seqs:
            if not done.acquire(timeout=600):
                raise SystemExit("a request did not finish in 600 s")
        return seqs, time.perf_counter() - t0

    wall = {0: 0.0, 1: 0.0}
    same = total = 0
    for start in range(0, len(requests), args.concurrent):
        batch = requests[start : start + args.concurrent]
        order = (0, 1) if (start // args.concurrent) % 2 == 0 else (1, 0)
        out = {}
        for which in order:
            eng, named = (plain, spec)[which]
            out[which], seconds = wave(eng, named, batch)
            wall[which] += seconds
        for a, b in zip(out[0], out[1]):
            same += a.out_ids == b.out_ids
            total += 1
    ps, ss = plain[0].stats, spec[0].stats
    for eng, _ in (plain, spec):
        eng.stop()
    print(
        f"requests={total} same_tokens={same} ({same / max(1, total):.0%}), "
        f"tokens {ps.generated_tokens} / {ss.generated_tokens}"
    )
    print(
        f"decode steps {ps.steps} / {ss.steps} (verify {ss.verify_steps}: "
        f"{ss.accepted_tokens} of {ss.proposed_tokens} proposed confirmed)"
    )
    print(
        f"decode seconds {ps.step_seconds:.1f} / {ss.step_seconds:.1f}, wall {wall[0]:.1f} / {wall[1]:.1f} s "
        f"(prefill {ps.prefill_seconds:.1f} / {ss.prefill_seconds:.1f})"
    )
    print(f"speculative_wall_speedup={wall[0] / max(1e-9, wall[1]):.2f}")
    print(f"speculative_decode_speedup={ps.step_seconds / max(1e-9, ss.step_seconds):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
