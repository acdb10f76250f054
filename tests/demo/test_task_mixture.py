"""The task mixture the demo trains on (deltamoe/train/data/tasks.py TaskMixture)."""

import random

import pytest

from deltamoe.train.data.task_stream import TaskStream, draw_example
from deltamoe.train.data.tasks import QUERY, Arithmetic, AssociativeRecall, TaskMixture, in_eval_split, make_task


def test_make_task_builds_a_mixture_from_a_plus_name():
    mix = make_task("recall+arithmetic", digits=2, num_pairs=4, num_queries=4)
    assert isinstance(mix, TaskMixture) and mix.name == "recall+arithmetic"
    assert mix.tasks == (AssociativeRecall(4, 4), Arithmetic(2))
    assert mix.max_len == max(t.max_len for t in mix.tasks)
    with pytest.raises(ValueError, match="twice"):
        make_task("recall+recall")


def test_mixture_draws_from_every_task_and_keeps_the_split():
    mix = make_task("recall+arithmetic", digits=2, num_pairs=4, num_queries=4)
    rng = random.Random(0)
    texts = ["".join(t for t, _ in draw_example(mix, rng, "eval")) for _ in range(200)]
    recall = sum(QUERY in t for t in texts)
    assert 60 < recall < 140  # about half of each
    assert all(in_eval_split([(t, False)]) for t in texts)
    stream = TaskStream(mix, 32, 0, 4, bos=256, eos=257, pad=258)
    rows = stream.rows("train", 0, 8)
    assert rows.input_ids.shape == (8, 32) and stream.name == "recall+arithmetic"
