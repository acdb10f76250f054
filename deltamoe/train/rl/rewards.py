"""Verifiable rewards: exact match of the answer, plus an optional reward for a well-formed answer."""

from __future__ import annotations

from collections.abc import Set


def exact_match(text: str, answer: str) -> float:
    """1 when the completion (its text before EOS) is the answer, else 0."""
    return 1.0 if text == answer else 0.0


def well_formed(text: str, finish_reason: str, alphabet: Set[str]) -> bool:
    """The completion stopped by itself (EOS) and is written in the task's answer alphabet."""
    return finish_reason == "stop" and bool(text) and all(c in alphabet for c in text)


def reward(text: str, finish_reason: str, answer: str, alphabet: Set[str], format_weight: float) -> float:
    return exact_match(text, answer) + (format_weight if well_formed(text, finish_reason, alphabet) else 0.0)
