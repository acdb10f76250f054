"""Where a batch-8 run under the speculative batch rule spends its time, step by step, against
plain decoding of the same workload (`bench_spec_decode.py`'s batch-8 rows).

Each engine's `runner.execute` is timed (wall and thread CPU time) and every step is filed by
what it ran and how many requests it held:
- plain: a plain engine's step;
- rule-plain: a speculative engine's step at or above the rule's limit (plain decode, hidden
  states kept, the MTP catch-up of rows whose block filled);
- cost-plain: one under the limit that the cost rule ran plainly (`spec_decode/step_costs.py`);
- verify: a speculative step with at least one verification;
- no-drafts: a speculative step that verified nothing (rows without drafts yet: the step after
  the batch fell under the limit, or after a prefill);
- prefill: any step with a prompt chunk in it (outside the timed decode region of the bench).
Per (kind, batch): steps, total and mean milliseconds, and for speculative kinds the tokens they
emitted per row-step; the totals say which kinds the loss against plain sits in. Modes take turns
over `--rounds` rounds (a loaded machine: medians of the rounds' totals).

Without `--checkpoint` (no trained MTP model at hand): a random-weight `tiny`, each request's
drafts replaced by its plain greedy continuation where a seeded draw at `--acceptance` says so
(a wrong token otherwise, and every draft after a wrong one wrong too): the MTP layer's work is
unchanged, only the tokens it picks. Requests of `--prompt-lengths` and `--max-tokens` drawn per
request (so a batch-8 group's rows finish at different steps and its tail runs at batch 7..1).

    python bench/spec_rule_steps.py [--checkpoint DIR] [--compile] [--k 2] [--rounds 3] [--workload mix]
        [--modes plain,size,cost,forced] [--acceptance 0.6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_spec_decode import encoders, engine, open_ended, task_prompts, to_answer_end  # noqa: E402
from common import markdown_table  # noqa: E402

from deltamoe.config import load_preset  # noqa: E402
from deltamoe.model.load import build_model, load_model  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.sampling import SamplingParams  # noqa: E402
from deltamoe.serve.spec_decode.mtp_drafter import MTPDrafter  # noqa: E402
from deltamoe.tokenizers.load import load_tokenizer  # noqa: E402
from bench_spec_decode import Workload  # noqa: E402


class OracleDrafter(MTPDrafter):
    """The MTP drafter's work; its tokens then set from the request's plain greedy continuation:
    draft j right while seeded draws stay under `acceptance`, wrong (the right token + 1) after."""

    def __init__(self, drafter: MTPDrafter, continuations: dict[tuple[int, ...], list[int]], acceptance: float):
        self.__dict__.update(drafter.__dict__)
        self.continuations, self.acceptance = continuations, acceptance

    def run(self, rows):
        drafts = super().run(rows)
        for row, d in zip(rows, drafts):
            seq = row.seq
            full = self.continuations.get(tuple(seq.token_ids[:seq.num_prompt_tokens]))
            if d is None or full is None:  # no draft, or a warm-up's made-up request
                continue
            rng = torch.Generator().manual_seed(hash((seq.num_prompt_tokens, d.position)) & 0xFFFFFFFF)
            right = True
            for j in range(len(d.tokens)):
                i = d.position + 1 + j
                truth = full[i] if i < len(full) else 0
                right = right and float(torch.rand((), generator=rng)) < self.acceptance
                d.tokens[j] = truth if right else (truth + 1) % self.embed.num_embeddings
        return drafts


def emulated(args) -> tuple[object, Workload, dict]:
    """A random-weight `tiny`, a workload of drawn lengths, each request's plain greedy continuation."""
    model = build_model(load_preset("tiny"), seed=3).eval()
    g = torch.Generator().manual_seed(0)
    lo, hi = args.prompt_lengths
    t_lo, t_hi = args.max_tokens
    prompts = [torch.randint(1, model.config.vocab_size, (int(torch.randint(lo, hi + 1, (), generator=g)),), generator=g).tolist()
               for _ in range(args.requests)]
    params = [SamplingParams(max_tokens=int(torch.randint(t_lo, t_hi + 1, (), generator=g)), temperature=0.0,
                             ignore_eos=True) for _ in prompts]
    eng = LLMEngine(model, config=EngineConfig(cache_memory="256MiB", max_num_seqs=64))
    outs = eng.generate(prompts, params, progress=False)
    continuations = {tuple(p): p + o.token_ids for p, o in zip(prompts, outs)}
    return model, Workload(prompts, params), continuations


def emulated_engine(model, mode: str, k: int, compile_decode: bool, continuations: dict, acceptance: float):
    spec = mode != "plain"
    config = EngineConfig(cache_memory="256MiB", max_num_seqs=64, compile_decode=compile_decode,
                          speculative="mtp" if spec else None, num_draft_tokens=k, spec_min_acceptance=0.0,
                          spec_max_batch=0 if mode == "forced" else EngineConfig.spec_max_batch,
                          spec_batch_rule="size" if mode == "size" else "cost")
    eng = LLMEngine(model, config=config)
    if spec:
        eng.runner.drafter = OracleDrafter(eng.runner.drafter, continuations, acceptance)
    return eng


def timed_steps(eng, log: list[tuple[str, int, float, float, int]]) -> None:
    """Wrap `eng.runner.execute`: each call appends (kind, batch, wall s, cpu s, tokens emitted)."""
    runner = eng.runner
    execute = runner.execute
    tracker = getattr(runner, "tracker", None)

    def step(batch):
        verifications = tracker.verifications if tracker is not None else 0
        by_rule = tracker.plain_by_rule_steps if tracker is not None else 0
        by_cost = tracker.plain_by_cost_steps if tracker is not None else 0
        w0, c0 = time.perf_counter(), time.thread_time()
        results = execute(batch)
        wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
        if any(n > 1 for _, n in batch.items):
            kind = "prefill"
        elif tracker is None:
            kind = "plain"
        elif tracker.plain_by_rule_steps > by_rule:
            kind = "rule-plain"
        elif tracker.plain_by_cost_steps > by_cost:
            kind = "cost-plain"
        elif tracker.verifications > verifications:
            kind = "verify"
        else:
            kind = "no-drafts"
        emitted = sum(len(getattr(r, "tokens", None) or [r.token]) for r in results if r.token is not None)
        log.append((kind, len(batch.items), wall, cpu, emitted))
        return results

    runner.execute = step


def run_once(eng, work, batch: int) -> list[tuple[str, int, float, float, int]]:
    log: list[tuple[str, int, float, float, int]] = []
    timed_steps(eng, log)
    for i in range(0, len(work.prompts), batch):
        for prompt, params in zip(work.prompts[i:i + batch], work.params[i:i + batch]):
            eng.add_request(prompt, params)
        while eng.has_unfinished():
            eng.step()
    eng.runner.execute = type(eng.runner).execute.__get__(eng.runner)
    return log


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", type=Path, help="a trained MTP checkpoint (default: emulated, see above)")
    ap.add_argument("--acceptance", type=float, default=0.6, help="emulated: chance each draft is right")
    ap.add_argument("--requests", type=int, default=16, help="emulated: requests in the workload")
    ap.add_argument("--prompt-lengths", type=int, nargs=2, default=(8, 40), help="emulated: drawn from [lo, hi]")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(4, 40), help="emulated: drawn from [lo, hi]")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts-per-task", type=int, default=8)
    ap.add_argument("--workload", choices=("mix", "open_ended"), default="mix")
    ap.add_argument("--modes", default="plain,size,cost",
                    help="comma-separated: plain; size (the limit alone); cost (the limit and the cost rule "
                         "below it); forced (speculation at every batch size)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    modes = args.modes.split(",")
    if args.checkpoint is None:
        model, work, continuations = emulated(args)
        engines = {m: emulated_engine(model, m, args.k, args.compile, continuations, args.acceptance) for m in modes}
    else:
        model = load_model(args.checkpoint)
        tokenizer = load_tokenizer(args.checkpoint, model.config.vocab_size)
        by_task = task_prompts(args.prompts_per_task)
        mix = [p for ps in by_task.values() for p in ps]
        encode = encoders(args.checkpoint, tokenizer)["raw"]
        work = to_answer_end(mix, encode) if args.workload == "mix" else open_ended(mix, encode, 64)
        engines = {m: engine(model, tokenizer, None if m == "plain" else args.k, args.compile, rule=m != "forced")
                   for m in modes}
        for m, eng in engines.items():
            if m == "size":
                eng.runner.by_cost = False
    for eng in engines.values():
        eng.warm_up()
        run_once(eng, work, args.batch)  # first-call costs, compiles met by this workload
    totals: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes[r % len(modes):] + modes[:r % len(modes)]:
            agg: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])
            for kind, b, wall, cpu, emitted in run_once(engines[m], work, args.batch):
                a = agg[(kind, b)]
                a[0] += 1
                a[1] += wall
                a[2] += cpu
                a[3] += emitted
            totals[m].append(agg)
    rows = []
    for m in modes:
        keys = sorted({k for agg in totals[m] for k in agg}, key=lambda k: (k[0], k[1]))
        for key in keys:
            per = [agg.get(key, [0, 0.0, 0.0, 0]) for agg in totals[m]]
            steps = statistics.median(p[0] for p in per)
            wall = statistics.median(p[1] for p in per) * 1e3
            cpu = statistics.median(p[2] for p in per) * 1e3
            emitted = statistics.median(p[3] for p in per)
            rows.append([m, key[0], key[1], steps, f"{wall:.1f}", f"{cpu:.1f}",
                         f"{wall / steps:.2f}" if steps else "", f"{emitted / max(1, steps * key[1]):.2f}"])
        decode = [sum(v[1] for k, v in agg.items() if k[0] != "prefill") * 1e3 for agg in totals[m]]
        cpu_decode = [sum(v[2] for k, v in agg.items() if k[0] != "prefill") * 1e3 for agg in totals[m]]
        rows.append([m, "(decode total)", "", "", f"{statistics.median(decode):.1f}",
                     f"{statistics.median(cpu_decode):.1f}", "", ""])
    print(markdown_table(["mode", "kind", "batch", "steps", "wall ms", "cpu ms", "ms/step", "tokens/row-step"], rows))


if __name__ == "__main__":
    main()
