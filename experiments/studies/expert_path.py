"""What the draft policy does on the handcoded expert's own path through held-out games, per verb.

    python experiments/studies/expert_path.py RUN_DIR[:VERSION] [RUN_DIR[:VERSION] ...] --games 20 \\
        [--split valid_seen] [--verbs finishing] [--config configs/local.yaml] [--set key=value ...] [--out FILE.json]

A held-out figure that says why games are lost where the success rate reads 0: ALFWorld's handcoded
expert plays each game (``env.draft_turns`` prompts, as the actors send them); on every state it passes
through, each version's draft is decoded greedily among the admissible commands (the
``actor.admissible_choice`` decoding) and the expert's own action is scored as a whole (its tokens'
logprobs, end token included: decoding it as the only choice). Versions are asked on the same state one
after the other, so a noisy machine slows them alike. Per version and first word of the expert's action
(``go``, ``take``, ``move``...): the states, the share where the draft is the expert's action, the mean
probability of the expert's action, and the share where the draft is another command and the expert's is
likelier as a whole (what decoding the likeliest whole command could win at most). The search steps
(``go``, ``open``, ``close``) have many right answers; the words that finish a task (``take``, ``move``,
``heat``, ``cool``, ``clean``, ``use``, ``slice``) have one, and a policy that misses them never wins.
``--verbs finishing`` (or a comma list of words) asks the versions only where the expert's action starts
with one of them: the path is walked all the same, at a tenth of the model calls (46 of 526 states on
the table's 20 games), so more games fit. ``passing`` (alone or in the list) asks where the expert goes
on although it could take an object in sight (a ``take`` is admissible, the expert's action is not one):
objects that are not the task's; the ``passing`` group's ``draft takes`` is the share of those states
where the draft takes one anyway, which lost played games (docs/findings.md). ``delivering`` asks the
``go`` states while the expert holds the object it took (after its ``take``, before its ``move``): where
the task's receptacle must be chosen. Last line:
``expert_path=<version>: finishing=<share> (n) [passing_takes=<share> (n)] [delivering=<share> (n)]
all=<share> (n)`` for every version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PASSING = "passing"
DELIVERING = "delivering"
FINISHING = ("take", "move", "put", "heat", "cool", "clean", "use", "slice")
STOP = ["\n", "<|im_end|>"]
ENV_LOCK = threading.Lock()


@dataclass(frozen=True)
class ExpertState:
    """One state on the expert's path: what the draft saw, the expert's action and the state's groups."""

    conversation: object  # comap_async.prompts.Conversation
    admissible: tuple[str, ...]
    expert: str
    passing: bool
    delivering: bool

    def asked(self, verbs) -> bool:
        return (
            verbs is None
            or self.expert.split(maxsplit=1)[0] in verbs
            or (self.passing and PASSING in verbs)
            or (self.delivering and DELIVERING in verbs)
        )


def expert_states(game, max_steps: int) -> tuple[list[ExpertState], bool]:
    """ALFWorld's handcoded expert played through ``game``: the states it passes and whether it won.
    Carrying follows the learner's own rule for the ``deliver`` word (:func:`learner.batches.carrying_after`)."""
    from comap_async.envs.alfworld_env import AlfworldEnv
    from comap_async.prompts import Conversation
    from learner.batches import carrying_after

    env = AlfworldEnv(max_steps=max_steps)
    with ENV_LOCK:  # textworld's game loading is not thread-safe: one environment call at a time
        try:
            r = env.reset(game)
            task, first, turns, holding, states = r.info.get("task", ""), r.observation, [], False, []
            while not r.done and r.expert_action:
                expert = r.expert_action
                states.append(
                    ExpertState(
                        Conversation(task, first, tuple(turns)),
                        tuple(r.admissible),
                        expert,
                        is_passing(expert, r.admissible),
                        holding and expert.startswith("go "),
                    )
                )
                r = env.step(expert)
                holding = carrying_after(holding, expert, r.observation)
                turns.append((expert, r.observation))
            return states, r.won
        finally:
            env.close()


async def states_of_game(game, cfg, prompts, client, models, rows, log, verbs=None) -> None:
    """Each model's greedy choice and the expert action's score on the states of ``game``'s expert path."""
    from actors.llm import choice_logprob

    states, won = await asyncio.get_running_loop().run_in_executor(None, expert_states, game, cfg.env.max_steps)
    for t, st in enumerate(states):
        prompt = prompts.draft(st.conversation)
        for model in models if st.asked(verbs) else ():
            greedy, whole = await asyncio.gather(
                client.complete(
                    prompt, model=model, max_tokens=32, temperature=0.0, logprobs=1, stop=STOP,
                    structured_outputs={"choice": list(st.admissible)},
                ),
                client.complete(
                    prompt, model=model, max_tokens=32, temperature=0.0, logprobs=1, stop=STOP,
                    structured_outputs={"choice": [st.expert]},
                ),
            )  # fmt: skip
            rows.append(
                {
                    "model": model,
                    "game": game.name,
                    "t": t,
                    "expert": st.expert,
                    "passing": st.passing,
                    "delivering": st.delivering,
                    "draft": greedy.text.strip(),
                    "draft_logprob": choice_logprob(greedy.choices[0]),
                    "expert_logprob": choice_logprob(whole.choices[0]),
                }
            )
    log.info("expert_path.game", game=game.name, steps=len(states), won=won)


def summary(rows: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """Per model, per first word (and ``finishing``, ``passing``, ``all``): states, draft == expert, mean
    P(expert), and the share of drafts that take an object."""
    groups: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for x in rows:
        verb = x["expert"].split(maxsplit=1)[0]
        special = (PASSING if x.get("passing") else None, DELIVERING if x.get("delivering") else None)
        for key in (verb, "finishing" if verb in FINISHING else None, *special, "all"):
            if key:
                groups[x["model"]][key].append(x)
    return {
        model: {
            key: {
                "states": len(xs),
                "draft_is_expert": sum(x["draft"] == x["expert"] for x in xs) / len(xs),
                "p_expert": sum(math.exp(x["expert_logprob"]) for x in xs) / len(xs),
                # the expert's command likelier as a whole than the token-greedy draft: what decoding the
                # likeliest whole command could win at most
                "expert_likelier": sum(
                    x["draft"] != x["expert"] and x["expert_logprob"] > x["draft_logprob"] for x in xs
                )
                / len(xs),
                "draft_takes": sum(x["draft"].startswith("take ") for x in xs) / len(xs),
            }
            for key, xs in sorted(by.items(), key=lambda kv: -len(kv[1]))
        }
        for model, by in groups.items()
    }


def is_passing(expert: str, admissible) -> bool:
    """The expert goes on where it could take an object: the objects in sight are not the task's."""
    return not expert.startswith("take ") and any(a.startswith("take ") for a in admissible)


def verbs_of(spec: str) -> frozenset[str] | None:
    """``all`` -> None (every state); else the comma list's words, ``finishing`` standing for
    :data:`FINISHING` (``passing`` and ``delivering`` stay words: states, not verbs)."""
    if spec == "all":
        return None
    words = {w.strip() for w in spec.split(",") if w.strip()}
    return frozenset((words - {"finishing"}) | (set(FINISHING) if "finishing" in words else set()))


async def measure(args, cfg, models, root, server, log) -> list[dict]:
    from comap_async.models import resolve_model
    from comap_async.prompts.template import Prompts
    from comap_async.wire.inference_client import InferenceClient
    from evaluator.compare import split_games
    from evaluator.eval_runner import wait_for_server

    games = split_games(cfg, args.split, args.games)
    prompts = Prompts.for_model(resolve_model(cfg.model.name_or_path, cfg.model.cache_dir), cfg)
    await wait_for_server(cfg, server, 600, log)
    rows: list[dict] = []
    sem, verbs = asyncio.Semaphore(args.envs), verbs_of(args.verbs)
    async with InferenceClient.from_config(cfg, timeout_s=600) as client:
        for model in models:
            await client.load_adapter(model, str(root / model))

        async def one(game):
            async with sem:
                await states_of_game(game, cfg, prompts, client, models, rows, log, verbs)

        await asyncio.gather(*(one(g) for g in games))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR[:VERSION]")
    p.add_argument("--games", type=int, default=20)
    p.add_argument("--split", default="valid_seen")
    p.add_argument("--envs", type=int, default=8, help="games walked at once")
    p.add_argument(
        "--verbs",
        default="all",
        help="ask only where the expert's action starts with one of "
        "these words: all, or a comma list of words, finishing, passing and delivering (take,move or "
        "finishing,passing,delivering)",
    )
    p.add_argument("--config", default=str(ROOT / "configs" / "local.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=None, help="write the rows and the summary here (JSON)")
    args = p.parse_args()

    from comap_async.config import load_config
    from comap_async.logsetup import configure_logging
    from comap_async.wire.messages import POLICY, adapter_name
    from evaluator.compare import stage_run
    from evaluator.eval_runner import start_server, stop_server

    log = configure_logging("expert_path")
    with tempfile.TemporaryDirectory(prefix="expert-path-") as root:
        overrides = [*args.overrides, "env.prompt_form=draft_turns", f"inference.adapter_root={root}"]
        cfg = load_config(args.config, overrides)
        if cfg.env.name != "alfworld":
            print(
                f"expert_path: error: the handcoded expert is ALFWorld's (env.name is {cfg.env.name})", file=sys.stderr
            )
            return 2
        models, labels = [], {}
        try:
            for i, spec in enumerate(args.runs):
                run, _, version = spec.partition(":")
                v, _, prefix = stage_run(Path(run), i + 1, Path(root), version or "latest", with_ablation=False)
                models.append(adapter_name(POLICY, v, prefix))
                labels[models[-1]] = f"{Path(run).name} v{v}"
        except ValueError as exc:
            print(f"expert_path: error: {exc}", file=sys.stderr)
            return 2
        cfg, server = start_server(args.config, overrides, log)
        try:
            rows = asyncio.run(measure(args, cfg, models, Path(root), server, log))
        finally:
            stop_server(server)
    result = {labels[m]: s for m, s in summary(rows).items()}
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": result, "rows": rows}, indent=1))
    print(
        "| version | word | states | draft = expert | mean P(expert) | expert likelier than draft | draft takes |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |"
    )
    for label, by in result.items():
        for key, s in by.items():
            print(
                f"| {label} | {key} | {s['states']} | {s['draft_is_expert']:.2f} | {s['p_expert']:.3f} "
                f"| {s['expert_likelier']:.2f} | {s['draft_takes']:.2f} |"
            )

    def figure(by: dict) -> str:
        fin, every = by.get("finishing", {"draft_is_expert": 0.0, "states": 0}), by["all"]
        shares = f"finishing={fin['draft_is_expert']:.2f} ({fin['states']})"
        if PASSING in by:
            shares += f" passing_takes={by[PASSING]['draft_takes']:.2f} ({by[PASSING]['states']})"
        if DELIVERING in by:
            shares += f" delivering={by[DELIVERING]['draft_is_expert']:.2f} ({by[DELIVERING]['states']})"
        return f"{shares} all={every['draft_is_expert']:.2f} ({every['states']})"

    print("expert_path=" + "; ".join(f"{label}: {figure(by)}" for label, by in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
