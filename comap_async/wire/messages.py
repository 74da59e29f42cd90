"""Every message and stored record, declared once (docs/design.md section 4), with the names they use.

Messages are msgspec ``Struct``s tagged by ``type``; on the wire each is a flat msgpack map
``{"type": <tag>, "v": SCHEMA_VERSION, ...fields}`` (the same maps as schema version 1's hand-written
validator accepted, so older peers still read them). The annotations are the validation: string
and list limits, integer range, finite numbers, allowed values. Decoding and validating happen in
one C pass (:mod:`comap_async.wire.protocol`); a process reads fields by name (``tr.s_hat``).

Also here: the roles, phases and decisions every process names, and the adapter-name format.
"""

from __future__ import annotations

import math
import sys
from typing import Annotated, Any, Literal, Union, get_args

import msgspec
from msgspec import Meta, Struct

SCHEMA_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20

ID_LEN = 256  # ids, names, game paths
TEXT_LEN = 64 * 1024  # observations, predictions, prompts
MAX_ITEMS = 4096  # list/map entries in one message

# ---- names -------------------------------------------------------------------------------------

Phase = Literal["warmup", "reflect_init", "coevolve"]
"""The learner's phases (docs/design.md section 6): world-model warm-up on expert play, reflection-mode
initialisation, then co-evolution."""
PHASES: tuple[str, ...] = get_args(Phase)
WARMUP, REFLECT_INIT, COEVOLVE = PHASES

Decision = Literal["KEEP", "REVISE"]
DECISIONS: tuple[str, ...] = get_args(Decision)
KEEP, REVISE = DECISIONS

Store = Literal["transitions", "reflections", "demos", "episodes", "imagined"]
STORES: tuple[str, ...] = get_args(Store)

ReflectionLabel = Literal["expert_better", "expert_sooner", "equal_draft", "not_better"]
"""Why a reflection-initialisation sample got its label: ``y = 1`` for ``expert_better`` (the
expert's branch wins, the draft's does not) and ``expert_sooner`` (both win, the expert's in fewer
steps: the larger discounted return; counted apart, docs/design.md section 12)."""
REFLECTION_LABELS: tuple[str, ...] = get_args(ReflectionLabel)

Role = Literal["policy", "wm", "wm_teacher"]
"""The three adapters: the policy, the world model (student) and its EMA teacher."""
ROLES: tuple[str, ...] = get_args(Role)
POLICY, WM, WM_TEACHER = ROLES


def adapter_name(role: str, version: int, prefix: str = "") -> str:
    """The served (and on-disk) name of ``role``'s adapter ``version``: ``policy-v3``."""
    return f"{prefix}{role}-v{version}"


def _split_version(name: str) -> tuple[str, int | None]:
    """``policy-v3`` -> (``policy``, 3); a name without a ``-v<digits>`` ending -> (name, None)."""
    head, sep, tail = name.rpartition("-v")
    return (head, int(tail)) if sep and tail.isdigit() else (name, None)


def adapter_family(name: str) -> str:
    """An adapter name without its version (``eval-policy-v3`` -> ``eval-policy``): what the server's
    per-adapter counters are labelled by, so that versions of one role add up; other names as they are."""
    return _split_version(name)[0]


def adapter_version(name: str | None) -> int:
    """The version an adapter name denotes (``adapter_name``'s inverse); 0 for the base model or
    a name that is not an adapter's."""
    return (_split_version(name)[1] or 0) if name else 0


# ---- field types -------------------------------------------------------------------------------

_MAX_FLOAT = sys.float_info.max
Id = Annotated[str, Meta(max_length=ID_LEN)]
Text = Annotated[str, Meta(max_length=TEXT_LEN)]
Int = Annotated[int, Meta(ge=-(1 << 62), le=1 << 62)]
Num = Annotated[float, Meta(ge=-_MAX_FLOAT, le=_MAX_FLOAT)]  # finite: NaN and infinities fail the bounds
Confidence = Annotated[float, Meta(ge=0.0, le=1.0)]
"""A probability-like score in [0, 1]."""
Map = Annotated[dict[str, Any], Meta(max_length=MAX_ITEMS)]
Facts = Annotated[list[Id], Meta(max_length=MAX_ITEMS)]


def _finite(value: Any, where: str, depth: int = 0) -> None:
    """Refuse a non-finite number anywhere in a free-form map (NaN and infinities are not JSON: the
    broker's ``/stats`` and ``/records`` would emit them); ``Num`` fields already refuse them. A map
    key that is not a string is refused too: JSON has no other, and the broker's stores read maps
    back with string keys only, so one stored int key (a histogram) would fail every later read."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: non-finite number {value!r}")
    if depth < 16 and isinstance(value, dict):
        for k, v in value.items():
            if type(k) is not str:
                raise ValueError(f"{where}.{str(k)[:40]}: map keys must be strings, got {type(k).__name__}")
            _finite(v, f"{where}.{k}", depth + 1)
    elif depth < 16 and isinstance(value, list):
        for i, v in enumerate(value):
            _finite(v, f"{where}[{i}]", depth + 1)


class _FiniteMaps:
    """Checks the struct's :data:`Map` fields (``_maps``) with :func:`_finite` on every decode (finite
    numbers, string keys)."""

    _maps: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in self._maps:
            _finite(getattr(self, name), name)


class Message(Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    """A wire message: its tag is ``type``; ``v`` is the schema version (another version is refused)."""

    v: Literal[SCHEMA_VERSION] = SCHEMA_VERSION  # type: ignore[valid-type]


class Registry(Struct, forbid_unknown_fields=True, kw_only=True):
    """Which adapters are live and the phase: every ack carries it, the learner's announce sets it."""

    phase: Phase = WARMUP
    versions: dict[Role, Annotated[int, Meta(ge=0, le=1 << 62)]] = msgspec.field(
        default_factory=lambda: dict.fromkeys(ROLES, 0)
    )
    adapters: dict[Role, Annotated[str, Meta(min_length=1, max_length=ID_LEN)]] = msgspec.field(default_factory=dict)
    step: Int = 0
    method: Annotated[str, Meta(max_length=64)] = ""
    """The broker's method fingerprint (:mod:`comap_async.method.fingerprint`): learner and actors
    refuse to run against another; empty where no broker set it."""

    @classmethod
    def serving(cls, version: int, prefix: str = "") -> Registry:
        """Every role on its adapter ``version`` (``prefix``: served under other names, e.g. the
        evaluator's copies), or on the base model for version 0; the CoMap loop's phase."""
        return cls(
            phase=COEVOLVE,
            versions=dict.fromkeys(ROLES, version),
            adapters={r: adapter_name(r, version, prefix) for r in ROLES} if version else {},
        )


# ---- actor -> broker ---------------------------------------------------------------------------

MAX_TURNS = 256  # (action, observation) pairs in one TurnDemos or Dialogue: above any env.max_steps a run uses


class Dialogue(Struct, forbid_unknown_fields=True, kw_only=True):
    """The draft's conversation at a step (``env.reflect_turns``, ``env.wm_turns``): the task, the first
    observation and the (action, observation) turns before the step, which the reflection's prompt
    continues and the world model's renders as its own (:class:`comap_async.prompts.Conversation`; stored
    in a record as a map of these three fields)."""

    task: Text
    first: Text
    turns: Annotated[list[tuple[Text, Text]], Meta(max_length=MAX_TURNS)]


class Transition(Message, tag="transition", kw_only=True):
    """One environment step ``(s, a_draft, ŝ, a_exec, s')`` with the reflection and the gate inputs."""

    seq: Int
    """The actor's outbox sequence number (acks name it)."""
    id: Id
    actor: Id
    env: Id
    game: Id
    split: Id
    episode: Id
    t: Int
    o: Text
    """The raw observation at t (``s`` is the rendered state with history)."""
    phase: Phase
    goal: Text
    s: Text
    a_draft: Text
    s_hat: Text
    """The world model's prediction for the draft, ``ŝ = WM(s, a_draft)``."""
    decision: Decision
    a_ref: Text
    p_revise: Num
    q_ref: Num
    a_exec: Text
    s_hat_exec: Text
    """The student's prediction for the executed action (the draft's ``ŝ`` when not revised)."""
    s_hat_teacher: Text
    """The EMA teacher's prediction for the executed action."""
    s_next: Text
    reward: Num
    done: bool
    won: bool
    expert_action: Text | None
    policy_version: Int
    wm_version: Int
    ts: Num
    facts: Facts
    """Canonical facts of the state before the action, ``C(s_t)`` (docs/design.md section 11): the
    world-state gate applies each prediction to it."""
    explore: bool = False
    """Warm-up only: a non-expert action executed for the world model (no demonstration)."""
    recovery: bool = False
    """Warm-up only: the expert's action from the off-path state an ``explore`` action left (a
    demonstration of getting back on track, and a real transition)."""
    step_demo: bool = True
    """Warm-up only: the broker stores ``(s, a_exec)`` as a demonstration. False with
    ``env.draft_turns``: the actor sends the episode's demonstrations as :class:`TurnDemos` instead."""
    reflection_readable: bool = True
    """False: the policy's reflection gave no decision probability or no final action (the draft was
    executed); the broker stores the transition for the world model and derives no reflection sample."""
    draft_confidence: Confidence | None = None
    """The draft's geometric-mean token probability, shown in the reflection prompt
    (``actor.reflect_confidence``); None: not measured, the prompt shows nothing."""
    s_next_draft: Text | None = None
    """Co-evolution, on a step whose executed action is not the draft: the draft's own real next
    observation, taken by the actor on a branch restored to the step's state. The reflection sample
    shows it as ``s̄`` when the world-state gate does not trust the imagined state (the paper's
    "else the real one": the real future of the action reflected on). None on other steps, and where
    the branch could not be restored (the sample then shows the imagined state)."""
    ws_score: Confidence | None = None
    """The world-state gate's reliability of the executed action, measured by the actor on its fact
    state (:func:`comap_async.method.gates.world_state_score`); None where no teacher predicted
    (warm-up). The broker applies the threshold, so it never parses environment text."""
    dialogue: Dialogue | None = None
    """``env.reflect_turns`` / ``env.wm_turns``: the episode's conversation before this step, what the
    reflection and the world model saw instead of ``s`` (None: they saw ``s``)."""


class Episode(_FiniteMaps, Message, tag="episode", kw_only=True):
    """The end of an episode."""

    _maps = ("metrics",)
    seq: Int
    id: Id
    actor: Id
    env: Id
    game: Id
    split: Id
    phase: Phase
    eval: bool
    steps: Int
    won: bool
    reward: Num
    policy_version: Int
    wm_version: Int
    wall_s: Num
    ts: Num
    metrics: Map = msgspec.field(default_factory=dict)


class Reflection(Message, tag="reflection", kw_only=True):
    """A reflection sample labelled by suffix rollouts (reflection-mode initialisation)."""

    seq: Int
    id: Id
    actor: Id
    game: Id
    s: Text
    a_draft: Text
    s_bar: Text
    target: Text
    y: Literal[0, 1]
    policy_version: Int
    wm_version: Int
    ts: Num
    label: ReflectionLabel
    draft_confidence: Confidence | None = None
    """As :attr:`Transition.draft_confidence` (None on a pair's expert-action draft: not sampled)."""
    dialogue: Dialogue | None = None
    """As :attr:`Transition.dialogue`: the conversation at ``s`` (``env.reflect_turns``)."""


class Imagined(Message, tag="imagined", kw_only=True):
    """One step of an imagined episode (WebEvolver's world model as a virtual environment,
    ``actor.imagined_rollouts``): from a real state, the policy acted and the world model answered;
    ``s`` is the state the policy saw (the real history, then the imagined pairs before this step),
    ``target`` the policy's action there. No environment step was taken: the broker stores it apart, for
    the policy's draft training only (``comap_async.method.phases.IMAGINED_DEMO_SHARE``), never for the
    world model."""

    seq: Int
    id: Id
    actor: Id
    game: Id
    episode: Id
    t: Int
    """The real step the imagined episode started from."""
    k: Int
    """This step's depth in the imagined episode (0: the real state)."""
    goal: Text
    s: Text
    target: Text
    score: Num | None
    """The policy-as-critic's score of the whole imagined episode (``None``: not scored, no filter)."""
    policy_version: Int
    wm_version: Int
    ts: Num


class TurnDemos(Message, tag="turn_demos", kw_only=True):
    """Warm-up with ``env.draft_turns`` (and its imagined episodes, ``imagined``): one played path as chat
    turns (the draft's prompt form, :class:`comap_async.prompts.Conversation`), the actions to learn
    marked: a walkthrough (every action), or a recovery branch (the path to step t, the exploratory action
    as context, then the expert's action from the state it left: the path's actions are learned again).
    The learner trains the whole path as one sequence, loss on the marked actions; the ``demos``
    store keeps it as sent (the learner tells it from a :class:`Demo` by ``turns``)."""

    seq: Int
    id: Id
    actor: Id
    game: Id
    episode: Id
    goal: Text
    first: Text
    """The first observation (after reset)."""
    turns: Annotated[list[tuple[Text, Text]], Meta(max_length=MAX_TURNS)]
    """(action, the observation it got), in order."""
    targets: Annotated[list[bool], Meta(max_length=MAX_TURNS)]
    """Per turn: its action is a demonstration (else context: an exploratory action)."""
    recovery: bool = False
    imagined: bool = False
    """An imagined episode in the turns form (``actor.imagined_rollouts``): the real turns to the step it
    started from as context, then the policy's imagined actions (the targets) with the world model's
    answers. The broker files it in the ``imagined`` store (draft data only, like :class:`Imagined`)."""
    score: Num | None = None
    """An imagined episode's critic score (``None``: not scored, or not imagined)."""
    policy_version: Int
    wm_version: Int
    ts: Num

    def __post_init__(self) -> None:
        if len(self.targets) != len(self.turns) or not any(self.targets):
            raise ValueError("turn_demos: one target flag per turn, and at least one target")


ActorMessage = Union[Transition, Episode, Reflection, Imagined, TurnDemos]


# ---- broker -> actor ---------------------------------------------------------------------------


class Ack(Message, tag="ack", kw_only=True):
    """Stored (after commit) or refused. ``retry`` (when not ok): True = temporary (storage refused;
    keep and resend later), False = the message itself is bad (resending cannot help)."""

    seq: Int
    ok: bool
    error: Id | None
    registry: Registry
    retry: bool = False


# ---- learner / evaluator <-> broker ------------------------------------------------------------


class Sample(Message, tag="sample", kw_only=True):
    """Up to ``n`` items of a store; ``phases``: only items produced in these phases (default: all,
    i.e. any item; a reflection sample without a phase counts as ``reflect_init``)."""

    req: Int
    store: Store
    n: Int
    seed: Int | None = None
    phases: Annotated[list[Phase], Meta(max_length=len(PHASES))] = msgspec.field(default_factory=lambda: list(PHASES))


class Announce(_FiniteMaps, Message, tag="announce", kw_only=True):
    """Replace the broker's registry (adapters live everywhere); ``metrics``: the learner's scalars."""

    _maps = ("versions", "adapters", "metrics")
    req: Int
    phase: Phase
    versions: Map
    adapters: Map
    step: Int
    metrics: Map = msgspec.field(default_factory=dict)


class GetRegistry(Message, tag="get_registry", kw_only=True):
    req: Int


class EvalResult(_FiniteMaps, Message, tag="eval_result", kw_only=True):
    """Held-out results of one adapter version (kept in the replay's meta)."""

    _maps = ("result",)
    req: Int
    version: Int
    result: Map


class GetStats(Message, tag="get_stats", kw_only=True):
    req: Int


class Batch(Message, tag="batch", kw_only=True):
    """Sampled items (stored records, maps) for a learner."""

    req: Int
    store: Store
    items: Annotated[list[dict[str, Any]], Meta(max_length=MAX_ITEMS)]
    stale_skipped: Int
    available: Int


class Reply(Message, tag="reply", kw_only=True):
    req: Int
    ok: bool
    error: Id | None
    data: Map


LearnerRequest = Union[Sample, Announce, GetRegistry, EvalResult, GetStats]
AnyMessage = Union[
    Transition,
    Episode,
    Reflection,
    Imagined,
    TurnDemos,
    Ack,
    Sample,
    Announce,
    GetRegistry,
    EvalResult,
    GetStats,
    Batch,
    Reply,
]
ACTOR_TYPES = (Transition, Episode, Reflection, Imagined, TurnDemos)


# ---- stored records (broker -> LMDB -> learner) ------------------------------------------------


class Record(Struct, kw_only=True):
    """A record the broker derives and stores (packed as a plain map; learners read it by name)."""


class Demo(Record, kw_only=True):
    """``(s, expert action)`` from a warm-up step, the policy's draft anchor."""

    id: str
    game: str
    goal: str
    s: str
    target: str
    policy_version: int
    wm_version: int
    source: Literal["expert", "imagined"] = "expert"
    """``imagined``: the policy's own action in an imagined episode (:class:`Imagined`), kept by its filter."""
    ts: float


class PolicySample(Record, kw_only=True):
    """The policy's reflection sample ``(s, a_draft, s̄, target, y)`` the two gates derive from a
    transition (:func:`comap_async.method.gates.derive_policy_sample`); gate scores kept for analysis."""

    id: str
    game: str
    s: str
    a_draft: str
    s_bar: str
    target: str
    y: int
    ws_score: float
    ws_imagined: bool
    ag_reason: str
    policy_version: int
    wm_version: int
    source: Literal["gate"] = "gate"
    phase: str = ""
    draft_confidence: float | None = None
    """The transition's (:attr:`Transition.draft_confidence`)."""
    dialogue: Dialogue | None = None
    """The transition's (:attr:`Transition.dialogue`)."""
    ts: float = 0.0
    """The transition's stamp: ``comap fork`` keeps what was stored up to its fork point by it
    (0.0: a sample stored before samples carried one)."""
