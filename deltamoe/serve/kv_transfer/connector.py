"""KVConnector: how an engine loads a request's cache from elsewhere and saves it for someone else.

The shape of vLLM's V1 KV connector, in two halves on one object:

- scheduler side (policy, engine thread): `get_num_new_matched_tokens` (how many more prompt
  tokens another engine will provide), `update_state_after_alloc` (blocks and the state slot are
  reserved: start bringing the data in), `request_finished` (True keeps the request's blocks and
  slot pinned until `get_finished` lists it: a transfer still reads or writes them), `step_ended`
  (the step's finished requests are all known);
- worker side (device): `start_load_kv` before a step, `wait_for_layer_load` / `save_kv_layer`
  per layer, `wait_for_save` after the step, and `get_finished` (which transfers ended, and which
  of them failed).

Hybrid state is part of the contract, not an add-on: a request's cache is its latent/indexer
blocks AND its KDA recurrent + conv state slot, and a connector moves both or fails the request.
The engine calls only these methods; a new transport (NIXL, torch.distributed P2P) is a new
subclass, with no engine change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from deltamoe.config import ModelConfig
from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.sequence import Sequence


@dataclass
class FinishedTransfers:
    """What `get_finished` reports since its last call, by request id."""

    sent: set[str] = field(default_factory=set)  # saves done: the sender may free the blocks
    received: set[str] = field(default_factory=set)  # loads done: the request can run
    failed: dict[str, str] = field(default_factory=dict)  # either direction; the message says why

    def __bool__(self) -> bool:
        return bool(self.sent or self.received or self.failed)


class KVConnector(ABC):
    # Called (from any thread) whenever a transfer ends: the engine thread, asleep while its steps only
    # wait for transfers, looks at `get_finished` again at once. Set by the engine's driver.
    on_transfer_end: Callable[[], None] | None = None

    def bind(self, cache: HybridCache, model_config: ModelConfig) -> None:
        """Called once by the engine with its cache (the pools a transport registers) and model config."""
        self.cache, self.model_config = cache, model_config

    # ------------------------------------------------------------------ scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed: int) -> int:
        """Prompt tokens after the `num_computed` already cached locally that this connector will load."""

    @abstractmethod
    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        """`seq` holds blocks for num_computed + num_external_tokens tokens and a state slot: load into them."""

    @abstractmethod
    def request_finished(self, seq: Sequence, reason: str) -> bool:
        """`seq` leaves the engine; True: a transfer still uses its blocks and slot (free them later)."""

    def step_ended(self) -> None:
        """After a step's outputs: every request the step finished has had `request_finished` (a
        connector may start their transfers together)."""

    def weights_updated(self, tensors: dict) -> None:
        """A weight update copied `tensors` into the served weights (between steps): what this side
        tells its peers about its weights must change with them."""

    # ------------------------------------------------------------------ worker side
    def start_load_kv(self) -> None:
        """Before a step's forward."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Before `layer` reads the cache (layer-wise loads overlap with compute)."""

    def save_kv_layer(self, layer: int) -> None:
        """After `layer` wrote the cache (layer-wise saves overlap with compute)."""

    def wait_for_save(self) -> None:
        """After a step's forward."""

    @abstractmethod
    def get_finished(self) -> FinishedTransfers:
        """Transfers that ended since the last call (thread-safe: transports finish on their own threads)."""

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, float]:
        """Numbers for /metrics (names become deltamoe_engine_<name>); those in `counter_stats` are totals."""
        return {}

    def counter_stats(self) -> frozenset[str]:
        """The names in `stats` that only grow (exported as counters; the others as gauges)."""
        return frozenset()

    def close(self) -> None:
        """Release transport resources."""
