"""EngineConfig: the serving knobs in one dataclass, validated once with errors that name the field."""

from __future__ import annotations

import re
from dataclasses import dataclass

from deltamoe.errors import ConfigError

# The forms of the compiled decode call (serve/engine/compiled_decode.py), the default first: whole
# decoder layers as regions, each layer kind's attention and FFN as regions, the whole call as one graph.
COMPILE_FORMS = ("layers", "parts", "whole")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int, field: str = "cache_memory") -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' or an int -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"expected a size like '2GiB', '512MiB' or a number of bytes, got {value!r}", field=field)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class EngineConfig:
    """How the engine batches and how much memory its cache may use.

    `cache_memory` is split between fixed-size KDA state slots (one per running sequence plus
    prefix snapshots, at most `max_state_fraction` of the budget) and paged blocks for MLA
    latents and DSA indexer keys (the rest).
    """

    cache_memory: int | str = "1GiB"
    block_size: int = 16
    max_num_seqs: int = 64  # sequences in one step (running)
    max_num_batched_tokens: int = 512  # tokens per step: decodes (1 each) + prefill chunks
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    snapshot_interval_blocks: int = 8  # KDA snapshots every N full blocks (plus each prompt's last full block)
    max_snapshots: int | None = None  # cap on state slots held by snapshots (default: max_num_seqs)
    max_state_fraction: float = 0.5  # at most this share of cache_memory goes to KDA state slots
    seed: int = 0  # seeds requests that give no seed of their own
    compile_decode: bool = False  # run decode steps through torch.compile, per-layer regions (serve/engine/compiled_decode.py)
    compile_form: str = COMPILE_FORMS[0]  # what one compiled graph covers (COMPILE_FORMS); read only with compile_decode
    kv_cache_dtype: str = "auto"  # latent-KV and indexer-key pages: "auto" (the model dtype) or "fp8" (e4m3 + scales)
    # Speculative decoding (serve/spec_decode/): None, or "mtp" (the model's MTP head drafts).
    speculative: str | None = None
    num_draft_tokens: int = 1  # tokens the MTP head proposes per step (1..3), verified in one forward
    spec_min_acceptance: float = 0.2  # a request whose recent drafts are accepted less often stops speculating
    # A step whose running batch is at least this many sequences runs as plain decode (0: speculate at any
    # batch); drafting resumes when the batch shrinks (serve/spec_decode/batch_rule.py says why 4).
    spec_max_batch: int = 4
    # Below spec_max_batch: "cost" speculates at a batch size only where the engine measured that it pays
    # (serve/spec_decode/step_costs.py); "size" speculates at every batch size under the limit.
    spec_batch_rule: str = "cost"
    # Schedule step N+1 while step N runs, its not-yet-sampled tokens as placeholders (serve/executor/overlap.py).
    async_scheduling: bool = False
    # Decode steps run back to back when a batch is all decodes, scheduling once per window (serve/engine/multi_step.py).
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        self.cache_memory = parse_bytes(self.cache_memory)
        checks = [
            ("cache_memory", self.cache_memory > 0, "a positive size"),
            ("block_size", self.block_size >= 1, "a positive integer"),
            ("max_num_seqs", self.max_num_seqs >= 1, "a positive integer"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "a positive integer"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 1, "None or a positive integer"),
            ("snapshot_interval_blocks", self.snapshot_interval_blocks >= 1, "a positive integer"),
            ("max_snapshots", self.max_snapshots is None or self.max_snapshots >= 0, "None or >= 0"),
            ("max_state_fraction", 0 < self.max_state_fraction <= 1, "a number in (0, 1]"),
            ("kv_cache_dtype", self.kv_cache_dtype in ("auto", "fp8"), "auto or fp8"),
            ("compile_form", self.compile_form in COMPILE_FORMS, "one of " + ", ".join(COMPILE_FORMS)),
            ("speculative", self.speculative in (None, "mtp"), "None or mtp"),
            ("num_draft_tokens", isinstance(self.num_draft_tokens, int) and 1 <= self.num_draft_tokens <= 3,
             "an integer in [1, 3]"),
            ("spec_min_acceptance", 0 <= self.spec_min_acceptance <= 1, "a number in [0, 1]"),
            ("spec_max_batch", isinstance(self.spec_max_batch, int) and not isinstance(self.spec_max_batch, bool)
             and self.spec_max_batch >= 0, "an integer >= 0 (0: speculate at any batch size)"),
            ("spec_batch_rule", self.spec_batch_rule in ("cost", "size"), "cost or size"),
            ("num_scheduler_steps", isinstance(self.num_scheduler_steps, int) and not isinstance(
                self.num_scheduler_steps, bool) and self.num_scheduler_steps >= 1, "a positive integer"),
        ]
        for field, ok, expected in checks:
            if not ok:
                raise ConfigError(f"expected {expected}, got {getattr(self, field)!r}", field=field)
        if self.async_scheduling and self.speculative is not None:
            raise ConfigError("async scheduling and speculative decoding do not combine yet (a verification step "
                              "needs its drafts on the host)", field="async_scheduling",
                              hint="drop --async-scheduling or --speculative")
        whole_graph = self.compile_decode and self.compile_form == "whole"
        if self.speculative is not None and self.spec_max_batch and whole_graph:
            raise ConfigError("the whole-call decode graph hands back no hidden states, which the MTP layer needs "
                              "after steps run plainly by --spec-max-batch", field="compile_form",
                              hint="use --compile-form layers or parts, or --spec-max-batch 0")
        if self.num_scheduler_steps > 1 and (self.async_scheduling or self.speculative is not None):
            raise ConfigError("multi-step decode combines with neither async scheduling nor speculative decoding "
                              "yet", field="num_scheduler_steps",
                              hint="drop --num-scheduler-steps or --async-scheduling / --speculative")
        if self.max_snapshots is None:
            self.max_snapshots = self.max_num_seqs if self.enable_prefix_caching else 0


def check_max_model_len(max_model_len: int | None, max_position_embeddings: int) -> None:
    """A context past the positions the model was trained for is refused, as vLLM does."""
    if max_model_len is not None and max_model_len > max_position_embeddings:
        raise ConfigError(f"{max_model_len} is more than the model's max_position_embeddings "
                          f"({max_position_embeddings})", field="max_model_len",
                          hint=f"at most {max_position_embeddings}")


def check_speculative_layout(speculative: str | None, workers: bool, hand_off: bool) -> None:
    """Speculation runs on one process without a P/D role: the CLI asks before any rank or transfer
    engine starts, the engine again when it builds its runner (torch-free, so both can)."""
    if speculative is None:
        return
    if workers:
        raise ConfigError("speculative decoding runs on one process; drop --speculative or --tp/--ep",
                          field="speculative")
    if hand_off:
        raise ConfigError("a prefill/decode hand-off carries no MTP latents; drop --speculative or the role",
                          field="speculative")
