"""Process-wide caches that make TextWorld's PDDL engine ~25x faster with identical output.

Stock TextWorld 1.7 re-translates the PDDL problem to SAS on every ``reset`` (0.5-1.6 s) and
re-parses, with a PEG parser, the grammar string of every admissible command's template on
every ``step`` (75-150 ms). Both are pure functions of their input strings, so they are
memoised here:

* ``fast_downward.pddl2sas(domain, problem, optimize)`` -> ``(task, sas)``: the task object is
  only read after translation (PddlState takes types, objects, actions and init from it);
* the text-generation parser behind ``ContextSensitiveGrammar.derive``: derive mutates the
  parsed symbols (it attaches contexts), so the cache hands out deep copies;
* ``copy_context``, which deep-copied entity infos for every derived symbol, copies the two
  dicts that derivation extends and shares their immutable values;
* ``Rule.parse_conjunctive_query`` (grammar conditions and list queries), an immutable Rule;
* ``GameLogic(domain, grammar)``: the game's whole grammar, parsed once per game text.

These patch module attributes for the whole process, which is why environments live in worker
processes that install them at start (:func:`install`); the translation also rewrites
``sys.argv`` and swaps ``sys.stdout``, which the cached wrapper restores. A test checks that
observations, admissible commands and wins are the same as without the caches.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections import OrderedDict
from typing import Any

_installed = False
_GAME_LOGIC_CACHE_SIZE = 64


def install() -> None:
    """Install the caches in this process (idempotent)."""
    global _installed
    if _installed:
        return
    import fast_downward
    import textworld.logic
    from textworld.envs.pddl import logic as pddl_logic
    from textworld.envs.pddl import pddl as pddl_env
    from textworld.envs.pddl import textgen

    original_pddl2sas = fast_downward.pddl2sas

    @functools.lru_cache(maxsize=256)
    def _translate(domain: str, problem: str, optimize: bool) -> Any:
        argv = sys.argv
        try:
            return original_pddl2sas(domain, problem, verbose=False, optimize=optimize)
        finally:
            sys.argv = argv

    def cached_pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False) -> Any:
        return _translate(domain, problem, bool(optimize))

    fast_downward.pddl2sas = cached_pddl2sas

    original_textgen_parse = textgen._parse_and_convert

    @functools.lru_cache(maxsize=4096)
    def _parsed_symbols(text: str, rule_name: str) -> Any:
        return original_textgen_parse(text, rule_name=rule_name)

    def cached_textgen_parse(text: str, rule_name: str = "symbols", **kwargs: Any) -> Any:
        if kwargs.get("trace"):  # TW_CSG_TRACE debugging wants the parser itself to run
            return original_textgen_parse(text, rule_name=rule_name, **kwargs)
        return copy.deepcopy(_parsed_symbols(text, rule_name))

    textgen._parse_and_convert = cached_textgen_parse

    def shallow_copy_context(context: dict[str, Any]) -> dict[str, Any]:
        # derive() only adds keys to `variables`/`mapping` (dict.update); the EntityInfo,
        # Placeholder and Variable values are never mutated, so fresh dicts are enough
        return {
            "state": context["state"],
            "facts": context["facts"],
            "variables": dict(context["variables"]),
            "mapping": dict(context["mapping"]),
            "entity_infos": context["entity_infos"],
        }

    textgen.copy_context = shallow_copy_context

    rule_cls = textworld.logic.Rule
    original_query = rule_cls.parse_conjunctive_query.__func__
    rule_cls.parse_conjunctive_query = classmethod(functools.lru_cache(maxsize=4096)(original_query))

    original_game_logic = pddl_logic.GameLogic
    logic_cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def cached_game_logic(domain: str, grammar: str) -> Any:
        key = (domain, grammar)
        logic = logic_cache.get(key)
        if logic is None:
            logic = logic_cache[key] = original_game_logic(domain=domain, grammar=grammar)
            if len(logic_cache) > _GAME_LOGIC_CACHE_SIZE:
                logic_cache.popitem(last=False)
        else:
            logic_cache.move_to_end(key)
        return logic

    # PddlEnv.load looks the class up through the logic module at call time
    pddl_env.pddl_logic.GameLogic = cached_game_logic  # type: ignore[attr-defined]
    _installed = True


def installed() -> bool:
    return _installed
