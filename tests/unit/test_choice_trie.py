"""Decoding to a list of choices: the trie's next tokens and the request field's validation."""

from __future__ import annotations

import pytest

from comap_async.inference.choices import ChoiceTrie, parse_choices

END = 0


def test_next_tokens_follow_the_choices_and_end_where_one_is_complete():
    trie = ChoiceTrie([[5, 6], [5, 6, 7], [8]], [END])
    assert sorted(trie.allowed([])) == [5, 8]
    assert trie.allowed([5]) == [6]
    assert sorted(trie.allowed([5, 6])) == [END, 7]  # "fridge 1" complete, "fridge 10" goes on
    assert trie.allowed([5, 6, 7]) == [END]
    assert trie.allowed([8]) == [END]
    assert trie.allowed([9]) == []


def test_forced_tokens_run_while_one_token_is_allowed_and_stop_after_a_sole_end():
    trie = ChoiceTrie([[5, 6], [5, 6, 7], [8], [9, 1, 2, 3]], [END])
    assert trie.forced([], 4) == []  # 5, 8 or 9
    assert trie.forced([5], 4) == [6]  # then "fridge 1" may end or go on to "fridge 10"
    assert trie.forced([5, 6, 7], 4) == [END]
    assert trie.forced([9], 2) == [1, 2]  # at most k
    assert trie.forced([9], 8) == [1, 2, 3, END]  # nothing after the end
    assert trie.forced([4], 4) == []  # off the trie
    assert ChoiceTrie([[5]], [END, 1]).forced([5], 4) == []  # two end tokens: the model picks one


def test_a_trie_needs_an_end_token():
    with pytest.raises(ValueError, match="end-of-sequence"):
        ChoiceTrie([[1]], [])


@pytest.mark.parametrize(
    "body, message",
    [
        ({"structured_outputs": []}, "must be an object"),
        ({"structured_outputs": {"choice": []}}, "list of 1 to"),
        ({"structured_outputs": {"choice": ["a", ""]}}, "non-empty strings"),
        ({"structured_outputs": {"choice": ["a", 3]}}, "non-empty strings"),
        ({"structured_outputs": {"regex": "a+"}}, "not regex"),
        ({"guided_choice": ["a"]}, "removed in vLLM 0.12"),
    ],
)
def test_unsupported_or_malformed_choice_requests_say_what_is_wrong(body, message):
    with pytest.raises(ValueError, match=message):
        parse_choices(body)


def test_choices_are_read_in_order_without_duplicates():
    assert parse_choices({"prompt": "x"}) is None
    body = {"structured_outputs": {"choice": ["look", "go to desk 1", "look"]}}
    assert parse_choices(body) == ("look", "go to desk 1")
