"""`ParallelDims`: the one description of a parallel layout, shared by the CLI (`--dp/--tp/...`), the
run file's `[parallel]` table, the trainer and the mesh. Plain Python (no torch), so the CLI can check
it before any heavy import.

Mesh layout (one DeviceMesh, torchtitan style): world = pp * dp * tp. Expert parallelism does not add
ranks: the EP group is carved out of the data-parallel ranks (ep divides dp), so the mesh is
("pp", "dp_rep", "ep", "tp") with dp = dp_rep * ep. Each EP rank feeds its own data slice and owns
num_experts / ep experts; expert weights are FSDP-sharded over the remaining dp_rep ranks, everything
else over all dp ranks. Keeping EP inside DP (and out of TP) means the tokens an EP group exchanges
are distinct, not TP replicas of each other.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from deltamoe.config import ModelConfig
from deltamoe.errors import ConfigError
from deltamoe.parallel.stage_split import split_stages

SCHEDULES = ("1f1b", "interleaved1f1b")
# Activation offload targets per decoder layer (parallel/offload.py); the last two sit inside a
# checkpointed layer, so they exclude activation checkpointing.
OFFLOAD_TARGETS = ("layer", "attn", "mlp")
OFFLOAD_INSIDE_LAYER = ("attn", "mlp")
_COUNTS = ("dp", "tp", "ep", "pp", "microbatches", "stages_per_rank", "ep_chunks")


def launch_world_size() -> int:
    """The number of processes torchrun started (WORLD_SIZE); 1 for a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class ParallelDims:
    dp: int | None = None  # data parallel (FSDP2), the EP group lives inside it; None: world / (tp * pp)
    tp: int = 1  # tensor parallel (attention heads, MLP widths)
    ep: int = 1  # expert parallel, carved out of dp: must divide dp
    pp: int = 1  # pipeline ranks
    schedule: str = "1f1b"  # "1f1b" | "interleaved1f1b"
    # Microbatches per step; the local batch must divide by it. With pp > 1 the pipeline schedule runs
    # them; otherwise they are gradient accumulation (FSDP reduces after the last one).
    microbatches: int = 1
    stages_per_rank: int = 1  # virtual pipeline stages per rank ("interleaved1f1b")
    activation_checkpointing: bool = False  # recompute each decoder layer in backward
    offload_activations: str | None = None  # "layer" or "attn,mlp": saved activations to host memory
    # Token chunks in flight through the EP all-to-all: > 1 overlaps one chunk's dispatch/combine with
    # another chunk's expert compute (asynchronous collectives, parallel/expert_overlap.py).
    ep_chunks: int = 1

    def world_size(self) -> int:
        return self.data_size * self.tp * self.pp

    @property
    def data_size(self) -> int:
        if self.dp is None:
            raise ValueError("dp is not resolved yet: call with_world(world_size) first")
        return self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def whole_model(self) -> bool:
        """One stage per rank holding every layer: the layouts that can be evaluated directly."""
        return self.num_stages == 1

    # ------------------------------------------------------------ checks
    def check_fields(self) -> None:
        """The checks that need neither the model nor the world; ConfigError naming the field."""
        for name in _COUNTS:
            value = getattr(self, name)
            if name == "dp" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"expected a positive integer, got {value!r}", field=name)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"expected one of {SCHEDULES}, got {self.schedule!r}", field="schedule")
        if self.schedule == "1f1b" and self.stages_per_rank != 1:
            raise ConfigError(f"expected 1 for schedule '1f1b', got {self.stages_per_rank}", field="stages_per_rank",
                              hint="use schedule 'interleaved1f1b' for virtual stages")
        if not isinstance(self.activation_checkpointing, bool):
            raise ConfigError(f"expected true or false, got {self.activation_checkpointing!r}",
                              field="activation_checkpointing")
        self._check_offload()

    @property
    def offload_targets(self) -> tuple[str, ...]:
        """`offload_activations` split at commas: () when off."""
        return tuple(t.strip() for t in (self.offload_activations or "").split(",") if t.strip())

    def _check_offload(self) -> None:
        if self.offload_activations is None:
            return
        if not isinstance(self.offload_activations, str) or not self.offload_targets \
                or not set(self.offload_targets) <= set(OFFLOAD_TARGETS):
            raise ConfigError(f"expected a comma-separated subset of {OFFLOAD_TARGETS}, got "
                              f"{self.offload_activations!r}", field="offload_activations")
        inside = [t for t in self.offload_targets if t in OFFLOAD_INSIDE_LAYER]
        if inside and self.activation_checkpointing:
            raise ConfigError(f"{inside} sit inside a checkpointed layer: with activation checkpointing the layer "
                              "keeps only its inputs", field="offload_activations", hint="offload 'layer' instead")

    def with_world(self, world_size: int) -> ParallelDims:
        """These dims with `dp` inferred from the world size when not given (torchtitan's dp_shard = -1)."""
        if self.dp is not None:
            return self
        replica = self.tp * self.pp
        if world_size < replica:  # not a question of dp: the pipeline and tensor groups alone do not fit
            name = "pp" if self.pp > 1 else "tp"
            raise ConfigError(f"tp * pp = {self.tp} * {self.pp} = {replica} ranks are needed for one model copy "
                              f"(every pipeline stage and tensor shard on its own rank), but the world has "
                              f"{world_size}", field=name, hint=f"start at least {replica} processes or lower {name}")
        if world_size % replica != 0:
            raise ConfigError(f"cannot infer dp: the world has {world_size} ranks, not a multiple of "
                              f"tp * pp = {replica}", field="dp", hint="pass dp explicitly")
        return dataclasses.replace(self, dp=world_size // replica)

    def check_layout(self, config: ModelConfig, world_size: int) -> None:
        """The checks against the world and the model (fields already checked, dp resolved); call before any
        process group exists."""
        if world_size != self.world_size():
            raise ConfigError(f"dp * tp * pp = {self.dp} * {self.tp} * {self.pp} = {self.world_size()} ranks, "
                              f"but the world has {world_size}", field="world_size",
                              hint="ep does not add ranks: it is carved out of dp")
        if world_size == 1 and self.microbatches > 1:
            # One process runs its batch in one forward (`LocalModel`): microbatches would change
            # nothing but the balance loss's gradient scale (1 / microbatches).
            raise ConfigError(f"expected 1 on one process, got {self.microbatches}: microbatches split a rank's "
                              "batch for a pipeline or for accumulation across data ranks", field="microbatches",
                              hint="accumulate on one process with --grad-accum")
        self._check_experts(config)
        self._check_tensor_parallel(config)
        if self.pp > 1 and config.tie_word_embeddings:
            raise ConfigError("expected False with pp > 1: the embedding (first stage) and the LM head (last stage) "
                              "would be one tensor on two ranks", field="tie_word_embeddings")
        if self.num_stages > 1:
            split_stages(config, self.num_stages)  # raises when there are more stages than blocks
            if self.microbatches < self.pp:  # torch's 1F1B fills the pipeline with one microbatch per stage
                raise ConfigError(f"expected at least pp ({self.pp}) microbatches for a pipeline, got "
                                  f"{self.microbatches}", field="microbatches",
                                  hint=f"pass --microbatches {self.pp} or another divisor of the local batch >= pp")
            if self.schedule == "interleaved1f1b" and self.microbatches % self.pp != 0:
                raise ConfigError(f"expected a multiple of pp ({self.pp}) for 'interleaved1f1b', "
                                  f"got {self.microbatches}", field="microbatches")

    def resolve(self, config: ModelConfig, world_size: int) -> ParallelDims:
        """Every check, with dp inferred: the dims to hand to `init_distributed` and `parallelize`."""
        self.check_fields()
        dims = self.with_world(world_size)
        dims.check_layout(config, world_size)
        return dims

    def _check_experts(self, config: ModelConfig) -> None:
        if self.ep == 1:
            return
        if config.num_experts == 0:
            raise ConfigError(f"expected 1 for a model without routed experts, got {self.ep}", field="ep")
        if config.num_experts % self.ep != 0:
            raise ConfigError(f"expected a divisor of num_experts ({config.num_experts}), got {self.ep}", field="ep")
        if self.data_size % self.ep != 0:
            raise ConfigError(f"expected a divisor of dp ({self.dp}): the expert group is carved out of the "
                              f"data-parallel ranks, got {self.ep}", field="ep")

    def _check_tensor_parallel(self, config: ModelConfig) -> None:
        if self.tp == 1:
            return
        widths: dict[str, int] = {}
        if "kda" in config.layer_types:
            widths["kda_num_heads"] = config.kda_num_heads
        if any(t in ("mla", "dsa") for t in config.layer_types) or config.num_nextn_predict_layers:
            widths["num_attention_heads"] = config.num_attention_heads
        if any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
            widths["intermediate_size"] = config.intermediate_size
        if config.num_experts > 0 and config.num_shared_experts > 0:
            widths["shared_expert_size"] = config.shared_expert_size
        for name, width in widths.items():
            if width % self.tp != 0:
                raise ConfigError(f"tp = {self.tp} must divide {name} ({width})", field="tp")
