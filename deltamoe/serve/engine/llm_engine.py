"""LLMEngine: add requests, `step()` them forward together, read outputs. Offline `generate` on top.

nano-vllm's shape: the scheduler decides (policy), the cache holds memory, the executor runs the
model (in this process, or over tp * ep worker ranks: `serve/executor/`); `step()` is schedule ->
execute -> postprocess. Not thread-safe: one thread drives it (`AsyncLLMEngine` owns that thread
for the server).
"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deltamoe.errors import ConfigError, RequestError
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.compiled_decode import WarmUpCall, WarmUpRound, expert_form_budget, warm_up_rounds
from deltamoe.serve.engine.config import EngineConfig, check_max_model_len
from deltamoe.serve.engine.detokenizer import IncrementalDetokenizer
from deltamoe.serve.engine.forks import ForkBook, start_forks
from deltamoe.serve.engine.image_inputs import place_images
from deltamoe.serve.engine.multi_step import MultiStepResult, emit_window, multi_step_decode
from deltamoe.serve.engine.outputs import Completion, EngineStats, RequestOutput
from deltamoe.serve.engine.runner import ModelRunner, StepResult
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.engine.scheduler import Scheduler
from deltamoe.serve.executor.base import Executor
from deltamoe.serve.executor.config import WorkerConfig, launched_by_torchrun
from deltamoe.serve.executor.group import RankGroup
from deltamoe.serve.executor.held_loads import HeldLoads
from deltamoe.serve.executor.multiproc import MultiprocExecutor
from deltamoe.serve.executor.overlap import OverlappedSteps
from deltamoe.serve.executor.uniproc import UniprocExecutor
from deltamoe.serve.engine.sequence import Sequence
from deltamoe.serve.spec_decode.runner import (acceptance_restorer, speculation_counters, speculation_stats,
                                               speculative_runner, verification_warm_up_rounds)
from deltamoe.serve.spec_decode.step_result import SpeculativeStepResult, emit_speculative
from deltamoe.tokenizers.base import Tokenizer
from deltamoe.tokenizers.load import load_tokenizer
from deltamoe.vision.preprocess import PreparedImage

if TYPE_CHECKING:
    from deltamoe.serve.kv_transfer.connector import KVConnector


class LLMEngine:
    def __init__(self, model: DeltaMoEForCausalLM, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None, group: RankGroup | None = None,
                 connector: KVConnector | None = None):
        """`group`: the worker ranks when `model` is rank 0's shard of a tp * ep replica
        (`from_pretrained(..., workers=...)` starts them); None runs the whole model here.
        `connector`: hands caches to / takes them from other engines (serve/kv_transfer/)."""
        self.config = config or EngineConfig()
        self.model_config = model.config
        self.tokenizer = tokenizer or load_tokenizer(None, model.config.vocab_size)
        check_max_model_len(self.config.max_model_len, model.config.max_position_embeddings)
        self.max_model_len = self.config.max_model_len or model.config.max_position_embeddings
        self.cache = HybridCache(model.config, self.config, self.max_model_len, dtype=model.dtype, device=model.device,
                                 tp_size=group.dims.tp if group is not None else 1)
        # The longest sequence served: what the cache holds, where that is less (reported as such by
        # /v1/models and /tokenize, which clients size their requests by).
        self.max_model_len = min(self.max_model_len, self.cache.max_tokens_per_sequence())
        pools = self.cache  # what the connector registers and hands off
        if connector is not None and group is not None:  # rank 0's copy travels (kv_transfer/worker_state.py)
            from deltamoe.serve.kv_transfer.worker_state import hand_off_pools

            pools = hand_off_pools(self.cache, group.dims.tp)
        self.connector = connector
        if connector is not None:
            connector.bind(pools, model.config)
        # With async scheduling a decode role's loads start at a step boundary (executor/held_loads.py).
        loads = HeldLoads(connector) if connector is not None and self.config.async_scheduling else None
        self.scheduler = Scheduler(self.config, self.cache, loads or connector)
        self.runner = ModelRunner(model, self.cache, compiled_decode=self.config.compile_decode,
                                  compile_form=self.config.compile_form)
        if self.config.speculative is not None:  # MTP drafts verified in one forward (serve/spec_decode/)
            self.runner = speculative_runner(model, self.cache, self.config, min(
                self.max_model_len, self.cache.max_tokens_per_sequence()), group is not None, connector)
        self.executor: Executor = UniprocExecutor(self.runner) if group is None else MultiprocExecutor(self.runner, group)
        if connector is not None and group is not None:  # the ranks get handed-off caches from rank 0
            from deltamoe.serve.kv_transfer.worker_state import RankZeroHandOffs

            self.executor.hand_off = RankZeroHandOffs(self.cache, pools, group.dims.tp)
        # Windows of up to num_scheduler_steps decode steps per trip through the scheduler (None: one step).
        self.multi_step = multi_step_decode(self.runner, self.cache, self.config, group is not None, connector is not None)
        # One-step-ahead scheduling: step N+1 is scheduled while step N runs (None: one step at a time).
        self.overlap = OverlappedSteps(self.executor, self.scheduler, self._take_token, loads) \
            if self.config.async_scheduling else None
        self.device = model.device
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._seeds = random.Random(self.config.seed)
        self._totals = {"prompt_tokens": 0, "generation_tokens": 0, "finished": 0, "steps": 0}
        # Why a request finished with 'error' (read and popped by the caller): a RequestError when the request
        # itself was at fault (a 4xx), else a message.
        self.errors: dict[str, str | RequestError] = {}
        self.forks = ForkBook()  # choices waiting to share another choice's prefill (n > 1)
        self.last_batch_size = 0  # sequences in the last step (0: it only waited for transfers)

    @classmethod
    def from_pretrained(cls, source: str | Path, config: EngineConfig | None = None,
                        tokenizer: str | Path | None = None, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", workers: WorkerConfig | None = None,
                        connector: KVConnector | None = None) -> "LLMEngine":
        """A checkpoint folder or preset; the tokenizer comes from `tokenizer`, else the folder, else bytes.

        `workers` with tp * ep > 1: this process becomes rank 0 of a replica over that many ranks
        (spawned here, or the torchrun job it runs in). On a torchrun rank > 0 this call serves rank
        0's steps until rank 0 shuts down, then raises SystemExit(0): the process is done."""
        from deltamoe.model.load import load_model

        group = None
        tok_path = tokenizer if tokenizer is not None else (source if Path(str(source)).is_dir() else None)
        if workers is not None:
            workers.check_fields()
        if workers is not None and (workers.world_size > 1 or launched_by_torchrun()):
            from deltamoe.hf_config import load_config
            from deltamoe.serve.executor.launch import start_replica

            config = config or EngineConfig()
            if config.compile_decode and config.compile_form == "whole":
                # Its one graph would hold the vocabulary collectives and the expert dispatch; the regional
                # forms keep those in the eager glue or between graphs.
                raise ConfigError("--compile-form whole with --tp/--ep workers: not yet; use layers or parts",
                                  field="compile_form")
            # What would fail after every rank loaded its shard is checked before any starts: the
            # tokenizer, and a cache that holds one block and one state slot on each rank.
            model_config = load_config(source)
            tok = load_tokenizer(tok_path, model_config.vocab_size)
            HybridCache.plan(model_config, config, config.max_model_len or model_config.max_position_embeddings,
                             dtype, workers.tp)
            started = start_replica(source, config, workers, dtype, str(device))
            if started is None:
                raise SystemExit(0)
            model, group = started
            return cls(model, tok, config, group, connector)
        model = load_model(source, dtype=dtype, device=device)
        return cls(model, load_tokenizer(tok_path, model.config.vocab_size), config, group, connector)

    def shutdown(self) -> None:
        """Stop the worker ranks, if any (idempotent; also runs at interpreter exit)."""
        if self.overlap is not None:
            self.overlap.shutdown()
        self.executor.shutdown()

    # ------------------------------------------------------------------ requests
    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, priority: int = 0, stream_text: bool = True,
                      images: list[PreparedImage] | None = None) -> Sequence:
        """Validate and tokenize a request without touching engine state (safe from any thread).

        `images` (`deltamoe.vision.preprocess`): their placeholders are in a token-id prompt already
        (the chat template writes them), or go in front of a text prompt (`image_inputs.place_images`).

        `stream_text=False`: text is only read once finished (offline `generate`), so without stop
        strings it is decoded once at the end instead of token by token."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"expected SamplingParams, got {type(params).__name__}", field="sampling_params")
        params.validate(self.model_config.vocab_size)
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < self.model_config.vocab_size for t in ids):
                raise RequestError(f"token ids must lie in [0, {self.model_config.vocab_size})", field="prompt")
        else:
            raise RequestError("expected a string or a list of token ids", field="prompt")
        if not ids:
            raise RequestError("must not be empty", field="prompt")
        seq_images = None
        if images:
            if self.model_config.vision is None:
                raise RequestError("this model has no vision tower", field="images")
            ids, seq_images = place_images(ids, images, self.model_config.media_placeholder_token_id,
                                           isinstance(prompt, str))
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestError(f"expected an integer, got {priority!r}", field="priority")
        room = min(self.max_model_len, self.cache.max_tokens_per_sequence()) - len(ids)
        if room < 1:
            raise RequestError(f"{len(ids)} prompt tokens leave no room to generate (limit "
                               f"{min(self.max_model_len, self.cache.max_tokens_per_sequence())} tokens)", field="prompt")
        if params.max_tokens is not None and params.max_tokens > room:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the limit of "
                               f"{len(ids) + room} tokens", field="max_tokens")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        seq = Sequence(
            request_id=str(request_id) if request_id is not None else f"req-{next(self._ids)}",
            token_ids=ids, num_prompt_tokens=len(ids), params=params,
            generator=torch.Generator(device=self.device).manual_seed(seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                               params.include_stop_str_in_output, stream=stream_text),
            max_tokens=params.max_tokens or room, stop_ids=frozenset(stop_ids), priority=priority,
            prompt=prompt if isinstance(prompt, str) else None, images=seq_images)
        if params.structured is not None:
            from deltamoe.serve.structured.matcher import GrammarMatcher

            seq.grammar = GrammarMatcher(params.structured, self.tokenizer, self.model_config.vocab_size, seq.stop_ids)
        return seq

    def _check_layout_serves(self, seq: Sequence) -> None:
        """Request features this engine's layout cannot serve yet: a RequestError naming the field, never a
        request served without them. One-step-ahead steps (--async-scheduling) sample on the device
        thread, without the grammar matcher a structured output advances with each token. (Every
        other feature is served in every layout: prompt logprobs and forked choices' first tokens are
        drawn on the device thread, `overlap.py`; images travel to --tp/--ep workers as rows,
        `executor/image_rows.py`, and to a prefill server as pixels, `kv_transfer/image_payload.py`.)"""
        if self.overlap is not None and seq.params.structured is not None:
            raise RequestError("structured outputs with --async-scheduling: not yet",
                               field=getattr(seq.params.structured, "field", "response_format"))

    def add_sequence(self, seq: Sequence) -> str:
        if seq.request_id in self._requests:
            raise RequestError(f"{seq.request_id!r} is already running", field="request_id")
        self._check_layout_serves(seq)
        self._requests[seq.request_id] = seq
        self._totals["prompt_tokens"] += seq.num_prompt_tokens
        if seq.fork_of is not None:  # waits for its parent's prefill (forks.py)
            self.forks.hold(seq)
            return seq.request_id
        self.forks.attach(seq)
        self.scheduler.add(seq)
        return seq.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    images: list[PreparedImage] | None = None) -> str:
        """Queue a request; returns its id. Lower `priority` values are served (and kept) first."""
        return self.add_sequence(self.make_sequence(prompt, params, request_id, priority, images=images))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its memory; its final output (finish_reason 'abort'), or None if unknown."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        self.forks.drop(seq, self._requests.get(seq.fork_of or ""))
        for child in seq.forks:  # its waiting choices now prefill on their own
            self.scheduler.add(child)
        seq.forks = []
        self.scheduler.finish(seq, "abort")
        return self._output(seq, [], "", None)

    def abort_all(self) -> list[RequestOutput]:
        """Stop every request, waiting or running, and free its memory; their final outputs."""
        return [out for request_id in list(self._requests) if (out := self.abort(request_id)) is not None]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        failed = [self._fail(seq, reason) for seq, reason in self.scheduler.take_failed()]
        self.last_batch_size = len(batch.items)
        if self.overlap is not None:
            self._totals["steps"] += 1
            return failed + self._step_ended(self.overlap.step(batch))
        if self.connector is not None:
            self.connector.start_load_kv()
        results = (self.multi_step or self.executor).execute(batch) if batch else []
        if self.connector is not None:
            self.connector.wait_for_save()
        self._totals["steps"] += 1
        outputs = [out for r in results if (out := self._postprocess(r)) is not None]
        return failed + self._step_ended(outputs + [out for r in start_forks(self, results)
                                                    if (out := self._postprocess(r)) is not None])

    def _step_ended(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A step's outputs, once the connector knows every request the step finished (`step_ended`)."""
        if self.connector is not None:
            self.connector.step_ended()
        return outputs

    def _fail(self, seq: Sequence, reason: str) -> RequestOutput:
        """A request the scheduler finished with 'error' (its cache never arrived); `errors` says why."""
        self._requests.pop(seq.request_id, None)
        self.errors[seq.request_id] = reason
        return self._output(seq, [], "", None)

    def _postprocess(self, r: StepResult) -> RequestOutput | None:
        if isinstance(r, MultiStepResult) and r.restore is None:  # a window's tokens, one output (multi_step.py)
            return emit_window(self._take_token, self.cache, r)
        if isinstance(r, SpeculativeStepResult):  # several tokens from one verification (serve/spec_decode/)
            return emit_speculative(self._postprocess, r)
        seq = r.seq
        seq.num_computed += r.num_computed
        self.cache.commit(seq)
        if r.prompt_logprobs:
            seq.prompt_logprobs.extend(r.prompt_logprobs)
        if r.token is None:
            return None
        seq.token_ids.append(r.token)
        return self._take_token(seq, r.token, r.logprob)

    def _take_token(self, seq: Sequence, token: int, logprob) -> RequestOutput:
        """A sampled token, already in `seq.token_ids`: stop checks, detokenizing, the request's output."""
        self._totals["generation_tokens"] += 1
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        stop_reason: str | int | None = None
        if token in seq.stop_ids:  # a stop token ends the text without adding its own
            reason, stop_reason, delta = "stop", token, ""
        else:
            delta = seq.detokenizer.push(token)
            stop_reason = seq.detokenizer.stopped_by
            if seq.grammar is not None:
                seq.grammar.accept(token)
            # A complete grammar admits nothing more: the output is whole, as if a stop token came.
            done = stop_reason is not None or (seq.grammar is not None and seq.grammar.done)
            reason = "stop" if done else "length" if seq.num_output_tokens >= seq.max_tokens else None
        if seq.grammar is not None and (failure := seq.grammar.failed) is not None:
            # Never an output presented as complete that its grammar did not produce.
            self.errors[seq.request_id] = RequestError(f"the grammar failed while matching the output: {failure}",
                                                       field=seq.grammar.field, hint="simplify it")
            reason = "error"
        if reason is not None:
            seq.stop_reason = stop_reason
            delta += seq.detokenizer.flush()
            self.scheduler.finish(seq, reason)
            self._requests.pop(seq.request_id, None)
            self._totals["finished"] += 1
        return self._output(seq, [token], delta, logprob, stop_reason)

    def _output(self, seq: Sequence, new_ids: list[int], delta: str, logprob, stop_reason=None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, delta_text=delta, delta_token_ids=new_ids,
            delta_logprobs=([logprob] if logprob is not None else []) if seq.params.logprobs is not None else None,
            text=seq.detokenizer.text[:seq.detokenizer.emitted], num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
            finished=seq.finished, finish_reason=seq.finish_reason, stop_reason=stop_reason,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None and seq.num_output_tokens <= 1
            and new_ids else None)

    # ------------------------------------------------------------------ offline
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = True, images: list[list[PreparedImage] | None] | None = None) -> list[Completion]:
        """Run a batch of prompts to completion; results in prompt order. `images[i]`: prompt i's images."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise RequestError(f"{len(params_list)} sampling params for {len(prompts)} prompts", field="params")
        images_list = images if images is not None else [None] * len(prompts)
        if len(images_list) != len(prompts):
            raise RequestError(f"{len(images_list)} image lists for {len(prompts)} prompts", field="images")
        seqs = [self.make_sequence(p, sp, stream_text=False, images=im)
                for p, sp, im in zip(prompts, params_list, images_list)]
        for seq in seqs:
            self.add_sequence(seq)
        pending = {s.request_id for s in seqs}
        with _Progress(len(seqs), enabled=progress) as bar:
            while pending:
                outputs = self.step()
                bar.advance(sum(len(o.delta_token_ids) for o in outputs),
                            sum(o.finished and o.request_id in pending for o in outputs))
                pending -= {o.request_id for o in outputs if o.finished}
        return [Completion(request_id=s.request_id, prompt_token_ids=s.token_ids[:s.num_prompt_tokens],
                           text=s.detokenizer.text, token_ids=s.output_ids, finish_reason=s.finish_reason or "",
                           stop_reason=s.stop_reason, logprobs=s.logprobs if s.params.logprobs is not None else None,
                           num_cached_tokens=s.num_cached_tokens, prompt=s.prompt,
                           prompt_logprobs=s.prompt_logprobs if s.params.prompt_logprobs is not None else None)
                for s in seqs]

    def warm_up(self) -> None:
        """Compile every decode graph a server meets before traffic does (compiled decode only), so
        that no request waits for a compile mid-stream (one takes ~10-60 s). Sends the made-up
        requests of `compiled_decode.warm_up_rounds` through the scheduler like any others, and
        with speculation makes the calls of `spec_decode.runner.verification_warm_up_rounds` over
        made-up sequences, then forgets them: request ids, seeds, statistics, prefix cache and the
        order of free blocks and slots are as before. Call it at startup, before requests arrive."""
        if not self.runner.compiles_decode:
            return
        if self.has_unfinished():
            raise RuntimeError("warm_up: expected an idle engine (call it at startup, before requests arrive)")
        limit = min(self.max_model_len, self.cache.max_tokens_per_sequence())
        rounds = warm_up_rounds(self.model_config, self.config.max_num_seqs, limit,
                                expert_form_budget(self.runner.model))
        rounds += verification_warm_up_rounds(self.runner, limit)
        totals, preemptions = dict(self._totals), self.scheduler.num_preemptions
        restore_acceptance = acceptance_restorer(self.runner)
        try:
            for round_ in rounds:
                with self.cache.leaving_no_trace():
                    try:
                        self._run_warm_up_round(round_)
                    finally:
                        self.abort_all()  # nothing left behind, even when a compile fails
        finally:
            self._totals, self.scheduler.num_preemptions = totals, preemptions
            restore_acceptance()
            self.executor.forget_stats()  # the ranks' forward seconds held the compiles

    def _run_warm_up_round(self, round_: WarmUpRound | WarmUpCall) -> None:
        def request(name: str, prompt_len: int, max_tokens: int) -> Sequence:
            # Own ids and seeds: the engine's counters stay untouched.
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=0)
            return self.make_sequence([1] * prompt_len, params, request_id=f"warm-up-{name}", stream_text=False)

        if not isinstance(round_, WarmUpRound):  # a speculative region's call (`WarmUpCall`), made directly
            self.runner.warm_up_call(round_, lambda name: request(name, 1, 1))
            return
        lead = request("lead", *round_.lead)
        self.add_sequence(lead)
        while not lead.output_ids:
            self.step()
        for i, follower in enumerate(round_.followers):
            self.add_sequence(request(str(i), *follower))
        while self.has_unfinished():
            self.step()

    # ------------------------------------------------------------------ metrics
    def stats(self) -> EngineStats:
        c = self.cache
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions, num_blocks=c.blocks.num_blocks,
            num_free_blocks=c.blocks.num_free, block_usage=c.block_usage, num_state_slots=c.slots.num_slots,
            slot_usage=c.slot_usage, num_snapshots=len(c.slots.snapshots), prefix_hit_rate=c.prefix_hit_rate,
            prefix_hit_tokens=c.prefix_hits, prefix_query_tokens=c.prefix_queries,
            prompt_tokens_total=self._totals["prompt_tokens"], generation_tokens_total=self._totals["generation_tokens"],
            requests_finished=self._totals["finished"], steps=self._totals["steps"],
            extra={**self._transfer_stats(), **speculation_stats(self.runner)},
            extra_counters=speculation_counters(self.runner) | (self.connector.counter_stats() if self.connector else frozenset()))

    def _transfer_stats(self) -> dict[str, float]:
        if self.connector is None:
            return {}
        return {**self.connector.stats(), "kv_transfer_loading": float(len(self.scheduler.loading)),
                "kv_transfer_pinned": float(len(self.scheduler.pinned))}


class _Progress:
    """A rich progress bar over requests that also shows output tokens per second (plain lines where
    stderr is not a terminal: `deltamoe.plain_progress`)."""

    def __init__(self, total: int, enabled: bool):
        self.enabled, self.total = enabled, total
        self.tokens, self.start, self.finished = 0, time.perf_counter(), 0
        self._plain = None

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            from deltamoe.plain_progress import PlainProgress

            console = Console(stderr=True)
            if not console.is_terminal:
                self._plain = PlainProgress("generate", self.total, console)
                return self
            self._bar = Progress(TextColumn("generate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[rate]}"), transient=False, console=console)
            self._bar.__enter__()
            self._task = self._bar.add_task("generate", total=self.total, rate="")
        return self

    def advance(self, tokens: int, finished: int) -> None:
        self.tokens += tokens
        self.finished += finished
        if self.enabled:
            rate = f"{self.tokens / max(time.perf_counter() - self.start, 1e-9):,.0f} tok/s"
            if self._plain is not None:
                self._plain.update(self.finished, rate)
            else:
                self._bar.update(self._task, advance=finished, rate=rate)

    def __exit__(self, *exc: object) -> None:
        if self._plain is not None:
            self._plain.close()
        elif self.enabled:
            self._bar.__exit__(*exc)
