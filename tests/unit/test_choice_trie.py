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
