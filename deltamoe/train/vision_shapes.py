"""Train a model with a vision tower (the `tiny-vision` preset) on the synthetic shapes task and
report held-out accuracy per question: a check, in minutes on a CPU, that images reach the model
and that it learns from them (text alone stays at chance).

One sequence per example: the image's placeholder tokens, the question, the answer, EOS; the loss
is on the answer and EOS only. Vision tower, projector and language model train together through
the one `DeltaMoEForCausalLM.forward(..., images=...)`. Accuracy is teacher-forced: an example is
right when every answer token is the argmax. `python scripts/train_vision_shapes.py --help`.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from deltamoe.model.model import IGNORE_INDEX, DeltaMoEForCausalLM
from deltamoe.train.data.shapes import QUESTIONS, ShapesExample, ShapesTask
from deltamoe.tokenizers.byte import ByteTokenizer
from deltamoe.vision.preprocess import prepare_image

CHANCE = {"count?": 1 / 3, "colour?": 1 / 4, "where?": 1 / 2}


@dataclass(frozen=True)
class ShapesRun:
    preset: str = "tiny-vision"
    steps: int = 300
    batch_size: int = 16
    lr: float = 2e-3
    warmup: int = 20
    eval_examples: int = 240
    eval_every: int = 100
    seed: int = 0
    save: Path | None = None  # a checkpoint folder for `deltamoe generate --image` / `chat`


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T], right-padded
    labels: torch.Tensor  # [B, T], IGNORE_INDEX outside answer + EOS
    images: list[torch.Tensor]
    questions: list[str]


def make_batch(examples: list[ShapesExample], model: DeltaMoEForCausalLM, tok: ByteTokenizer) -> Batch:
    cfg = model.config
    rows, labels, images = [], [], []
    for ex in examples:
        img = prepare_image(ex.image, cfg.vision)
        prompt = [cfg.media_placeholder_token_id] * img.num_tokens + tok.encode(ex.question)
        answer = tok.encode(ex.answer) + [tok.eos_token_id]
        rows.append(prompt + answer)
        labels.append([IGNORE_INDEX] * len(prompt) + answer)
        images.append(img.pixels)
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [IGNORE_INDEX] * (width - len(r)) for r in labels])
    return Batch(ids, lab, images, [ex.question for ex in examples])


@torch.no_grad()
def evaluate(model: DeltaMoEForCausalLM, batches: list[Batch]) -> dict[str, float]:
    """Held-out accuracy per question (and 'all'): every answer token the argmax, teacher-forced."""
    model.eval()
    right: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    for b in batches:
        logits = model(b.ids, images=b.images).logits
        pred = logits[:, :-1].argmax(-1)
        target = b.labels[:, 1:]
        scored = target != IGNORE_INDEX
        ok = ((pred == target) | ~scored).all(dim=1)
        for q, good in zip(b.questions, ok.tolist()):
            for key in (q, "all"):
                right[key] += good
                total[key] += 1
    model.train()
    return {k: right[k] / total[k] for k in total}


def train(run: ShapesRun, log=print) -> dict[str, float]:
    from deltamoe.config import load_preset
    from deltamoe.model.load import build_model

    config = load_preset(run.preset)
    if config.vision is None or config.media_placeholder_token_id is None:
        raise ValueError(f"preset {run.preset} has no vision tower")
    torch.manual_seed(run.seed)
    model = build_model(config, seed=run.seed).train()
    tok = ByteTokenizer(config.vocab_size)
    task = ShapesTask()
    eval_batches = [make_batch([task.example(i, run.seed, "eval") for i in range(a, min(a + 48, run.eval_examples))],
                    model, tok) for a in range(0, run.eval_examples, 48)]
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / run.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, run.steps) / run.steps)))
    log(f"start: held-out accuracy {_fmt(evaluate(model, eval_batches))} (chance: {_fmt(CHANCE)})")
    start = time.perf_counter()
    acc: dict[str, float] = {}
    for step in range(1, run.steps + 1):
        b = make_batch([task.example(step * run.batch_size + i, run.seed) for i in range(run.batch_size)], model, tok)
        loss = model(b.ids, labels=b.labels, images=b.images).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0:
            log(f"step {step}/{run.steps} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")
        if step % run.eval_every == 0 or step == run.steps:
            acc = evaluate(model, eval_batches)
            log(f"step {step}: held-out accuracy {_fmt(acc)}")
    if run.save is not None:
        from deltamoe.model.weights import save_checkpoint

        save_checkpoint(model.eval(), run.save)
        log(f"saved {run.save}")
    return acc


def _fmt(acc: dict[str, float]) -> str:
    return ", ".join(f"{k} {acc[k]:.0%}" for k in (*QUESTIONS, "all") if k in acc)
