"""Weight updates without a restart: the engine side of vLLM's weight-transfer protocol.

    init_transfer_group -> start_weight_update -> update_weights (one or more) -> finish_weight_update

Tensors come by the model's own names (`state_dict()` keys, router-bias buffers included) and full
shapes, whatever the engine's TP/EP layout. Two ways in:
- `update_weights_from_tensors`: a colocated trainer in this process hands its tensors over;
- `update_weights(specs)`: the trainer broadcasts them over a `TransferGroup` (gloo), in buckets.

Stage, then swap: every tensor is checked (a name the model lacks, a shape or dtype that does not
fit: `RequestError` naming the tensor) and copied into a staging area; nothing touches the model
until `finish_weight_update`, which copies the staged tensors into every rank's weights in one go
(`Executor.load_weights`) and forgets the prefix cache. A failed or abandoned update leaves the
old weights serving.

In-flight requests finish on the old weights: `finish_weight_update` needs an engine with nothing
running. `LLMEngine` users call it between batches (it refuses otherwise); the server's
`AsyncLLMEngine.run_when_idle` holds new requests back, lets the running ones finish, swaps, then
admits the held ones, which run on the new weights.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from deltamoe.errors import RequestError
from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.model.weights import all_finite
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.weight_transfer import (DEFAULT_BUCKET_BYTES, TensorSpec, TransferGroup, bucket_sizes,
                                                   known_dtype, layout, plan_buckets, unpack)


@dataclass
class UpdateStats:
    version: int  # updates finished so far
    tensors: int
    bytes: int
    receive_s: float  # staging (and receiving, over a group)
    swap_s: float  # copying into the model + forgetting the prefix cache


def full_shapes(model: DeltaMoEForCausalLM) -> dict[str, tuple[int, ...]]:
    """Every updatable tensor of the whole model and its full shape (a meta-device twin: no memory)."""
    with torch.device("meta"):
        twin = DeltaMoEForCausalLM(model.config)
    return {name: tuple(t.shape) for name, t in twin.state_dict().items()}


MAX_TRANSFER_TIMEOUT_S = 24 * 3600.0  # a day: torch's timedelta overflows on absurd values


class WeightUpdater:
    """One engine's receiving end. Not thread-safe: one update at a time, driven by one caller
    (the RL loop, or the server's routes, which serialise on a lock)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.shapes = full_shapes(engine.runner.model)
        held = engine.runner.model.state_dict(keep_vars=True)
        if set(held) != set(self.shapes):
            odd = sorted(set(held) ^ set(self.shapes))[:3]
            raise RequestError(f"this engine's model does not hold the plain model's tensors ({', '.join(odd)} ...): "
                               "weight updates need an unquantized model", field="weights")
        self.dtypes = {name: (t.to_local() if isinstance(t, DTensor) else t).dtype for name, t in held.items()}
        self.version = 0
        self.group: TransferGroup | None = None
        self._staged: dict[str, torch.Tensor] | None = None
        self._receive_s = 0.0
        self.last: UpdateStats | None = None

    # ------------------------------------------------------------------ the protocol
    def init_transfer_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0) -> None:
        """Join the trainer's transfer group (the trainer, rank 0, opened the store at host:port)."""
        if rank < 1:
            raise RequestError(f"an engine is rank 1.. of the transfer group (the trainer is 0), got {rank}",
                               field="rank")
        if rank >= world_size:
            raise RequestError(f"rank {rank} outside a transfer group of {world_size}", field="rank")
        if not 0 < timeout_s <= MAX_TRANSFER_TIMEOUT_S:
            raise RequestError(f"expected seconds in (0, {MAX_TRANSFER_TIMEOUT_S:g}], got {timeout_s}", field="timeout_s")
        try:
            self.group = TransferGroup(host, port, rank, world_size, timeout_s).connect()
        except (OSError, RuntimeError, ValueError) as e:  # the trainer's store unreachable, refused, timed out
            raise RequestError(f"cannot join the trainer's transfer group at {host}:{port}: "
                               f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
                               field="host") from e

    def start_weight_update(self) -> None:
        if self._staged is not None:
            raise RequestError("an update is already open: finish or abort it first", field="weights")
        self._staged, self._receive_s = {}, 0.0

    def update_weights_from_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stage tensors handed over in this process (a colocated trainer). All-or-nothing per call:
        a bad tensor aborts the whole update."""
        staged = self._open()
        start = time.perf_counter()
        try:
            for name, tensor in tensors:
                self.check(TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
                staged[name] = self._stage(name, tensor)
        except Exception:
            self.abort_weight_update()
            raise
        self._receive_s += time.perf_counter() - start

    def update_weights(self, specs: list[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       rejected: RequestError | None = None) -> None:
        """Receive the announced tensors over the transfer group. Every rank first agrees on the specs
        and the broadcasts they make: when this engine rejects one (or the request itself was
        `rejected`, e.g. a malformed body), or the trainer's tensors take other bytes than announced,
        nothing is sent and this raises the RequestError; the trainer is told as well."""
        staged = self._open()
        if self.group is None:
            self.abort_weight_update()
            raise RequestError("no transfer group: call init_transfer_group first", field="weights")
        error = rejected
        try:
            for spec in specs if error is None else []:
                self.check(spec)
            sizes = bucket_sizes(specs, bucket_bytes) if error is None else []
        except (RequestError, ValueError) as e:
            error = e if isinstance(e, RequestError) else RequestError(str(e), field="bucket_bytes")
            sizes = []
        start = time.perf_counter()
        try:  # the agreement is a collective too: a trainer that never joins it must not leave the update open
            went, same_plan = self.group.agree(error is None, sizes)
        except Exception as e:
            self.abort_weight_update()
            raise self._group_failed(e) from e
        if not went or not same_plan:
            self.abort_weight_update()
            raise error or RequestError(
                "another rank of the transfer group rejected this update" if not went else
                "the trainer's tensors take other bytes than the announced dtype_names and shapes (nothing was "
                "sent; the old weights keep serving)", field="weights" if not went else "dtype_names")
        try:
            for bucket in plan_buckets(specs, bucket_bytes):
                part = [specs[i] for i in bucket]
                buffer = torch.empty(layout(part)[1], dtype=torch.uint8)
                self.group.broadcast(buffer, src=0)
                for spec, tensor in zip(part, unpack(buffer, part)):
                    staged[spec.name] = self._stage(spec.name, tensor)
        except Exception as e:
            self.abort_weight_update()
            raise self._group_failed(e) from e
        self._receive_s += time.perf_counter() - start

    def _group_failed(self, e: Exception) -> Exception:
        """A collective of the transfer group failed (the trainer died or timed out): the group is
        unusable from now on, so it is dropped and the error says how to get a new one."""
        if isinstance(e, RequestError):
            return e
        self.group = None
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        return RequestError(f"the transfer group failed ({type(e).__name__}: {first}); the old weights keep "
                            "serving: call /init_weight_transfer_engine again", field="weights")

    def finish_weight_update(self) -> UpdateStats:
        """Swap the staged tensors in (every rank), forget the prefix cache; the engine must be idle."""
        staged = self._open()
        if self.engine.has_unfinished():
            raise RequestError("requests are still running: new weights apply between batches (the server "
                               "waits for them)", field="weights")
        # NaN or inf weights would serve NaN logits (a row of token 0, answered with a 200): checked here,
        # once everything arrived, so a broadcast in flight is never cut short on one side.
        bad = next((name for name, t in staged.items() if not all_finite(t)), None)
        if bad is not None:
            self.abort_weight_update()
            raise RequestError(f"tensor {bad} holds non-finite values (NaN or inf); the update is dropped and the "
                               "old weights keep serving", field=bad)
        start = time.perf_counter()
        self._staged = None
        if staged:
            self.engine.executor.load_weights(staged)
            self.engine.cache.reset_prefix_cache()
            if self.engine.connector is not None:  # a P/D role: its peers must see other weights now
                self.engine.connector.weights_updated(staged)
        self.version += 1
        self.last = UpdateStats(self.version, len(staged), sum(t.numel() * t.element_size() for t in staged.values()),
                                self._receive_s, time.perf_counter() - start)
        return self.last

    def abort_weight_update(self) -> None:
        """Drop whatever is staged; the old weights keep serving."""
        self._staged = None

    @property
    def updating(self) -> bool:
        return self._staged is not None

    # ------------------------------------------------------------------ checks
    def check(self, spec: TensorSpec) -> None:
        """RequestError naming the tensor when the model has no such tensor or it does not fit."""
        if spec.name not in self.shapes:
            raise RequestError(f"the model has no tensor {spec.name!r}", field=spec.name)
        if tuple(spec.shape) != self.shapes[spec.name]:
            raise RequestError(f"expected shape {list(self.shapes[spec.name])}, got {list(spec.shape)}",
                               field=spec.name)
        if not known_dtype(spec.dtype):
            raise RequestError(f"expected a floating dtype (float32, bfloat16, float16, float64), got {spec.dtype}",
                               field=spec.name)

    def _open(self) -> dict[str, torch.Tensor]:
        if self._staged is None:
            raise RequestError("no update is open: call start_weight_update first", field="weights")
        return self._staged

    def _stage(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # A copy in the engine's dtype, on the host: the swap reads it later, whatever the sender does meanwhile.
        return tensor.detach().to(device="cpu", dtype=self.dtypes[name], copy=True)
