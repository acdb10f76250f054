"""Verifiable rewards: exact match of the answer, plus an optional reward for a well-formed answer."""

from __future__ import annotations

from collections.abc import Set


def exact_match(text: str, answer: str) -> float:
    """1 when the completion's text (before EOS, which the engine leaves out) is the answer, else 0."""
    return 1.0 if text == answer else 0.0


def well_formed(text: str, finish_reason: str, expected_finish: str, alphabet: Set[str]) -> bool:
    """The completion ended as the format says (`expected_finish`: "stop" for EOS, "length" for a
    completion cut at the answer's length) and is written in the task's answer alphabet."""
    return finish_reason == expected_finish and bool(text) and all(c in alphabet for c in text)


def reward(text: str, finish_reason: str, answer: str, expected_finish: str, alphabet: Set[str],
           format_weight: float) -> float:
    ok = well_formed(text, finish_reason, expected_finish, alphabet)
    return exact_match(text, answer) + (format_weight if ok else 0.0)
