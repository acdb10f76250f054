"""Train `tiny-vision` on the synthetic shapes task; prints held-out accuracy per question.

    OMP_NUM_THREADS=2 python scripts/train_vision_shapes.py --steps 300 --save runs/shapes
    deltamoe generate runs/shapes --image some.png -p "colour?" --temperature 0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deltamoe.threads import apply_threads, choose_threads
from deltamoe.train.vision_shapes import ShapesRun, train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=ShapesRun.steps)
    p.add_argument("--batch-size", type=int, default=ShapesRun.batch_size)
    p.add_argument("--lr", type=float, default=ShapesRun.lr)
    p.add_argument("--eval-examples", type=int, default=ShapesRun.eval_examples)
    p.add_argument("--seed", type=int, default=ShapesRun.seed)
    p.add_argument("--save", type=Path, default=None, help="write a checkpoint folder here")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="write the final accuracies here")
    a = p.parse_args()
    apply_threads(choose_threads(a.threads))
    acc = train(ShapesRun(steps=a.steps, batch_size=a.batch_size, lr=a.lr, eval_examples=a.eval_examples,
                          seed=a.seed, save=a.save), log=lambda s: print(s, flush=True))
    if a.json is not None:
        a.json.write_text(json.dumps(acc, indent=2))


if __name__ == "__main__":
    main()
