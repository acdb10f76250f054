"""`deltamoe generate | chat | serve`: offline generation, terminal chat, and the HTTP server's entry.

Bad input (model path, sampling field, cache size, address) raises a DeltaMoEError; the top-level
CLI prints it as one line and exits with code 2. Everything a user can get wrong is checked
before torch and the model load, and torch and the serving internals are imported inside the
commands, so `--help` and these errors take a fraction of a second.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from deltamoe.errors import ConfigError
from deltamoe.hf_config import load_config
from deltamoe.serve.engine.config import EngineConfig, check_speculative_layout
from deltamoe.serve.engine.multi_step_layouts import GENERATE_DEFAULT_STEPS, check_multi_step, resolve_generate_steps
from deltamoe.serve.kv_transfer.role_config import DIRECT_MAX_SEGMENTS, INLINE_WRITE, MARKERS
from deltamoe.threads import THREADS_HELP, choose_threads

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")


def check_dtype(name: str) -> str:
    if name not in DTYPES:
        raise ConfigError(f"expected one of {list(DTYPES)}, got {name!r}", field="dtype")
    return name


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def check_device(name: str) -> str:
    """cpu, or cuda[:N] on a torch build that sees that GPU: a one-line error before the model loads."""
    if name == "cpu":  # the default: no torch import for it (early errors stay fast)
        return name
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"expected cpu or cuda[:N], got {name!r}", field="device") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"expected cpu or cuda[:N], got {name!r}", field="device")
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise ConfigError(f"{name!r}: this torch sees {torch.cuda.device_count() if torch.cuda.is_available() else 'no'} "
                          "CUDA device(s)", field="device", hint="--device cpu")
    return name


SPECULATIVE_ONLY = (("num_draft_tokens", "--num-draft-tokens"), ("spec_min_acceptance", "--spec-min-acceptance"),
                    ("spec_max_batch", "--spec-max-batch"))


def check_options_need_their_mode(ctx: typer.Context, speculative: Optional[str],
                                  compile_decode: Optional[bool]) -> None:
    """An option given on the command line for a mode that is off (--num-draft-tokens without
    --speculative, --compile-form with --no-compile) is a one-line error, not silently unused."""

    def given(name: str) -> bool:  # typed or from the environment, not the option's default
        source = ctx.get_parameter_source(name) if name in ctx.params else None
        return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")

    if speculative is None:
        for name, flag in SPECULATIVE_ONLY:
            if given(name):
                raise ConfigError(f"{flag} applies only with --speculative mtp", field=name)
    if compile_decode is False and given("compile_form") and given("compile_decode"):
        raise ConfigError("--compile-form applies only with --compile (--no-compile decodes eagerly)",
                          field="compile_form")


def check_log_level(name: str) -> str:
    if name.lower() not in LOG_LEVELS:
        raise ConfigError(f"expected one of {list(LOG_LEVELS)}, got {name!r}", field="log_level")
    return name.lower()


def parse_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, check_dtype(name))


def bind_listen_address(host: str, port: int) -> socket.socket:
    """Bind host:port the way uvicorn would, before the model loads: an unknown host or a port in use
    is a one-line error, not a traceback or uvicorn's exit 3 after minutes of loading. The bound
    socket is handed to the server, so no other process can take the port in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # uvicorn's rule
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn, so TIME_WAIT does not count
    with contextlib.ExitStack() as on_error:
        on_error.callback(sock.close)
        try:
            sock.bind((host, port))
        except socket.gaierror as e:
            raise ConfigError(f"cannot resolve {host!r} ({e.strerror})", field="host",
                              hint="an address of this machine such as 127.0.0.1 or 0.0.0.0") from e
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"{host}:{port} is already in use", field="port",
                                  hint="pick another --port or stop the process that holds it") from e
            if e.errno == errno.EACCES:
                raise ConfigError(f"no permission to bind {host}:{port}", field="port",
                                  hint="ports below 1024 need privileges; pick a higher --port") from e
            if e.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"{host!r} is not an address of this machine", field="host",
                                  hint="127.0.0.1 for local clients, 0.0.0.0 for every interface") from e
            raise ConfigError(f"cannot bind {host}:{port} ({e.strerror or e})", field="port") from e
        on_error.pop_all()
    return sock


def engine_threads(requested: Optional[int], async_scheduling: bool = False) -> int:
    """Torch threads for the serving engine: `deltamoe.threads.choose_threads` keeping one core for
    the HTTP front end (and on a workstation, the clients): on two cores, two intra-op threads beside
    a busy front end made the online benchmark's streams 3x slower (TPOT p50 56 vs 14 ms at 8
    clients); and one more for async scheduling's host thread (`host_thread_reserve`).
    `--threads` or OMP_NUM_THREADS, when given, stand as they are."""
    return choose_threads(requested, reserve=1 + host_thread_reserve(async_scheduling))


def host_thread_reserve(async_scheduling: bool) -> int:
    """Cores kept for async scheduling's host thread, which schedules beside the step's intra-op
    threads: with both of two cores' threads spinning on every op, a host thread beside them ran
    `small` at 0.43x one step at a time (113 against 265 tok/s), and with one torch thread at 161
    (docs/serving-workers.md)."""
    return 1 if async_scheduling else 0


TP_HELP = ("Tensor-parallel ranks: attention heads, MLP widths and the vocabulary split over this many "
           "processes (started here; or the torchrun job's ranks).")
EP_HELP = "Expert-parallel ranks: routed experts split over this many processes (tp * ep processes in all)."


def check_workers(model: str, tp: int, ep: int):
    """The worker layout checked against the model's config before anything loads (or any rank
    starts); None for one process."""
    from deltamoe.serve.executor.config import WorkerConfig
    from deltamoe.serve.executor.config import launched_by_torchrun

    import os

    workers = WorkerConfig(tp=tp, ep=ep)
    workers.check_fields()
    if workers.world_size == 1 and not launched_by_torchrun():
        return None
    workers.dims(load_config(model))
    world = int(os.environ.get("WORLD_SIZE", workers.world_size))
    if launched_by_torchrun() and world != workers.world_size:
        raise ConfigError(f"torchrun started {world} processes but --tp {tp} --ep {ep} makes {workers.world_size}",
                          field="tp", hint="start tp * ep processes (--nproc-per-node times nodes)")
    return workers


COMPILE_HELP = ("Run decode steps through torch.compile: each kind of decoder layer compiles once and every "
                "layer reuses its graph (faster steps for small models on a CPU; a first start compiles for up to a "
                "minute, later ones load inductor's disk cache; needs a C++ compiler). In fp32 greedy tokens are the "
                "same as --no-compile's (eager); bf16 and int4 weights round in another order compiled, so "
                "long greedy outputs may part. --compile-decode: the same as --compile.")
COMPILE_DEFAULT_HELP = (" Default: compiled where it can run (one process on a CPU, pages not fp8, a C++ compiler), "
                        "eager elsewhere.")
COMPILE_DECLS = ("--compile/--no-compile", "--compile-decode")
COMPILE_FORM_OPTION = typer.Option(
    EngineConfig.compile_form, "--compile-form",
    help="What one compiled graph covers, with --compile: layers (whole decoder layers, norms and residuals "
         "inside; the default), parts (each layer kind's attention and FFN, the glue between them eager: slower "
         "steps) or whole (the whole decode call: fastest steps, the longest first start).")


SPECULATIVE_HELP = ("Speculative decoding: mtp (the model's MTP head drafts --num-draft-tokens tokens a step, the model "
                    "verifies them in one forward; greedy output is unchanged, sampling keeps its distribution).")
NUM_DRAFT_TOKENS_HELP = "Tokens drafted per step with --speculative (1..3)."
SPEC_MIN_ACCEPTANCE_HELP = ("With --speculative: a request whose last 8 verifications kept fewer than this share of "
                            "their drafts decodes plainly, trying again after 64 plain tokens, the wait doubling "
                            "each time (0 = never switch off).")
ASYNC_SCHEDULING_HELP = ("Schedule step N+1 while step N runs, with placeholders for the tokens it has yet to "
                         "sample (vLLM's async scheduling): the same tokens, outputs one step later. Also with "
                         "--tp/--ep, and with serve's --role on one process. Refuses (400) structured outputs.")
ASYNC_SCHEDULING_DECLS = ("--async-scheduling/--no-async-scheduling",)
# Declared once, shared by the commands that take them (typer builds each command's parameter from it).
SPECULATIVE_OPTION = typer.Option(None, "--speculative", help=SPECULATIVE_HELP)
NUM_DRAFT_TOKENS_OPTION = typer.Option(EngineConfig.num_draft_tokens, "--num-draft-tokens", help=NUM_DRAFT_TOKENS_HELP)
SPEC_MIN_ACCEPTANCE_OPTION = typer.Option(EngineConfig.spec_min_acceptance, "--spec-min-acceptance",
                                          help=SPEC_MIN_ACCEPTANCE_HELP)
SPEC_MAX_BATCH_OPTION = typer.Option(EngineConfig.spec_max_batch, "--spec-max-batch", help=(
    "With --speculative: a step of at least this many running requests decodes plainly (the plain step is "
    "cheaper per token there); below it, a batch size speculates only where the engine measured that a "
    "speculative step costs less than the plain steps emitting the same tokens (at the acceptance seen). "
    "0 = speculate at any batch size."))
ASYNC_SCHEDULING_OPTION = typer.Option(False, *ASYNC_SCHEDULING_DECLS, help=ASYNC_SCHEDULING_HELP)
NUM_SCHEDULER_STEPS_HELP = ("Decode steps run back to back, scheduling once per window, when every scheduled "
                            "request is decoding and needs no host work per token (no grammar, penalties or "
                            "logprobs): the same tokens; streams get them in bursts of up to N, first tokens are "
                            "never delayed by a window. 1: one step at a time.")
NUM_SCHEDULER_STEPS_OPTION = typer.Option(EngineConfig.num_scheduler_steps, "--num-scheduler-steps",
                                          help=NUM_SCHEDULER_STEPS_HELP)
GENERATE_STEPS_OPTION = typer.Option(None, "--num-scheduler-steps", help=NUM_SCHEDULER_STEPS_HELP + (
    f" Default: {GENERATE_DEFAULT_STEPS} on one process without --async-scheduling or --speculative, 1 elsewhere."))


# What a first start costs: measured on two cores, `tiny` (3-5 graphs), about 50-90 s from an empty
# inductor cache and 15-50 s from its disk cache (dynamo traces again), against ~6 s eager.
COMPILE_NOTE = ("compiling the decode step (once per process: about a minute or more on a first start on two cores, "
                "less from inductor's disk cache; --no-compile decodes eagerly)...")
KV_CACHE_DTYPE_HELP = ("Latent-KV and indexer-key pages: auto (the model dtype) or fp8 (e4m3 with a scale per "
                       "tile of each row: about half the bytes per token of bf16).")


def build_engine(model: str, tokenizer: Optional[str], cache_memory: str, max_num_seqs: int,
                 max_num_batched_tokens: int, dtype: str, device: str, compile_decode: bool = False,
                 tp: int = 1, ep: int = 1, kv_cache_dtype: str = "auto", threads: Optional[int] = None,
                 speculative: Optional[str] = None, num_draft_tokens: int = EngineConfig.num_draft_tokens,
                 spec_min_acceptance: float = EngineConfig.spec_min_acceptance, async_scheduling: bool = False,
                 num_scheduler_steps: int = EngineConfig.num_scheduler_steps,
                 compile_form: str = EngineConfig.compile_form, spec_max_batch: int = EngineConfig.spec_max_batch):
    from deltamoe.serve.engine.config import EngineConfig

    check_dtype(dtype)
    check_device(device)
    chosen = choose_threads(threads, reserve=host_thread_reserve(async_scheduling))
    config = EngineConfig(cache_memory=cache_memory, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, compile_decode=compile_decode,
                          compile_form=compile_form,
                          kv_cache_dtype=kv_cache_dtype, speculative=speculative, num_draft_tokens=num_draft_tokens,
                          spec_min_acceptance=spec_min_acceptance, async_scheduling=async_scheduling,
                          num_scheduler_steps=num_scheduler_steps, spec_max_batch=spec_max_batch)
    load_config(model)  # an unknown model fails here, from its config alone
    workers = check_workers(model, tp, ep)
    check_speculative_layout(speculative, workers=workers is not None, hand_off=False)  # before any rank starts
    check_multi_step(num_scheduler_steps, workers=workers is not None, transfers=False)
    from deltamoe.serve.engine.llm_engine import LLMEngine  # imports torch: after every check above
    from deltamoe.threads import apply_threads

    apply_threads(chosen)
    return LLMEngine.from_pretrained(model, config, tokenizer, parse_dtype(dtype), device, workers)


def generate_command(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Checkpoint folder or preset name (presets get random weights)."),
    prompt: list[str] = typer.Option(..., "--prompt", "-p", help="Prompt text; repeat for a batch."),
    max_tokens: int = typer.Option(64, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(1.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0, help="0 = off."),
    min_p: float = typer.Option(0.0),
    seed: Optional[int] = typer.Option(None, help="Same seed, same output. Without one, runs repeat too: the engine's sampler starts from a fixed seed, as vLLM's does."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string; repeatable."),
    ignore_eos: bool = typer.Option(False, help="Keep going past the EOS token."),
    chat: bool = typer.Option(False, help="Wrap each prompt as a user message with the chat template."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer folder/file (default: the checkpoint's, else bytes)."),
    cache_memory: str = typer.Option("1GiB", help="KV/state cache budget, e.g. 2GiB."),
    max_num_seqs: int = typer.Option(64),
    max_num_batched_tokens: int = typer.Option(512),
    dtype: str = typer.Option("float32"),
    device: str = typer.Option("cpu"),
    progress: bool = typer.Option(False, help="Show a progress bar with tokens/s."),
    compile_decode: Optional[bool] = typer.Option(None, *COMPILE_DECLS, help=COMPILE_HELP + COMPILE_DEFAULT_HELP),
    compile_form: str = COMPILE_FORM_OPTION,
    threads: Optional[int] = typer.Option(None, help=THREADS_HELP),
    tp: int = typer.Option(1, "--tp", help=TP_HELP),
    ep: int = typer.Option(1, "--ep", help=EP_HELP),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help=KV_CACHE_DTYPE_HELP),
    speculative: Optional[str] = SPECULATIVE_OPTION,
    num_draft_tokens: int = NUM_DRAFT_TOKENS_OPTION,
    spec_min_acceptance: float = SPEC_MIN_ACCEPTANCE_OPTION,
    spec_max_batch: int = SPEC_MAX_BATCH_OPTION,
    image: list[str] = typer.Option([], "--image", help="Image file shown with every prompt, before its text; "
                                    "repeatable (models with a vision tower)."),
    async_scheduling: bool = ASYNC_SCHEDULING_OPTION,
    num_scheduler_steps: Optional[int] = GENERATE_STEPS_OPTION,
) -> None:
    """Generate text for one or more prompts (continuous batching)."""
    from deltamoe.cli import sigterm_as_ctrl_c

    sigterm_as_ctrl_c()
    from deltamoe.serve.compile_choice import resolve_compile
    from deltamoe.serve.image_cli import check_image_model, load_cli_images, placeholder_tokens

    check_options_need_their_mode(ctx, speculative, compile_decode)
    vision_config = check_image_model(model, image)
    check_device(device)
    compile_decode = resolve_compile(compile_decode, device, tp, ep, model)
    from deltamoe.serve.executor.config import launched_by_torchrun

    num_scheduler_steps = resolve_generate_steps(num_scheduler_steps, tp * ep > 1 or launched_by_torchrun(),
                                                 async_scheduling, speculative is not None)
    engine = build_engine(model, tokenizer, cache_memory, max_num_seqs, max_num_batched_tokens, dtype, device,
                          compile_decode, tp=tp, ep=ep, kv_cache_dtype=kv_cache_dtype, threads=threads,
                          speculative=speculative, num_draft_tokens=num_draft_tokens,
                          spec_min_acceptance=spec_min_acceptance, async_scheduling=async_scheduling,
                          num_scheduler_steps=num_scheduler_steps, compile_form=compile_form,
                          spec_max_batch=spec_max_batch)
    from deltamoe.serve.api.chat_template import ChatTemplate
    from deltamoe.serve.engine.sampling import SamplingParams

    from deltamoe.serve.api.images import IMAGE_MARK

    images = load_cli_images(image, vision_config)
    stop_ids: list[int] = []
    inputs: list[str | list[int]] = list(prompt)
    if chat:
        template = ChatTemplate.for_model(engine.tokenizer, tokenizer or model)
        inputs = [template.encode([{"role": "user", "content": IMAGE_MARK * len(images) + p}], True,
                                  image_tokens=placeholder_tokens(vision_config, images) if images else None)
                  for p in prompt]
        stop_ids = template.stop_token_ids
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            seed=seed, stop=list(stop), stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    if engine.runner.compiles_decode:
        typer.echo(COMPILE_NOTE, err=True)
    completions = engine.generate(inputs, params, progress=progress,
                                  images=[images] * len(inputs) if images else None)
    engine.shutdown()
    for i, c in enumerate(completions):
        if len(completions) > 1:
            typer.echo(f"--- [{i}] {prompt[i]!r} ({c.finish_reason})")
        typer.echo(c.text)
    if speculative is not None:
        from deltamoe.serve.spec_decode.tracker import summary_line

        typer.echo(summary_line(engine.runner.tracker), err=True)


def chat_command(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Checkpoint folder or preset name."),
    system: Optional[str] = typer.Option(None, help="System prompt."),
    max_tokens: int = typer.Option(256),
    temperature: float = typer.Option(0.7),
    top_p: float = typer.Option(0.95),
    seed: Optional[int] = typer.Option(None),
    tokenizer: Optional[str] = typer.Option(None),
    cache_memory: str = typer.Option("1GiB"),
    dtype: str = typer.Option("float32"),
    device: str = typer.Option("cpu"),
    threads: Optional[int] = typer.Option(None, help=THREADS_HELP),
    compile_decode: bool = typer.Option(False, *COMPILE_DECLS, help=COMPILE_HELP + " Default: eager."),
    speculative: Optional[str] = SPECULATIVE_OPTION,
    num_draft_tokens: int = NUM_DRAFT_TOKENS_OPTION,
    spec_min_acceptance: float = SPEC_MIN_ACCEPTANCE_OPTION,
) -> None:
    """Interactive chat in the terminal (/reset clears the history, /exit or Ctrl-D quits)."""
    from deltamoe.cli import sigterm_as_ctrl_c

    sigterm_as_ctrl_c()
    from deltamoe.serve.engine.sampling_params import SamplingParams

    check_options_need_their_mode(ctx, speculative, compile_decode)
    # The sampling options fail here, before the model loads, not at the first message.
    SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed).validate(vocab_size=1)
    engine = build_engine(model, tokenizer, cache_memory, 1, 512, dtype, device, compile_decode, threads=threads,
                          speculative=speculative, num_draft_tokens=num_draft_tokens,
                          spec_min_acceptance=spec_min_acceptance)
    if engine.runner.compiles_decode:
        typer.echo(COMPILE_NOTE, err=True)
    engine.warm_up()  # compiles before the first question (a no-op when decoding eagerly)
    from rich.console import Console

    from deltamoe.serve.api.chat_template import ChatTemplate
    from deltamoe.serve.engine.sampling import SamplingParams

    console = Console()
    template = ChatTemplate.for_model(engine.tokenizer, tokenizer or model)
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    from deltamoe.errors import RequestError
    from deltamoe.serve.api.images import IMAGE_MARK
    from deltamoe.serve.image_cli import read_chat_image

    images: list = []  # every image of the conversation, in order (its marks sit in `history`)
    pending: list = []  # attached with /image, shown with the next message
    console.print(f"[dim]deltamoe chat · {Path(model).name} · /reset, /exit"
                  f"{', /image PATH' if engine.model_config.vision is not None else ''}[/dim]")
    while True:
        try:
            line = console.input("[bold cyan]you> [/bold cyan]")
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            history = history[:1] if system else []
            images, pending = [], []
            console.print("[dim](history cleared)[/dim]")
            continue
        command = line.strip().split(maxsplit=1)[0] if line.strip().startswith("/") else ""
        if command and command not in ("/image", "//") and not command.startswith("//"):
            console.print(f"[red]unknown command {command} (try /reset, /exit"
                          f"{', /image PATH' if engine.model_config.vision is not None else ''}; "
                          "start a message with // to send a leading /)[/red]", markup=True, highlight=False)
            continue
        if line.strip().startswith("//"):
            line = line.strip()[1:]
        elif line.strip().startswith("/image"):
            try:
                pending.append(read_chat_image(line, engine.model_config))
            except RequestError as e:
                console.print(f"[red]{e.one_line()}[/red]", markup=True, highlight=False)
                continue
            h, w = pending[-1].size
            console.print(f"[dim](image {w}x{h}, {pending[-1].num_tokens} tokens; sent with your next message)[/dim]")
            continue
        history.append({"role": "user", "content": IMAGE_MARK * len(pending) + line})
        images, pending = images + pending, []
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                stop_token_ids=template.stop_token_ids)
        try:
            request_id, dropped = add_chat_turn(engine, template, history, images, params, bool(system))
        except RequestError as e:  # the message cannot be answered: say why, keep the session
            history.pop()
            console.print(f"[red]{e.one_line()}[/red] [dim](/reset clears the history)[/dim]", markup=True,
                          highlight=False)
            continue
        if dropped:
            console.print(f"[dim](the {dropped} oldest messages left the context)[/dim]")
        console.print("[bold magenta]assistant> [/bold magenta]", end="")
        reply = ""
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    console.print(out.delta_text, end="", markup=False, highlight=False)
                    reply = out.text
        except KeyboardInterrupt:  # stop this answer, keep the session
            engine.abort(request_id)
        console.print()
        history.append({"role": "assistant", "content": reply})


def add_chat_turn(engine, template, history: list[dict[str, str]], images: list, params,
                  keep_first: bool) -> tuple[str, int]:
    """Queue the conversation's next answer; returns (request id, messages dropped from `history`).

    While the conversation plus the answer's `max_tokens` does not fit the context, its oldest
    exchange leaves `history` (a system prompt stays), as chat front ends do; a conversation with
    images keeps all of it (each image's tokens follow its place in the text), as does one whose
    last message alone does not fit: those raise the engine's RequestError."""
    from deltamoe.errors import RequestError
    from deltamoe.serve.image_cli import placeholder_tokens

    kept = list(history)  # `history` changes only once the answer is queued
    while True:
        ids = template.encode(kept, True,
                              image_tokens=placeholder_tokens(engine.model_config, images) if images else None)
        try:
            request_id = engine.add_request(ids, params, images=images or None)
        except RequestError as e:
            first = 1 if keep_first else 0
            if e.field not in ("prompt", "max_tokens") or images or len(kept) - first < 3:
                raise
            del kept[first:first + 2]  # the oldest user message and its answer
            continue
        dropped = len(history) - len(kept)
        history[:] = kept
        return request_id, dropped


def _torchrun_rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))  # 0 outside torchrun


def weight_routes(engine, enabled: bool) -> list:
    """The weight-update routes (`serve/api/weight_routes.py`) when `--weight-updates` asks for them."""
    if not enabled:
        return []
    from deltamoe.serve.api.weight_routes import weight_update_routes

    return [weight_update_routes(engine)]


def serve_command(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Checkpoint folder or preset name."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind; the default keeps the server local."),
    port: int = typer.Option(8000, min=1, max=65535),
    api_key: Optional[str] = typer.Option(None, envvar="DELTAMOE_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on every /v1 route."),
    served_model_name: Optional[str] = typer.Option(None, help="The model name clients send (default: MODEL)."),
    max_model_len: Optional[int] = typer.Option(None, help="Context limit: prompt + output tokens per request."),
    tokenizer: Optional[str] = typer.Option(None),
    cache_memory: str = typer.Option("1GiB", help="KV/state cache budget, e.g. 2GiB."),
    max_num_seqs: int = typer.Option(64),
    max_num_batched_tokens: int = typer.Option(512),
    dtype: str = typer.Option("float32"),
    device: str = typer.Option("cpu"),
    log_level: str = typer.Option("info", help="uvicorn log level (warning keeps the access log quiet)."),
    threads: Optional[int] = typer.Option(None, help=THREADS_HELP + "; serve keeps one more core for the HTTP "
                                          "front end"),
    compile_decode: Optional[bool] = typer.Option(None, *COMPILE_DECLS,
                                                  help=COMPILE_HELP + COMPILE_DEFAULT_HELP + " Every decode graph "
                                                  "compiles at startup, before the port opens."),
    compile_form: str = COMPILE_FORM_OPTION,
    role: str = typer.Option("colocated", help="colocated (one engine does everything), or one half of a "
                             "prefill/decode pair behind `deltamoe router`: prefill or decode."),
    kv_transfer: Optional[str] = typer.Option(None, help="How a prefill/decode pair moves caches: mooncake "
                                              "(the Mooncake transfer engine over TCP)."),
    kv_transfer_host: str = typer.Option("127.0.0.1", help="Address peers reach this server's transfer engine "
                                         "at (its port is picked free)."),
    kv_transfer_timeout: float = typer.Option(30.0, min=0.1, help="Seconds one hand-off (prefill queue, compute "
                                              "and write) may take before the request fails."),
    min_hand_off_tokens: int = typer.Option(2, min=2, help="Decode role: prompts shorter than this are computed "
                                            "by the decode server itself (short chats skip the prefill queue)."),
    kv_transfer_staging: str = typer.Option("64MiB", help="Registered area for packed hand-offs (one write per "
                                            "request); a request larger than either side's area is written block "
                                            "run by block run."),
    kv_transfer_direct_max_segments: int = typer.Option(
        DIRECT_MAX_SEGMENTS, min=-1, help="Prefill role: a hand-off of at most this many segments "
        "(runs of blocks per layer, state layers) plus one per 48 KiB goes straight into the decode server's pools; "
        "a more scattered one goes packed through the staging areas (-1: always packed when they fit)."),
    kv_transfer_inline_write: str = typer.Option(
        INLINE_WRITE, help="Prefill role: a direct hand-off up to this size is written by the engine thread "
        "itself, its completion notice included, in one synchronous call (0: always from a hand-off thread)."),
    kv_transfer_markers: bool = typer.Option(
        MARKERS, "--kv-transfer-markers/--no-kv-transfer-markers",
        help="Decode role: a hand-off's end is told by an 8-byte completion marker the prefill server writes "
        "into this server's memory after the data (else by the transfer engine's own notice)."),
    block_size: int = typer.Option(16, min=1, help="Tokens per cache block (equal on both sides of a P/D pair)."),
    tp: int = typer.Option(1, "--tp", help=TP_HELP),
    ep: int = typer.Option(1, "--ep", help=EP_HELP),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help=KV_CACHE_DTYPE_HELP),
    speculative: Optional[str] = SPECULATIVE_OPTION,
    num_draft_tokens: int = NUM_DRAFT_TOKENS_OPTION,
    spec_min_acceptance: float = SPEC_MIN_ACCEPTANCE_OPTION,
    spec_max_batch: int = SPEC_MAX_BATCH_OPTION,
    allowed_origins: Optional[list[str]] = typer.Option(None, "--allowed-origins", help="A browser origin allowed "
                                                        "to call the server (CORS), e.g. http://localhost:3000; "
                                                        "repeat for more, '*' for any. Default: none."),
    allow_image_urls: bool = typer.Option(False, "--allow-image-urls", help="Fetch http(s) image_url parts "
                                          "(default: data: URLs only; the server makes requests on clients' behalf)."),
    image_fetch_timeout: float = typer.Option(10.0, min=0.1, help="Seconds one image download may take."),
    image_max_bytes: int = typer.Option(20 * 1024 * 1024, min=1, help="Largest image accepted (download or data: URL)."),
    image_max_tokens: int = typer.Option(1024, min=1, help="Placeholder tokens per image at most (larger images "
                                         "are scaled down, keeping their aspect)."),
    image_max_count: int = typer.Option(8, min=1, help="Images per request at most (each one is decoded and "
                                        "encoded by the vision tower in prefill)."),
    async_scheduling: bool = ASYNC_SCHEDULING_OPTION,
    num_scheduler_steps: int = NUM_SCHEDULER_STEPS_OPTION,
    weight_updates: bool = typer.Option(False, "--weight-updates/--no-weight-updates",
                                        help="Serve the weight-update routes (/init_weight_transfer_engine ...) "
                                             "that an RL trainer pushes new weights through (behind --api-key)."),
) -> None:
    """OpenAI-compatible HTTP server (deltamoe.serve.api) over an AsyncLLMEngine."""
    from deltamoe.serve.compile_choice import resolve_compile
    from deltamoe.serve.engine.config import EngineConfig, check_max_model_len, parse_bytes
    from deltamoe.serve.kv_transfer.role_config import check_role

    from deltamoe.serve.api.auth import check_api_key_env, check_api_key_option

    check_options_need_their_mode(ctx, speculative, compile_decode)
    check_role(role, kv_transfer)
    check_api_key_option(api_key)
    check_api_key_env(api_key)
    check_device(device)
    log_level = check_log_level(log_level)
    compile_decode = resolve_compile(compile_decode, device, tp, ep, model)
    # A bad size fails before the model loads.
    staging_bytes = parse_bytes(kv_transfer_staging, "kv_transfer_staging")
    inline_write_bytes = parse_bytes(kv_transfer_inline_write, "kv_transfer_inline_write")
    check_dtype(dtype)
    config = EngineConfig(cache_memory=cache_memory, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                          compile_decode=compile_decode, compile_form=compile_form, block_size=block_size,
                          kv_cache_dtype=kv_cache_dtype,
                          speculative=speculative, num_draft_tokens=num_draft_tokens,
                          spec_min_acceptance=spec_min_acceptance, async_scheduling=async_scheduling,
                          num_scheduler_steps=num_scheduler_steps, spec_max_batch=spec_max_batch)
    chosen = engine_threads(threads, async_scheduling)
    # An unknown model fails here, from its config alone.
    check_max_model_len(max_model_len, load_config(model).max_position_embeddings)
    workers = check_workers(model, tp, ep)
    # Before any rank or the transfer engine starts.
    check_speculative_layout(speculative, workers=workers is not None, hand_off=role != "colocated")
    check_multi_step(num_scheduler_steps, workers=workers is not None, transfers=role != "colocated")
    if workers is not None and _torchrun_rank() > 0:
        # A torchrun rank > 0 runs its shard of the model until rank 0 stops (from_pretrained exits).
        from deltamoe.serve.engine.llm_engine import LLMEngine

        LLMEngine.from_pretrained(model, config, tokenizer, parse_dtype(dtype), device, workers)
        return
    listener = bind_listen_address(host, port)
    try:
        from deltamoe.serve.api import server as api
    except ImportError as e:
        listener.close()
        raise ConfigError(f"the HTTP server is not available ({e})", field="serve") from e
    import torch

    from deltamoe.serve.api.chat_template import ChatTemplate
    from deltamoe.serve.api.images import ImageOptions
    from deltamoe.serve.engine.async_engine import AsyncLLMEngine
    from deltamoe.vision.preprocess import ImageLimits
    from deltamoe.serve.engine.llm_engine import LLMEngine
    from deltamoe.serve.kv_transfer.roles import decode_hand_off, internal_routes, make_connector

    from deltamoe.model.fingerprint import weights_fingerprint

    torch.set_num_threads(chosen)
    try:
        connector = make_connector(role, kv_transfer_host, kv_transfer_timeout, api_key, min_hand_off_tokens,
                                   staging_bytes, kv_transfer_direct_max_segments, inline_write_bytes,
                                   kv_transfer_markers,
                                   weights=weights_fingerprint(model, dtype) if role != "colocated" else "")
    except ConfigError:
        listener.close()
        raise
    engine = AsyncLLMEngine(LLMEngine.from_pretrained(model, config, tokenizer, parse_dtype(dtype), device,
                                                      workers, connector=connector))
    if config.compile_decode:
        typer.echo(COMPILE_NOTE, err=True)
        engine.engine.warm_up()
    template = ChatTemplate.for_model(engine.tokenizer, tokenizer or model)
    name = served_model_name or model
    api.run(engine, model_name=name, host=host, port=port, api_key=api_key, chat_template=template,
            log_level=log_level, sock=listener, hand_off=decode_hand_off if role == "decode" else None,
            routers=[internal_routes(role, engine, connector, name)] + weight_routes(engine, weight_updates),
            image_options=ImageOptions(allow_image_urls, image_fetch_timeout,
                                       ImageLimits(max_tokens=image_max_tokens, max_bytes=image_max_bytes),
                                       max_images=image_max_count),
            allowed_origins=allowed_origins or ())
