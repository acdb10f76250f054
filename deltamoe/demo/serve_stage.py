"""Demo stage 2: serve the trained checkpoint with LLMEngine and score held-out prompts.

Each prompt is a held-out example of one task (never trained on: the tasks' hash split) cut
just before one of its answers, e.g. `A3c5D7|c5D` -> `7` or `47+8=` -> `55`. The engine decodes
greedily for as many tokens as the expected answer and a prompt counts when the text matches
exactly. (The training data never scores the end-of-answer token, so the model is not asked
to stop by itself.) All prompts go to the engine together: continuous batching, chunked
prefill, the paged hybrid cache.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.train.data.task_stream import draw_example
from deltamoe.train.data.tasks import Task

CHANCE = {"recall": 0.1, "arithmetic": None}  # recall values are uniform over 10 digits


@dataclass(frozen=True)
class HeldOutPrompt:
    task: str
    prompt: str
    answer: str


def held_out_prompts(task: Task, count: int, seed: int = 0) -> list[HeldOutPrompt]:
    """Up to `count` distinct held-out examples of `task`, each cut before one of its answers,
    chosen at random (the answers before it stay in the prompt), like the trainer's evaluation,
    which scores every answer. Distinct, because short sums recur (1 digit + 1 digit is a quarter
    of them)."""
    return answer_prompts(task, count, seed, "eval")


def answer_prompts(task: Task, count: int, seed: int, split: str) -> list[HeldOutPrompt]:
    """`held_out_prompts` drawn from `split` ("train": examples the model may have trained on)."""
    rng = random.Random(f"demo/{seed}/{task.name}")
    prompts: dict[str, HeldOutPrompt] = {}
    for _ in range(50 * count):
        if len(prompts) == count:
            break
        segments = draw_example(task, rng, split)
        cut = rng.choice([i for i, (_, is_answer) in enumerate(segments) if is_answer])
        text = "".join(t for t, _ in segments[:cut])
        prompts.setdefault(text, HeldOutPrompt(task.name, text, segments[cut][0]))
    return list(prompts.values())


def run_serve_eval(checkpoint: Path, tasks: tuple[Task, ...], per_task: int, console: Console) -> dict[str, Any]:
    engine = LLMEngine.from_pretrained(checkpoint, EngineConfig(cache_memory="64MiB", max_num_seqs=64))
    bos = engine.tokenizer.bos_token_id
    prompts = [p for task in tasks for p in held_out_prompts(task, per_task)]
    # Training rows start with BOS, so a prompt does too.
    ids = [engine.tokenizer.encode(p.prompt, add_bos=bos is not None) for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=len(p.answer.encode())) for p in prompts]
    console.print(f"serving {checkpoint} with LLMEngine: {len(prompts)} held-out prompts, greedy")
    t0 = time.perf_counter()
    completions = engine.generate(ids, params, progress=True)
    wall = time.perf_counter() - t0
    stats = engine.stats()
    answers = [c.text for c in completions]
    per_task_acc = {}
    for task in tasks:
        rows = [(p, a) for p, a in zip(prompts, answers) if p.task == task.name]
        per_task_acc[task.name] = {"accuracy": sum(p.answer == a for p, a in rows) / len(rows), "prompts": len(rows),
                                   "chance": CHANCE.get(task.name)}
    correct = sum(p.answer == a for p, a in zip(prompts, answers))
    result = {
        "prompts": len(prompts), "correct": correct, "accuracy": correct / len(prompts), "per_task": per_task_acc,
        "prompt_tokens": stats.prompt_tokens_total, "output_tokens": stats.generation_tokens_total,
        "wall_s": round(wall, 3), "engine_steps": stats.steps,
        "tokens_per_s": (stats.prompt_tokens_total + stats.generation_tokens_total) / wall,
        "output_tokens_per_s": stats.generation_tokens_total / wall,
        "examples": [{"task": p.task, "prompt": p.prompt, "expected": p.answer, "got": a}
                     for p, a in _sample(prompts, answers)],
    }
    _show(console, result)
    return result


def _sample(prompts: list[HeldOutPrompt], answers: list[str], per_task: int = 3) -> list[tuple[HeldOutPrompt, str]]:
    """The first few prompts of each task, for the screen and results.json."""
    seen: dict[str, int] = {}
    out = []
    for p, a in zip(prompts, answers):
        if seen.get(p.task, 0) < per_task:
            seen[p.task] = seen.get(p.task, 0) + 1
            out.append((p, a))
    return out


def _show(console: Console, r: dict[str, Any]) -> None:
    table = Table(title="held-out prompts (greedy)")
    for col in ("task", "prompt", "expected", "got", ""):
        table.add_column(col)
    for e in r["examples"]:
        ok = e["expected"] == e["got"]
        table.add_row(e["task"], e["prompt"], e["expected"], repr(e["got"]), "[green]ok" if ok else "[red]wrong")
    console.print(table)
    parts = []
    for name, t in r["per_task"].items():
        chance = f", chance {t['chance']:.0%}" if t["chance"] is not None else ""
        parts.append(f"{name} {t['accuracy']:.1%} of {t['prompts']}{chance}")
    console.print(f"accuracy [bold]{r['accuracy']:.1%}[/] ({'; '.join(parts)})")
    console.print(f"throughput [bold]{r['tokens_per_s']:,.0f} tok/s[/] ({r['prompt_tokens']:,} prompt + "
                  f"{r['output_tokens']:,} generated tokens in {r['wall_s']:.2f} s, {r['engine_steps']} engine steps; "
                  f"{r['output_tokens_per_s']:,.0f} generated tok/s)")
