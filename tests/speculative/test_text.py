"""The incremental text decoder every stream uses: split characters, stop strings, hold-back."""

from __future__ import annotations

from speculative.text import TextStream, find_stop, held_back

# token id -> bytes: "é" is split over tokens 1 and 2; 5 and 6 spell "\ndef " in two pieces
PIECES = {0: b"x = ", 1: b"\xc3", 2: b"\xa9", 3: b"1", 4: b"\n", 5: b"\nde", 6: b"f ", 7: b"y"}


def test_a_character_split_between_tokens_appears_with_the_token_that_completes_it() -> None:
    text = TextStream(PIECES.__getitem__)
    assert text.feed([0, 1], ["target", "draft"]) == [("x = ", "target")]
    assert text.feed([2, 3], ["draft", "ngram"]) == [("é", "draft"), ("1", "ngram")]
    assert text.text == "x = é1" and not text.stopped
    assert text.kept() == [(0, "target"), (1, "draft"), (2, "draft"), (3, "ngram")]


def test_a_character_cut_by_the_end_of_the_reply_becomes_a_replacement() -> None:
    text = TextStream(PIECES.__getitem__)
    text.feed([0])
    assert text.feed([1], final=True) == [("\ufffd", "target")]
    assert text.kept() == [(0, "target"), (1, "target")]


def test_the_reply_ends_before_a_stop_string_arriving_over_several_tokens() -> None:
    text = TextStream(PIECES.__getitem__, stops=["\ndef "])
    assert text.feed([0, 3]) == [("x = ", "target"), ("1", "target")]
    assert text.feed([5], ["draft"]) == []  # "\nde" may be the start of "\ndef ": held back
    assert text.feed([6, 7], ["draft", "draft"]) == []
    assert text.stopped and text.text == "x = 1"
    assert text.kept() == [(0, "target"), (3, "target")]  # the stop's tokens are not kept
    assert text.feed([7]) == []  # nothing after the stop


def test_held_back_text_is_shown_once_it_cannot_be_a_stop() -> None:
    text = TextStream(PIECES.__getitem__, stops=["\ndef "])
    assert text.feed([0, 4]) == [("x = ", "target")]
    assert text.feed([7]) == [("\n", "target"), ("y", "target")]
    assert text.pieces() == [("x = ", "target"), ("\n", "target"), ("y", "target")]


def test_stop_helpers() -> None:
    assert find_stop("a\ndef b\nclass", ["\nclass", "\ndef "]) == 1
    assert find_stop("abc", ["\ndef "]) is None
    assert held_back("x\nde", ["\ndef ", "\nclass "]) == 3
    assert held_back("x", ["\ndef "]) == 0
