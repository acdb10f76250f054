import random

import pytest
import torch

from deltamoe.errors import ConfigError
from deltamoe.model.model import IGNORE_INDEX
from deltamoe.train.data.task_stream import TaskStream
from deltamoe.train.data.tasks import (EVAL_BUCKETS, QUERY, Arithmetic, AssociativeRecall, Copy, Repeat, example_text,
                                       in_eval_split, make_task)
from deltamoe.train.evaluate import answer_accuracy

BOS, EOS, PAD = 256, 257, 258


def stream(task, seq_len=64, seed=0):
    return TaskStream(task, seq_len, seed, eval_rows=8, bos=BOS, eos=EOS, pad=PAD)


def examples(s: TaskStream, split: str, rows: range) -> list[tuple[str, str]]:
    """(prompt+answer text, answer text) of every example packed in the rows."""
    out = []
    for i in rows:
        ids, labels = s.row(split, i)
        assert ids[0] == BOS and len(ids) == s.seq_len
        start = 1
        for end in [j for j, t in enumerate(ids) if t == EOS]:
            text = bytes(ids[start:end]).decode()
            answer = bytes(t for t in labels[start:end] if t != IGNORE_INDEX).decode()
            out.append((text, answer))
            start = end + 1
        assert all(t == PAD for t in ids[start:]) and all(t == IGNORE_INDEX for t in labels[start:])
    return out


def test_rows_are_deterministic_in_seed_split_and_position():
    a, b = stream(Arithmetic(3)), stream(Arithmetic(3))
    assert a.rows("train", 5, 3).input_ids.equal(b.rows("train", 5, 3).input_ids)
    # Row i does not depend on which rows were read before it (random access for resume / data ranks).
    assert a.rows("train", 6, 1).input_ids.equal(b.rows("train", 4, 3).input_ids[2:])
    assert not a.rows("train", 0, 4).input_ids.equal(stream(Arithmetic(3), seed=1).rows("train", 0, 4).input_ids)
    assert not a.rows("train", 0, 4).input_ids.equal(a.rows("eval", 0, 4).input_ids)


def test_arithmetic_answers_are_the_sums():
    exs = examples(stream(Arithmetic(3)), "train", range(20))
    assert len(exs) > 60  # several problems packed per 64-token row
    for text, answer in exs:
        lhs, rhs = text.split("=")
        a, b = lhs.split("+")
        assert rhs == answer == str(int(a) + int(b))
        assert 1 <= len(a) <= 3 and 1 <= len(b) <= 3


def test_recall_answer_is_the_queried_keys_value():
    task = AssociativeRecall(num_pairs=6, num_queries=2, context_len=30)
    exs = examples(stream(task), "train", range(20))
    for text, answer in exs:
        context, queries = text.split(QUERY)
        pairs = "".join(c for c in context if c.isalnum())
        table = {pairs[i]: pairs[i + 1] for i in range(0, len(pairs), 2)}
        assert len(table) == 6 and len(context) == 30  # distinct keys, filler up to the context length
        assert len(queries) == 4 and queries[0] != queries[2]
        assert answer == table[queries[0]] + table[queries[2]] == queries[1] + queries[3]


@pytest.mark.parametrize("reverse", [False, True])
def test_copy_and_reverse(reverse):
    for text, answer in examples(stream(Copy(5, reverse=reverse)), "train", range(10)):
        src, tgt = text.split(QUERY)
        assert tgt == answer == (src[::-1] if reverse else src)


def test_repeat_answer_is_the_pattern_repeated_to_four_times_the_longest():
    exs = examples(stream(Repeat(5)), "train", range(20))
    assert {len(src) for src, _ in (t.split(QUERY) for t, _ in exs)} == {1, 2, 3, 4, 5}
    for text, answer in exs:
        src, tgt = text.split(QUERY)
        assert tgt == answer and len(answer) == 20
        assert all(answer[i] == src[i % len(src)] for i in range(20))
    assert make_task("copy+repeat", string_len=5).tasks[1] == Repeat(5)


@pytest.mark.parametrize("task", [Arithmetic(2), AssociativeRecall(4), Copy(3), Repeat(3)], ids=lambda t: t.name)
def test_eval_split_is_disjoint_from_training(task):
    s = stream(task, seq_len=48)
    train = {t for t, _ in examples(s, "train", range(300))}
    held = {t for t, _ in examples(s, "eval", range(40))}
    assert held and not train & held
    rng = random.Random(0)
    assert sum(in_eval_split(task.example(rng)) for _ in range(4000)) == pytest.approx(4000 / EVAL_BUCKETS, rel=0.25)


def test_row_too_short_for_the_task_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        stream(AssociativeRecall(num_pairs=20), seq_len=32)
    assert e.value.field == "data.seq_len" and "45" in str(e.value)


def test_answer_accuracy_counts_whole_spans_teacher_forced():
    ignore = IGNORE_INDEX
    labels = torch.tensor([[5, ignore, 7, 8, ignore, 9],
                           [1, 2, ignore, ignore, 3, 4]])
    # Prediction for position t comes from logits[t-1].
    preds = torch.tensor([[0, 7, 8, 0, 9, 0],   # span (7,8) right; span (9) right
                          [0, 0, 0, 3, 0, 0]])  # span (2) wrong; span (3,4): 3 right, 4 wrong
    logits = torch.nn.functional.one_hot(preds, 10).float()
    assert answer_accuracy(logits, labels) == (2, 4)
    # The first label (position 0) can never be predicted and is not a span.
    assert answer_accuracy(logits[:1, :2], torch.tensor([[5, 0]])) == (1, 1)
    assert answer_accuracy(logits, torch.full_like(labels, ignore)) == (0, 0)


def test_example_text_joins_segments():
    assert example_text([("12+3=", False), ("15", True)]) == "12+3=15"
