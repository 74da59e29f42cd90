"""The evaluator's section and the ways an evaluated agent acts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from comap_async.config.base import RequestPriority, Section

EvalMethod = Literal["comap", "comap_oracle", "react", "imagine_and_act", "draft_only", "lookahead"]
"""How an evaluated agent acts (``actors/eval_methods.py``): ``comap`` (draft, imagine, reflect,
action gate), ``comap_oracle`` (the CoMap loop with the draft's true next state, taken on a
second environment restored to the step's state, shown in place of the world model's prediction:
an oracle world model, for evaluation only), ``react`` (a thought then an action from the state
alone: no world model, no reflection), ``imagine_and_act`` (the draft's imagined consequence, then a final action chosen
from it: no action gate), ``draft_only`` (the policy's draft executed as is), ``lookahead``
(WebEvolver's imagination engine: ``eval.lookahead_k`` sampled candidates, each imagined
``actors.lookahead.DEPTH`` steps ahead by the world model and scored by the policy as critic; the
best-scored one executed: ``actors/lookahead.py``)."""
EVAL_METHODS: tuple[str, ...] = EvalMethod.__args__


class EvalConfig(Section):
    split: str = "valid_seen"
    """Held-out split the evaluator measures every adapter version on (ALFWorld: ``env.data_dir``
    holds it). Unset, it is the environment's held-out split: valid_seen, or dev for ScienceWorld."""
    method: EvalMethod = "comap"
    """How the evaluated agent acts in the success games (and ``comap eval``'s default): the CoMap
    loop, or a baseline of the paper's main table (:data:`EvalMethod`)."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature of every model call in evaluation episodes (the policy's and the world
    model's): 0, greedy, so that a version's success rate does not hinge on one sampled game."""
    lookahead_k: int = Field(default=3, ge=1, le=16)
    """``lookahead``: candidate actions per step (sampled drafts; canonical duplicates played once)."""
    cycle_stop: int = Field(default=0, ge=0)
    """End a greedy evaluation episode (``temperature`` 0, not ``lookahead``) when its
    textual state occurs this many times (0 = off; at least 2): the steps since the previous
    occurrence would repeat to ``env.max_steps``, so the game is lost and every figure of the episode
    is extended as those steps would have gone (:mod:`actors.cycles`). In the draft's turns form
    (``env.draft_turns``), where the draft sees the whole history, the episode ends only when the
    stretches of states between the state's last ``cycle_stop`` occurrences are the same (the cycle
    already played ``cycle_stop - 1`` times with itself in the context): a measured premise
    (``experiments/studies/cycle_stop.py``; docs/findings.md: the projections had the played outcome
    in 11 of 11 recurring games)."""

    @field_validator("cycle_stop")
    @classmethod
    def _cycle_needs_a_repeat(cls, v: int) -> int:
        if v == 1:
            raise ValueError("cycle_stop is 0 (off) or at least 2 (a state must recur before a cycle is known)")
        return v

    games: int = Field(default=10, ge=1)
    """Games of the probes (world-model Delta-F1, draft accuracy along walkthroughs), drawn with the
    run seed and spread over the task types; the same games for every version."""
    failures_per_game: int = Field(default=2, ge=0)
    """Seeded non-expert transitions per probed game (the world model's failure cases)."""
    success_games: int = Field(default=10, ge=0)
    """Games played with the full CoMap loop for the success rate (``eval.envs`` at a time; slow on a
    CPU: a game is up to ``env.max_steps`` steps of 4-5 model calls); 0 = probes only. Fewer than
    ~10 cannot show a rate: one game reads 0 or 1."""
    envs: int = Field(default=4, ge=1)
    """Games the evaluator plays at once (their calls share the server's batches): it shares the
    inference servers with the actors."""
    priority: RequestPriority = 0
    """The priority of the evaluator's model calls on the servers it shares with the actors (vLLM's
    ``priority``: lower is admitted first; the actors' calls are 0). -1 puts an evaluation's calls ahead
    of the actors' waiting ones; with the embedded server's ``inference.priority_hold_s`` the actors' calls
    also wait while the evaluator's run (not only while they wait), so the evaluation takes about the time
    of its own calls while the actors wait that long, instead of both sharing the server for the whole
    evaluation. With vLLM the launcher then adds ``--scheduling-policy priority``."""
    max_share: float | None = Field(default=None, gt=0, le=1)
    """At most this share of the wall clock spent evaluating: after an evaluation of T seconds the evaluator
    rests T x (1 / share - 1) before the next (the newest version then, when more than
    ``evaluator.evaluator.MAX_PENDING`` wait). With ``priority`` and the server's hold, an evaluator that
    always has a new version to measure holds the actors' calls for good: the learner trains on the replay
    while the actors store a fifth of their rate or less (12 co-evolution transitions in 12 minutes of
    ``configs/local-quick.yaml``, docs/running.md, "A ten-minute try"). None: evaluate whenever a version
    waits. ``comap evaluator --once`` never rests."""
