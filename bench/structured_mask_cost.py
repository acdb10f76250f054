"""Per-token mask cost on CPU of the grammar libraries deltamoe could use (llguidance, outlines-core).

For each tokenizer (the byte tokenizer and an HF byte-level BPE `tokenizer.json` trained here at a
realistic vocabulary size) and each schema: compile once, then walk a seeded random valid path
through the grammar, timing the mask computation of every step. Prints and writes one JSON line per
(library, tokenizer, schema): compile time and mean / p99 mask microseconds per token.

    python bench/structured_mask_cost.py --vocab 32000 --out bench/results/structured_mask_cost.json

outlines-core is optional (`pip install outlines-core`): it is measured when importable.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "ok": {"type": "boolean"}},
             "required": ["name", "age", "ok"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                "maxItems": 3}}, "required": ["id", "tags"],
            "additionalProperties": False}, "maxItems": 4},
        "kind": {"enum": ["a", "b", "c"]}}, "required": ["items", "kind"], "additionalProperties": False},
}


def hf_tokenizer(vocab: int):
    """A byte-level BPE trained on this repository's Python and Markdown (ids at Kimi-like sizes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from deltamoe.tokenizers.hf import HFTokenizer

    root = Path(__file__).resolve().parents[1]
    texts = [p.read_text(errors="ignore") for p in [*root.rglob("*.py"), *root.rglob("*.md")] if ".venv" not in p.parts]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = Path(tempfile.mkdtemp())
    tok.save(str(folder / "tokenizer.json"))
    return HFTokenizer(folder / "tokenizer.json", {"eos_token": "<|endoftext|>"})


def walk_llguidance(tokenizer, schema: dict, steps: int, rng: random.Random) -> tuple[float, list[float]]:
    from deltamoe.serve.structured.constraint import json_schema_constraint
    from deltamoe.serve.structured.matcher import GrammarMatcher
    from deltamoe.serve.structured.tokenizer import ll_tokenizer

    ll_tokenizer(tokenizer)  # built once per tokenizer (not a per-request cost)
    t0 = time.perf_counter()
    matcher = GrammarMatcher(json_schema_constraint(schema, "response_format"), tokenizer, tokenizer.vocab_size,
                             frozenset({tokenizer.eos_token_id}))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        allowed = matcher.allowed()
        times.append(time.perf_counter() - t)
        ids = allowed.nonzero().flatten().tolist()
        if not ids or matcher.done:
            break
        matcher.accept(rng.choice(ids))
    return compile_s, times


def walk_outlines(tokenizer, schema: dict, steps: int, rng: random.Random) -> tuple[float, list[float]]:
    import outlines_core as oc

    eos = tokenizer.eos_token_id
    vocab = oc.Vocabulary(eos, _outlines_map(tokenizer, eos))
    t0 = time.perf_counter()
    index = oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(schema)), vocab)
    guide = oc.Guide(index)
    compile_s = time.perf_counter() - t0
    mask = torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        bits = ((mask.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:tokenizer.vocab_size]
        times.append(time.perf_counter() - t)
        ids = bits.nonzero().flatten().tolist()
        if not ids or guide.is_finished():
            break
        guide.advance(rng.choice(ids))
    return compile_s, times


def _outlines_map(tokenizer, eos: int) -> dict[bytes, list[int]]:
    out: dict[bytes, list[int]] = {}
    specials = set(tokenizer.special_tokens.values())
    for i in range(tokenizer.vocab_size):
        if i == eos or i in specials:
            continue
        out.setdefault(tokenizer.token_bytes(i), []).append(i)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary of the trained HF tokenizer")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from deltamoe.tokenizers.byte import ByteTokenizer

    tokenizers = {"byte": ByteTokenizer(), f"hf-bpe-{args.vocab}": hf_tokenizer(args.vocab)}
    walkers = {"llguidance": walk_llguidance}
    try:
        import outlines_core  # noqa: F401

        walkers["outlines-core"] = walk_outlines
    except ImportError:
        print("outlines-core is not installed: measuring llguidance only")
    rows = []
    for tok_name, tok in tokenizers.items():
        for schema_name, schema in SCHEMAS.items():
            for lib, walk in walkers.items():
                compile_s, times = walk(tok, schema, args.steps, random.Random(0))
                us = sorted(t * 1e6 for t in times)
                row = {"library": lib, "tokenizer": tok_name, "vocab": tok.vocab_size, "schema": schema_name,
                       "compile_ms": round(compile_s * 1e3, 2), "steps": len(us),
                       "mask_us_mean": round(statistics.fmean(us), 1), "mask_us_p99": round(us[int(0.99 * (len(us) - 1))], 1)}
                print(json.dumps(row))
                rows.append(row)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
