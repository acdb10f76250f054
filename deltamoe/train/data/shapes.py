"""A synthetic image task drawn with Pillow: shapes on a canvas, and a question about them.

Each example is one image (a `size` x `size` white canvas with filled shapes: square, circle or
triangle, each in one of four colours, never overlapping) and one of three questions, answered
in a word:
- `count?`  -> how many shapes, 1-3 drawn ("1", "2", "3");  chance 1/3
- `colour?` -> the colour of the one shape drawn;           chance 1/4
- `where?`  -> which half the one shape's centre is in ("left" / "right"); chance 1/2
The answer is only in the pixels, so text alone stays at chance. Deterministic in (seed, index);
the eval split is a disjoint index range (`split_offset`) of the same generator.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30)}
KINDS = ("square", "circle", "triangle")
QUESTIONS = ("count?", "colour?", "where?")
EVAL_OFFSET = 10**9  # eval examples come from indices past this: never seen in training


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    box: tuple[int, int, int, int]  # x0, y0, x1, y1


@dataclass(frozen=True)
class ShapesExample:
    image: object  # PIL.Image (RGB)
    question: str
    answer: str


@dataclass(frozen=True)
class ShapesTask:
    size: int = 64
    max_shapes: int = 3
    name: str = "shapes"

    def example(self, index: int, seed: int = 0, split: str = "train") -> ShapesExample:
        rng = random.Random(f"{self.name}:{seed}:{index + (EVAL_OFFSET if split == 'eval' else 0)}")
        question = rng.choice(QUESTIONS)
        shapes = self._shapes(rng, rng.randint(1, self.max_shapes) if question == "count?" else 1)
        if question == "count?":
            answer = str(len(shapes))
        elif question == "colour?":
            answer = shapes[0].colour
        else:
            answer = "left" if (shapes[0].box[0] + shapes[0].box[2]) / 2 < self.size / 2 else "right"
        return ShapesExample(self.draw(shapes), question, answer)

    def _shapes(self, rng: random.Random, n: int) -> list[Shape]:
        shapes: list[Shape] = []
        while len(shapes) < n:
            side = rng.randint(self.size // 6, self.size // 3)
            x0, y0 = rng.randint(0, self.size - side), rng.randint(0, self.size - side)
            box = (x0, y0, x0 + side, y0 + side)
            if any(_overlap(box, s.box) for s in shapes):
                continue
            shapes.append(Shape(rng.choice(KINDS), rng.choice(list(COLOURS)), box))
        return shapes

    def draw(self, shapes: list[Shape]):
        from PIL import Image, ImageDraw

        img = Image.new("RGB", (self.size, self.size), (255, 255, 255))
        pen = ImageDraw.Draw(img)
        for s in shapes:
            fill = COLOURS[s.colour]
            x0, y0, x1, y1 = s.box
            if s.kind == "square":
                pen.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
            elif s.kind == "circle":
                pen.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
            else:
                pen.polygon([((x0 + x1) / 2, y0), (x0, y1 - 1), (x1 - 1, y1 - 1)], fill=fill)
        return img


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
