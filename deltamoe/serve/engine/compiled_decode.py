"""The compiled decode call (`EngineConfig.compile_decode`, `--compile`): per-layer regions, or one graph.

Forms (`FORMS`), the same results:
- regions: compiled regions that every layer of the same kind shares (`compiled_regions.py`). The
  compile covers one layer of each kind, not every layer: it is what makes a first start (an
  empty inductor cache) short enough to compile by default. Two boundaries:
  - "layers" (the default): one region per whole layer, the AttnRes bank a fixed-size tensor
    (`model/bank_slots.py`), only the embedding, the output mix and the LM head eager: half the
    region calls of "parts" and none of the glue; a layer kind's graph holds its attention once
    per form of the experts (where the expert stack is small, batch 1 runs in the all-experts
    form: `rows_skipping_expert_gather`), and the dense first layer is a kind of its own;
  - "parts": each layer's attention and FFN, the norms, residuals and AttnRes mixes eager between
    them: smaller graphs, slower steps;
- the whole call as one graph ("whole"): the same kernels without any eager glue or region
  entries, a faster step at the cost of compiling every layer's code.
Not a third form: one guarded call over layer bodies marked `torch.compiler.nested_compile_region`
(compiled once per kind, stamped out per layer). Inductor's C++ launcher (`cpp_wrapper`) cannot
emit such a subgraph, and with the Python launcher the compile is no shorter than the whole
graph's and the step slower than the regions' (docs/serving-compiled.md, "Ways to cut that cost").

Everything torch.compile needs to know lives here: the compiled callable and its options, the
shape settings, the model form it traces, the rule the cache view's block tables follow, and the
graph classes with the made-up requests that reach each one (`warm_up_rounds`).

Why: a small model's decode step on a CPU is bound by per-op overhead, not arithmetic: about
900 tensor ops of a few microseconds each for a four-layer model, against ~1 ms of weight reads.
`torch.compile` (inductor's C++ backend) fuses the elementwise work between the matmuls into a
few dozen kernels (bench/bench_serve_offline.py and bench/bench_serve_dsa_decode.py report both
modes). It is what vLLM's CUDA graphs and torch.compile are for on a GPU.

What makes the decode forward compile (each branch tested against the eager form):
- the cache view writes through whole cache tensors (`cache_view._put`), never through a view
  of one layer made in the graph, so the graph updates pages in place instead of rebuilding the
  cache (a region gets its layer's slices as inputs, `LayerCacheView`, and writes into them);
- the graph runs `decode_form(model)`: the same parameters, with every MoE dispatching to
  `ops.moe.experts_forward_static` (no per-expert slices sized on the host);
- DSA's top-k is one `torch.topk` over distinct keys (no flag read back to the host);
- absorbed MLA reads the cache's own [latent | k_pe] rows (`mla_attention_absorbed_joined`).

Graph classes. Batch and context length are dynamic, traced without duck shaping (`decode_tracing`);
the forms the graph traces give every context and page layout one shape rule:
- DSA's selection is top_k wide at every context (`causal_topk(pad_to_top_k=True)`, slots past
  the context invalid), so contexts under and over top-k share a graph;
- every batch, batch 1 on consecutive blocks too, gathers its pages (`PagedBatchView`'s
  slice_consecutive off), so a sequence's page layout does not split the graph.
One shape rule still splits the graphs, asked of its owner rather than copied here:
- one graph per form of `ops.moe.static_expert_form` (MoE regions only: gathered experts, all
  experts, or the sorted form as one opaque op).
Batch 1 is a class of its own only where that pays (`batch_one_rows`; torch would specialise
size 1 into graphs of their own): over a small expert stack the regions run it as two copies of
its row (`CompiledDecode.with_min_rows`), in whole layers as many as the experts' all-experts
form needs, sharing the batches' graphs. Over a large expert stack (`small`: 50 MB a layer) or
int4 stacks a copy would read the gathered experts a second time (the two-row step of `small`
ran at 0.6-0.8x the one-row one, docs/serving-compiled.md); there batch 1 runs as one row through graphs
of its own. Dense MLPs stay eager in the "parts" form. For `tiny` that leaves three graphs in whole layers (the
dense first layer, the KDA and the DSA layer, all experts at once) and four in "parts" (KDA and
DSA attention, the MoE in both forms). The whole call as one graph keeps batch 1 as a class of its own, rewritten by
the one-row matmul pass. Copies attend over their row's whole context, so a call of fewer rows than
`min_rows` runs eagerly once its copies would gather more than `COPIES_MAX_EXTRA_VALUES` a step
(`CompiledDecode.runs`): a lone long sequence. Each class compiles once per process (its regions: seconds each on two
cores; inductor caches them on disk). `LLMEngine.warm_up` sends the requests of `warm_up_rounds`
through the scheduler so every class compiles before traffic (with speculation, it also calls the
verification and MTP regions once per graph class of theirs, `WarmUpCall`, made directly: what the
drafts keep decides those calls' shapes). Prefill chunks stay eager: their
lengths vary and they are a small share of the steps.

Guards on the model's modules are skipped (`skip_guard_on_all_nn_modules_unsafe`): checking
hundreds of parameters costs ~0.2-0.4 ms per step. Torch keeps compiled graphs per code object,
not per model, so each model gets a key of its own that the graph is guarded on (a region's key
adds what its graph bakes in about the layer, `compiled_regions.region_key`): two models in one
process never share a graph. What stays the caller's promise: a served model does not change
its parameter shapes, dtypes or module attributes (weights updated in place, as an RL weight
sync does, are read afresh every call).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import platform
import shutil
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch

from deltamoe.config import ModelConfig
from deltamoe.errors import ConfigError
from deltamoe.model.decoder import DecoderLayer
from deltamoe.model.ffn import MoE, local_experts, local_experts_static
from deltamoe.model.mla_layer import LatentAttention
from deltamoe.model.model import DeltaMoEModel
from deltamoe.model.packed_experts import packed_experts_static_dispatcher, packed_local_experts
from deltamoe.model.quantize_modules import holds_int4_expert_stacks, plain_tensor_operands
from deltamoe.ops import int4_experts
from deltamoe.ops.moe import gathers_expert_weights, static_expert_form
from deltamoe.serve.engine.config import COMPILE_FORMS
from deltamoe.serve.engine.compiled_regions import AttentionRegion, FFNRegion, LayerRegionTrunk
from deltamoe.serve.engine.decode_matvec_pass import DecodeMatvecPass

# Graphs one process may hold for the decode call: the classes above, for a few models.
RECOMPILE_LIMIT = 64
# An expert stack (one layer's routed experts) up to this size runs batch 1 in its all-experts
# form in the whole-layer regions, from up to this many copies of the row (`rows_skipping_expert_gather`).
SMALL_EXPERT_STACK_BYTES = 4 << 20
MAX_ROW_COPIES = 4
# A call of fewer rows than `min_rows` runs as copies of its rows (`with_min_rows`), and every copy
# gathers its row's whole context and attends over it. Past this many values gathered a step for
# the copies alone (extra rows x context x `context_values_per_position`), they cost more than
# compiling saves and the call runs eagerly (`CompiledDecode.runs`). Measured on a quiet AVX-512
# Xeon with bench_serve_dsa_decode.py's models at batch 1 (4 copies, one thread): compiled was the
# faster up to ~1.5k tokens of dense MLA (144 values a position) and ~5k of DSA (32: its indexer
# keys; it reads latents only for the top-k); at 32k, eager 6.4x (dense) and 1.8x (DSA) faster.
COPIES_MAX_EXTRA_VALUES = 600_000
# The forms of the compiled call (`CompiledDecode`), the default first.
FORMS = COMPILE_FORMS
# The per-row lists of a runner call (`runner.ModelCall`): what `CompiledDecode.with_min_rows` repeats.
_ROW_FIELDS = ("token_ids", "block_tables", "past_lengths", "slots", "counts")
CallT = TypeVar("CallT")


def compiler_available() -> bool:
    """Whether inductor finds the C++ compiler it builds CPU kernels with."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception:  # inductor raises its own error types for a missing compiler
        return False
    return True


class CompiledDecode:
    """(input_ids [B, 1], cache view) -> last-position logits [B, 1, V], through the compiled regions
    (or graph).

    Compiles lazily on first use of each graph class; raises ConfigError where it cannot run
    (training mode, no C++ compiler for CPU kernels)."""

    # Block tables a compiled call reads are at least this wide (the extra column is never read):
    # a table one block wide would specialise to size 1 and compile again for longer contexts.
    min_table_width = 2
    # Batch 1 gathers its pages like any batch, even on consecutive blocks (`PagedBatchView`'s
    # slice_consecutive): one graph for both layouts, for a gather of the context's rows per step.
    slices_consecutive_pages = False

    def __init__(self, model: torch.nn.Module, form: str = FORMS[0]):
        """`form` (one of FORMS): "layers" (the default), each decoder layer as one region shared by
        every layer of its kind (`compiled_regions.py`); "parts", each layer's attention and FFN as
        regions shared by the layers of their kind, the glue between them eager; "whole", the whole
        call as one graph."""
        if form not in FORMS:
            raise ConfigError(f"expected one of {', '.join(FORMS)}, got {form!r}", field="form")
        if model.training:
            raise ConfigError("expected a model in eval mode for the compiled decode graph", field="compile_decode")
        if next(model.parameters()).device.type == "cpu" and not compiler_available():
            cxx = os.environ.get("CXX")
            if cxx and not shutil.which(cxx):  # inductor takes $CXX as it is: say it is the one missing
                raise ConfigError(f"$CXX is {cxx!r}, which is not an executable compiler; fix or unset CXX, or "
                                  "run with --no-compile", field="compile_decode")
            raise ConfigError("needs a C++ compiler for torch.compile's CPU kernels (g++ or $CXX); "
                              "install one or run with --no-compile", field="compile_decode")
        limit_compile_threads()
        probe_vector_isa_once()
        key = model.__dict__.get("_compiled_decode_key")
        if key is None:
            key = model._compiled_decode_key = uuid.uuid4().hex
        self.form = form
        regional = form != "whole"
        self.min_rows = batch_one_rows(model, form)
        self._values_per_position = context_values_per_position(model.config)
        self._model, self._key = decode_form(model, key if regional else None, form), key
        self._call = _decode_call if regional else _compiled_call()

    def __call__(self, input_ids: torch.Tensor, view: object) -> torch.Tensor:
        with decode_tracing():  # once per call, not per region call
            return self._call(self._model, self._key, input_ids, view)

    def runs(self, group: list[tuple[Any, int]]) -> bool:
        """Whether a decode call of these (sequence, tokens) rows goes through the compiled graphs:
        always when it has `min_rows` rows; else only while its copies' share of the context
        (`COPIES_MAX_EXTRA_VALUES`) stays small, so that a lone long sequence decodes eagerly."""
        rows = len(group)
        if rows >= self.min_rows:
            return True
        extra_rows = -(-self.min_rows // rows) * rows - rows
        context = max(seq.num_computed for seq, _ in group) + 1
        return extra_rows * context * self._values_per_position <= COPIES_MAX_EXTRA_VALUES

    def with_min_rows(self, call: CallT, ids: torch.Tensor | None = None) -> tuple[CallT, torch.Tensor | None]:
        """The runner's call (`runner.ModelCall`) and its ids [B, 1] (when given), each row repeated up
        to `min_rows` rows. The copy of a row writes the same values to the same pages and state slot
        as the row itself, so the cache ends as the row alone leaves it; the caller keeps the first B
        rows' logits."""
        rows = len(call.counts)
        if rows >= self.min_rows:
            return call, ids
        copies = -(-self.min_rows // rows)
        return (dataclasses.replace(call, **{name: getattr(call, name) * copies for name in _ROW_FIELDS}),
                None if ids is None else ids.repeat(copies, 1))

    def with_hidden_states(self, input_ids: torch.Tensor, view: object) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's logits [B, 1, V] and the trunk's hidden states [B, 1, D] (the speculative MTP
        catch-up reads them after plain steps, `spec_decode/batch_rule.py`); regional forms only:
        the whole-call graph returns logits alone."""
        if self._call is not _decode_call:
            raise ConfigError("the whole-call graph returns logits only", field="compile_form")
        with decode_tracing():
            out = self._model(input_ids, cache=view, logits_to_keep=1)
        return out.logits, out.hidden_states


def context_values_per_position(config: ModelConfig) -> int:
    """Values a decode step gathers for each past position, over the attention layers: a DSA
    layer its indexer key (latents only for the top-k), a dense MLA layer its latent row."""
    return sum(config.index_head_dim if kind == "dsa" else config.latent_cache_dim
               for kind in config.layer_types if kind in ("mla", "dsa"))


def batch_one_rows(model: torch.nn.Module, form: str) -> int:
    """The rows a compiled call of one sequence runs as (`CompiledDecode.min_rows`, `with_min_rows`).

    Torch specialises size 1, so a call of one row is graph classes of its own, compiled at start
    like the others; regions run it as copies of the row instead, sharing the batches' graphs,
    unless a copy costs more than those graphs save once:
    - the whole call keeps its batch-1 graph (the one-row matmul pass rewrites it);
    - a copy reads the gathered experts again (`copies_reread_experts`): one row, graphs of its own;
    - whole layers over a small stack: as many rows as the all-experts form needs
      (`rows_skipping_expert_gather`), so the gathered-experts graphs are never built;
    - else two rows."""
    if form == "whole" or copies_reread_experts(model):
        return 1
    if form == "layers":
        return max(2, rows_skipping_expert_gather(model))
    return 2


def copies_reread_experts(model: torch.nn.Module) -> bool:
    """Whether a copy of a row makes the batch-1 step read its experts' weights twice, for more
    than the batch-1 graphs cost once: an expert stack over `SMALL_EXPERT_STACK_BYTES` (`small`:
    64 experts of 256 x 256, 50 MB a layer: the step is memory-bound, and the static form
    gathers each row's top-k experts, a copy's too), or int4 stacks (their static form runs
    every row against every gathered expert, so a copy doubles the gather and kernel reads).
    A small stack (`tiny`: 1.2 MB a layer) stays in cache: its copies cost less than the
    graphs' compile at a first start (docs/serving-compiled.md, Compiled decode)."""
    return holds_int4_expert_stacks(model) or largest_expert_stack_bytes(model) > SMALL_EXPERT_STACK_BYTES


def largest_expert_stack_bytes(model: torch.nn.Module) -> int:
    """The weight bytes of the model's largest routed-expert stack (one layer's experts); 0 without MoE."""
    return max((sum(t.numel() * t.element_size() for t in m.experts.parameters())
                for m in model.modules() if isinstance(m, MoE)), default=0)


def rows_skipping_expert_gather(model: torch.nn.Module) -> int:
    """The fewest rows a whole-layer call runs so that every batch takes the experts' all-experts
    form (`ops.moe.gathers_expert_weights`), or 1 where that form does not pay at small batches.

    Each form of the experts is a graph of every MoE layer kind (`tiny`: the KDA and the DSA
    layer, each twice), about a third of the first start. Running batch 1 as the first
    all-experts batch's rows reads every expert's weights instead of gathering its top-k ones:
    for a small stack that costs about what the gather's copy does (`tiny`: 16 experts of
    64 x 96, 1.2 MB a layer; its batch-1 step stayed the same and batch 16 got faster), so the
    gathered graphs are never built. A large stack (`small`: 64 experts of 256 x 256, 50 MB a
    layer, the all-experts form from 8 rows) keeps the gathered form: reading all of it at
    batch 1 would cost more than the graphs save once. So: stacks up to
    `SMALL_EXPERT_STACK_BYTES`, and the all-experts form from at most `MAX_ROW_COPIES` rows
    (beyond, the copies' attention work grows)."""
    stacks = [m for m in model.modules() if isinstance(m, MoE)]
    if not stacks:
        return 1
    c = stacks[0].config
    first_all = next(b for b in range(1, c.num_experts + 1)
                     if not gathers_expert_weights(b, c.num_experts_per_token, c.num_experts))
    if largest_expert_stack_bytes(model) > SMALL_EXPERT_STACK_BYTES or first_all > MAX_ROW_COPIES:
        return 1
    return first_all


def limit_compile_threads() -> None:
    """Inductor compiles on one worker process per core of the machine by default, whatever else
    runs there; the engine's compiles use as many as its torch threads (deltamoe/threads.py's
    policy: never more than the cores). TORCHINDUCTOR_COMPILE_THREADS, when set, wins."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return
    from torch._inductor import config

    config.compile_threads = max(1, min(config.compile_threads, torch.get_num_threads()))


def probe_vector_isa_once() -> None:
    """Inductor proves every vector ISA the CPU reports (AVX2, AVX-512, AVX-512 VNNI, AMX on a
    recent x86) by compiling a test against ATen's vector headers, once per inductor cache: about
    15 s of a first start on two cores, for the one ISA it then uses, the best. Here only that best
    ISA's test is compiled; when it builds, the lower ones are taken as given (a compiler that
    builds for AVX-512 builds for AVX2), else inductor probes them all as usual. AMX's own checks
    still run. TORCHINDUCTOR_VEC_ISA_OK, when set, wins; other CPUs are left to inductor."""
    from torch._inductor import config, cpu_vec_isa

    if config.cpp.vec_isa_ok is not None or platform.machine() not in ("x86_64", "AMD64"):
        return
    reported = cpu_vec_isa.x86_isa_checker()
    best = next((isa for isa in cpu_vec_isa.supported_vec_isa_list
                 if str(isa) and all(flag in reported for flag in str(isa).split())), None)
    if best is not None and best.check_build(cpu_vec_isa.VecISA._avx_code):
        config.cpp.vec_isa_ok = True


def decode_form(module: torch.nn.Module, regions_key: str | None = None, form: str = "parts") -> torch.nn.Module:
    """The module tree the graph traces: new module objects over the same parameters and buffers
    (shared, never copied: in-place weight updates reach both), with every MoE that runs its
    experts locally dispatching to the static form. The served model itself is left as it is:
    its eager calls (prefill chunks) keep the sorted expert form.
    `regions_key`: the model's key when the decoder layers run through compiled regions
    (`compiled_regions.py`); None when the whole call is one graph. `form`: the regions'
    boundary: each layer's attention and FFN ("parts") or whole decoder layers ("layers")."""
    twin = copy.copy(module)  # shares _parameters and _buffers; _modules is replaced below
    twin._modules = {name: decode_form(child, regions_key, form) if child is not None else None
                     for name, child in module._modules.items()}
    if regions_key is not None and form == "layers" and isinstance(twin, DeltaMoEModel):
        twin.forward = LayerRegionTrunk(twin, regions_key, compile_for_decode)
    if regions_key is not None and form == "parts" and isinstance(twin, DecoderLayer):
        twin.self_attn.forward = AttentionRegion(twin.self_attn, regions_key, compile_for_decode)
        # A dense MLP (three matmuls and an activation: a dozen ops) stays eager: fusing its
        # activation saves microseconds a step, its own graph costs seconds on a first start.
        if twin.is_moe:
            twin.block_sparse_moe.forward = FFNRegion(twin.block_sparse_moe, regions_key, compile_for_decode)
    if isinstance(twin, MoE) and twin.dispatcher is packed_local_experts:
        twin.dispatcher = packed_experts_static_dispatcher(twin.experts)
    elif isinstance(twin, MoE) and twin.dispatcher is local_experts:
        twin.dispatcher = local_experts_static
    elif isinstance(twin, MoE):
        # Expert-parallel dispatch (`serve/executor/sharding.py`): its all-to-all sizes depend on the
        # routing, so it runs eagerly between the graph before it and the graph after (a graph break),
        # the same calls as in an eager step; the work around it stays compiled.
        twin.dispatcher = torch.compiler.disable(twin.dispatcher)
    if isinstance(twin, LatentAttention):
        twin.pads_topk = True
    # Quantized weights held as plain tensors (not parameters) would be traced with symbolic sizes,
    # which the graphs do not need and inductor's on-disk cache cannot check again (a warm start
    # failed on them): their sizes are fixed, as parameters' are.
    for tensor in plain_tensor_operands(twin):
        torch._dynamo.mark_static(tensor)
    return twin


def _decode_call(model: torch.nn.Module, model_key: str, input_ids: torch.Tensor, cache: object) -> torch.Tensor:
    if not model_key:  # reading the key makes torch guard the graph on it (see the module docstring)
        raise ValueError("model_key: expected a non-empty key")
    return model(input_ids, cache=cache, logits_to_keep=1).logits


@functools.cache
def _compiled_call() -> Callable[..., torch.Tensor]:
    """The compiled `_decode_call` (see `compile_for_decode`)."""
    return compile_for_decode(_decode_call)


@contextlib.contextmanager
def decode_tracing() -> Iterator[None]:
    """The tracing settings of the compiled decode call, read when a call compiles; torch.compile
    takes no option for them, so `CompiledDecode.__call__` (and the speculative calls,
    `spec_decode/compiled_verify.py`, `compiled_draft.py`) set them around each call (as torch's
    own `dynamic=True` patches its config around every call), for the compiled decode only, not
    process-wide:
    - every dynamic size its own symbol: torch's default "duck shaping" gives sizes that happen to
      be equal at trace time one symbol: a block table two blocks wide next to two KDA heads came
      out as "width == 2", and every longer context then compiled again, in the middle of traffic;
    - Python floats the code reads (the config's eps, betas, scales) are constants of the model:
      traced as symbols by default, inductor then specialises them and dynamo traces the whole
      graph again (a restart per graph, about a fifth of a first start's compile).
    Torch's own low-overhead patchers (`_make_closure_patcher`, what `dynamic=True` uses): a
    `config.patch` costs about a tenth of a millisecond per entry."""
    set_shapes, set_floats = _tracing_patchers()
    revert_shapes, revert_floats = set_shapes(), set_floats()
    try:
        yield
    finally:
        revert_floats()
        revert_shapes()


@functools.cache
def _tracing_patchers() -> tuple[Callable[[], Callable[[], None]], Callable[[], Callable[[], None]]]:
    from torch.fx.experimental import _config as shape_config

    return (shape_config._make_closure_patcher(use_duck_shape=False),
            torch._dynamo.config._make_closure_patcher(specialize_float=True))


@functools.cache
def compile_for_decode(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` compiled for decode, every size dynamic; called under `decode_tracing`."""
    # cpp_wrapper: the graph's launcher is C++ too, not Python calling ~150 kernels and matmuls one
    # by one. The matvec pass turns one-sequence decode's [1, K] @ [K, N] calls into fused
    # reductions (decode_matvec_pass.py). Not `cpp_wrapper_build_separate` (the launcher at -O1
    # apart from the kernels): it shortens a first start, but the multi-step, attention + FFN and
    # whole-call graphs decode 20-30 % slower with it (docs/serving-compiled.md).
    return torch.compile(fn, dynamic=True, recompile_limit=RECOMPILE_LIMIT,
                         options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                                  "cpp_wrapper": True,
                                  "post_grad_custom_post_pass": DecodeMatvecPass()})


# ---------------------------------------------------------------------------- warm-up plan
@dataclass(frozen=True)
class WarmUpRound:
    """Made-up requests that reach one graph class through the scheduler's normal path.

    The lead request goes first; once it has its first token, the followers join. Every request
    finishes by itself (max_tokens), so the round ends when the engine is idle again."""

    graph: str  # the class it reaches, for messages
    lead: tuple[int, int]  # (prompt length, max_tokens)
    followers: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class WarmUpCall:
    """One call of a compiled speculative region (`spec_decode/compiled_verify.py`, `compiled_draft.py`)
    over made-up rows, for a graph class no made-up request reaches for certain: the shapes of those
    calls follow what the drafts keep. `rows` rows of `positions` new positions each, after a past
    of one token; `SpeculativeRunner.warm_up_call` runs it."""

    graph: str  # the class it reaches, for messages
    kind: str  # "verification" or "draft"
    rows: int
    positions: int


def expert_form_budget(model: torch.nn.Module) -> int | None:
    """The all-experts budget `ops.moe.static_expert_form` applies to `model`'s expert stacks:
    int4 stacks' own at this thread count (`ops.int4_experts.all_experts_budget`), else None
    (full precision's)."""
    return int4_experts.all_experts_budget() if holds_int4_expert_stacks(model) else None


def warm_up_rounds(config: ModelConfig, max_num_seqs: int, max_context: int,
                   extra_macs_per_expert: int | None = None) -> list[WarmUpRound]:
    """One round per decode graph class that a server with these limits can meet.

    Contexts are one class (DSA's selection is top_k wide at every context in the compiled form)
    and so are page layouts (every batch gathers its pages); batches split where an op's shape
    rule changes form:
    - batch 1: the lead alone decodes once (where regions run it as copies of its row,
      `batch_one_rows`, it reaches the graphs of those rows: its round then compiles them and
      that batch's round compiles nothing);
    - batch B >= 2: B - 1 followers join the lead, and all decode together once (the followers
      are admitted in one step while the token budget holds 2 per follower).
    `max_context`: the longest sequence the engine admits (prompt + output); `extra_macs_per_expert`:
    the experts' budget (`expert_form_budget`)."""
    batches = _first_of_each_form(lambda b: expert_form(config, b, extra_macs_per_expert), range(2, max_num_seqs + 1))
    # The lead's first decode sees context prompt + 1 (2: a one-token context is a prefill).
    rounds = [WarmUpRound("batch 1", (1, 2))] if max_context >= 3 else []
    if max_context >= 4:  # the lead decodes twice: once alone, once beside its followers
        rounds += [WarmUpRound(f"batch {batch}", (1, 3), ((2, 2),) * (batch - 1)) for batch in batches]
    return rounds


def expert_form(config: ModelConfig, rows: int, extra_macs_per_expert: int | None = None) -> str | None:
    """The form of the routed experts (`ops.moe.static_expert_form`) a compiled graph of `rows` rows
    (tokens) takes; None without routed experts."""
    if config.num_experts == 0:
        return None
    return static_expert_form(rows, config.num_experts_per_token, config.num_experts, config.expert_dim,
                              config.moe_intermediate_size, extra_macs_per_expert)


def first_of_each_class(shapes: Iterable[CallT], graph_class: Callable[[CallT], object],
                        cost: Callable[[CallT], object]) -> list[CallT]:
    """The cheapest of `shapes` (by `cost`) for each answer of `graph_class`, in the order of their costs:
    one call per graph class, the class of a call told by the same shape rules its ops apply."""
    cheapest: dict[object, CallT] = {}
    for shape in shapes:
        key = graph_class(shape)
        if key not in cheapest or cost(shape) < cost(cheapest[key]):
            cheapest[key] = shape
    return sorted(cheapest.values(), key=cost)


def _first_of_each_form(form: Callable[[int], object], sizes: range) -> list[int]:
    """The first size of each run of consecutive sizes for which `form` gives the same answer."""
    firsts: list[int] = []
    previous: object = object()
    for size in sizes:
        answer = form(size)
        if not firsts or answer != previous:
            firsts.append(size)
        previous = answer
    return firsts
