"""The synthetic shapes task: deterministic, answers read off the drawn pixels, eval disjoint from
train, and (slow) `tiny-vision` learns it from the images."""

import pytest

from deltamoe.train.data.shapes import COLOURS, QUESTIONS, ShapesTask


def test_examples_are_deterministic_and_answers_match_the_pixels():
    task = ShapesTask()
    seen = set()
    for i in range(60):
        ex = task.example(i, seed=3)
        again = task.example(i, seed=3)
        assert (ex.question, ex.answer, ex.image.tobytes()) == (again.question, again.answer, again.image.tobytes())
        assert ex.question in QUESTIONS and ex.image.size == (64, 64)
        colours = {c for c in ex.image.getdata() if c != (255, 255, 255)}
        if ex.question == "colour?":
            assert COLOURS[ex.answer] in colours
        elif ex.question == "count?":
            assert 1 <= int(ex.answer) <= 3
        else:
            assert ex.answer in ("left", "right")
        seen.add((ex.question, ex.answer))
    assert len(seen) >= 8  # every question with several answers
    train = {task.example(i).image.tobytes() for i in range(40)}
    assert not train & {task.example(i, split="eval").image.tobytes() for i in range(40)}


@pytest.mark.slow
def test_tiny_vision_learns_shapes_from_pixels():
    from deltamoe.train.vision_shapes import CHANCE, ShapesRun, train

    acc = train(ShapesRun(steps=500, eval_examples=240, eval_every=500), log=lambda _: None)
    assert acc["colour?"] >= CHANCE["colour?"] + 0.2, acc
    assert acc["all"] >= 0.42, acc  # chance over the three questions: 36 %
