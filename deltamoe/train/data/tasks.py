"""Built-in synthetic tasks: each example is text segments, some of them the answer to score.

Examples are drawn from a `random.Random`; the stream that owns the generator makes them
deterministic in (seed, split, row). Train and eval are disjoint by construction: an example
belongs to the eval split iff the CRC32 of its text falls in one bucket of EVAL_BUCKETS, and
each split rejects the other's examples. (A different seed stream alone would not be enough:
short arithmetic problems recur.)
"""

from __future__ import annotations

import random
import string
import zlib
from dataclasses import dataclass
from typing import Protocol

EVAL_BUCKETS = 16
Segment = tuple[str, bool]  # (text, is_answer)

KEYS = string.ascii_letters  # 52 single-byte keys
VALUES = string.digits  # values repeat across keys; chance accuracy is 10 %
FILLER = " .,;:-_~"  # disjoint from keys, values and the query marker
QUERY = "|"
REPEAT_FACTOR = 4  # a repeat answer is this many times the longest pattern


class Task(Protocol):
    name: str

    @property
    def max_len(self) -> int:
        """The longest example in bytes."""
        ...

    def example(self, rng: random.Random) -> list[Segment]: ...


def example_text(segments: list[Segment]) -> str:
    return "".join(text for text, _ in segments)


def in_eval_split(segments: list[Segment]) -> bool:
    return zlib.crc32(example_text(segments).encode()) % EVAL_BUCKETS == 0


@dataclass(frozen=True)
class Arithmetic:
    """`a+b=` -> the decimal sum; operands have 1..digits digits."""

    digits: int = 3
    name: str = "arithmetic"

    @property
    def max_len(self) -> int:
        return 2 * self.digits + 2 + self.digits + 1  # "a+b=" and a sum one digit longer

    def example(self, rng: random.Random) -> list[Segment]:
        a, b = (rng.randrange(10 ** rng.randint(1, self.digits)) for _ in range(2))
        return [(f"{a}+{b}=", False), (str(a + b), True)]


@dataclass(frozen=True)
class AssociativeRecall:
    """Multi-query associative recall (Zoology MQAR), one byte per key and value.

    `num_pairs` key/value pairs with distinct keys, spread over `context_len` tokens by random
    filler bytes, then `|` and `num_queries` distinct keys, each followed by its value (scored).
    The answer is only recoverable by looking back at the pair: values are uniform and
    independent of the key.
    """

    num_pairs: int = 8
    num_queries: int = 1
    context_len: int | None = None
    name: str = "recall"

    def __post_init__(self) -> None:
        if self.num_pairs > len(KEYS):
            raise ValueError(f"num_pairs: at most {len(KEYS)} distinct one-byte keys, got {self.num_pairs}")

    @property
    def max_len(self) -> int:
        return max(self.context_len or 0, 2 * self.num_pairs) + len(QUERY) + 2 * self.num_queries

    def example(self, rng: random.Random) -> list[Segment]:
        keys = rng.sample(KEYS, self.num_pairs)
        values = [rng.choice(VALUES) for _ in keys]
        pairs = [k + v for k, v in zip(keys, values)]
        fill = max(0, (self.context_len or 0) - 2 * self.num_pairs)
        # Scatter the filler into the num_pairs + 1 gaps around the pairs.
        gaps = [0] * (self.num_pairs + 1)
        for _ in range(fill):
            gaps[rng.randrange(len(gaps))] += 1
        context = "".join("".join(rng.choice(FILLER) for _ in range(g)) + p for g, p in zip(gaps, pairs + [""]))
        segments: list[Segment] = [(context + QUERY, False)]
        for i in rng.sample(range(self.num_pairs), self.num_queries):
            segments += [(keys[i], False), (values[i], True)]
        return segments


@dataclass(frozen=True)
class Copy:
    """`abc|` -> `abc` (or `cba` when reversed); 1..string_len lowercase letters."""

    string_len: int = 8
    reverse: bool = False

    @property
    def name(self) -> str:
        return "reverse" if self.reverse else "copy"

    @property
    def max_len(self) -> int:
        return 2 * self.string_len + len(QUERY)

    def example(self, rng: random.Random) -> list[Segment]:
        s = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, self.string_len)))
        return [(s + QUERY, False), (s[::-1] if self.reverse else s, True)]


@dataclass(frozen=True)
class Repeat:
    """`abc|` -> `abcabcabcab...`: a pattern of 1..string_len lowercase letters repeated to
    REPEAT_FACTOR * string_len letters. Past its first period every answer byte is a copy of the
    byte one period back: a long, fully predictable continuation (what speculative drafts exploit)."""

    string_len: int = 8
    name: str = "repeat"

    @property
    def length(self) -> int:
        return REPEAT_FACTOR * self.string_len

    @property
    def max_len(self) -> int:
        return self.string_len + len(QUERY) + self.length

    def example(self, rng: random.Random) -> list[Segment]:
        s = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, self.string_len)))
        return [(s + QUERY, False), ((s * self.length)[:self.length], True)]


@dataclass(frozen=True)
class TaskMixture:
    """Several tasks in one stream: each example comes from one of `tasks`, chosen uniformly.

    Named by its parts joined with `+` ("recall+arithmetic"); the held-out split still works
    per example, since it only looks at the example's text.
    """

    tasks: tuple[Task, ...]

    @property
    def name(self) -> str:
        return "+".join(t.name for t in self.tasks)

    @property
    def max_len(self) -> int:
        return max(t.max_len for t in self.tasks)

    def example(self, rng: random.Random) -> list[Segment]:
        return self.tasks[rng.randrange(len(self.tasks))].example(rng)


def make_task(name: str, *, digits: int = 3, num_pairs: int = 8, num_queries: int = 1,
              context_len: int | None = None, string_len: int = 8) -> Task:
    """A built-in task by name; "a+b" names a TaskMixture of tasks a and b with the same settings."""
    if "+" in name:
        parts = name.split("+")
        if len(set(parts)) != len(parts):
            raise ValueError(f"task: {name!r} names a task twice")
        return TaskMixture(tuple(make_task(n, digits=digits, num_pairs=num_pairs, num_queries=num_queries,
                                           context_len=context_len, string_len=string_len) for n in parts))
    if name == "arithmetic":
        return Arithmetic(digits)
    if name == "recall":
        return AssociativeRecall(num_pairs, num_queries, context_len)
    if name in ("copy", "reverse"):
        return Copy(string_len, reverse=name == "reverse")
    if name == "repeat":
        return Repeat(string_len)
    raise ValueError(f"unknown task {name!r}")
