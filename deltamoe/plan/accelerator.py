"""Accelerator descriptions: every number with its provenance (`hardware.py` finds one by name or file).

A `Figure` is one number plus where it came from (vendor, reported, derived, measured, user)
or the statement that nobody disclosed it (`unknown`) or that the chip has no such unit
(`absent`, e.g. FP8 on Ascend 910C). The planner reads numbers through `Hardware.need`, so a
plan that depends on an undisclosed number stops with an error that names the number and
shows how to supply it, instead of silently guessing.

Units: memory GB (1e9), bandwidth GB/s or TB/s per chip (unidirectional), TFLOPS dense.
A "chip" is a device as the serving framework counts it: an Ascend 910C package is two dies
and vLLM/SGLang `--tp-size` counts dies, so Ascend A3 entries describe one die.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from deltamoe.errors import HardwareError

TAGS = ("vendor", "reported", "derived", "measured", "user", "unknown", "absent")

NUMBERS: dict[str, str] = {
    "mem_gb": "memory per chip, GB",
    "hbm_tbps": "memory bandwidth per chip, TB/s",
    "bf16_tflops": "dense BF16 TFLOPS per chip",
    "fp8_tflops": "dense FP8 TFLOPS per chip",
    "fp4_tflops": "dense FP4 TFLOPS per chip",
    "int8_tops": "dense INT8 TOPS per chip",
    "scaleup_gbps": "scale-up bandwidth per chip, GB/s unidirectional",
    "scaleup_domain": "chips in one scale-up domain",
    "scaleout_gbps": "scale-out (NIC) bandwidth per chip, GB/s",
    "chips_per_node": "chips in one --nodes unit (a server, a rack or a SuperPoD)",
}
COMPUTE_FIELDS = {"bf16": "bf16_tflops", "fp8": "fp8_tflops", "fp4": "fp4_tflops", "int8": "int8_tops"}


@dataclass(frozen=True)
class Figure:
    value: float | None
    tag: str
    source: str = ""

    @property
    def known(self) -> bool:
        return self.value is not None and self.tag not in ("unknown", "absent")

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "tag": self.tag, "source": self.source}


def V(value: float, source: str) -> Figure:
    return Figure(value, "vendor", source)


def R(value: float, source: str) -> Figure:
    return Figure(value, "reported", source)


def D(value: float, source: str) -> Figure:
    return Figure(value, "derived", source)


def UNKNOWN(source: str = "not disclosed by any source found") -> Figure:
    return Figure(None, "unknown", source)


def ABSENT(source: str) -> Figure:
    return Figure(None, "absent", source)


@dataclass(frozen=True)
class Efficiency:
    """How close a software stack gets to the hardware peaks: model assumptions, not vendor data.

    They are anchored on measurements (spec §1.1, §3.6-3.7) and reported with every plan;
    override them per entry in a hardware file (`efficiency:` mapping).
    """

    mfu_prefill: float  # fraction of peak matmul rate in large-batch prefill
    mfu_decode: float  # fraction of peak in small-M decode matmuls
    mbu: float  # fraction of HBM bandwidth actually streamed
    scaleup_eff: float  # achieved / nominal scale-up bandwidth for all-to-all (DeepEP-style)
    scaleout_eff: float  # achieved / nominal NIC bandwidth
    scaleup_latency_us: float  # fixed cost of one collective inside the domain
    scaleout_latency_us: float  # fixed cost of one collective across domains
    layer_overhead_us: float  # per-layer launch/sync cost of a decode step (graphs captured)
    overlap_eff: float  # share of communication hidden behind compute by two-batch overlap
    source: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    vendor: str  # "nvidia" | "ascend" | "thead" | "mthreads": picks launch-recipe flavour
    figures: dict[str, Figure]
    efficiency: Efficiency
    split_unit: int = 8  # granularity (chips) of a prefill/decode split inside one node
    dies_per_card: int = 1
    origin: str = "catalog"
    notes: tuple[str, ...] = ()

    def figure(self, name: str) -> Figure:
        return self.figures.get(name, UNKNOWN())

    def need(self, name: str, why: str) -> float:
        """The value of a number the plan depends on, or a HardwareError naming it."""
        fig = self.figure(name)
        if fig.known:
            return float(fig.value)  # type: ignore[arg-type]
        state = "is not disclosed by any vendor" if fig.tag == "unknown" else "does not exist on this chip"
        raise HardwareError(
            f"{self.name}: {name} ({NUMBERS.get(name, name)}) {state}, and {why} needs it",
            field=f"hardware.{name}",
            hint=f"supply it in a YAML/JSON hardware file: `name: {self.name}` + `{name}: <number>` "
                 f"and pass --hardware FILE",
        )

    def require(self, needs: dict[str, str]) -> None:
        """Check every number a plan needs at once, so one error lists all that are missing."""
        missing = {n: why for n, why in needs.items() if not self.figure(n).known and self.has(n)}
        if not missing:
            return
        listed = "; ".join(f"{n} ({NUMBERS.get(n, n)}) for {why}" for n, why in missing.items())
        lines = " + ".join(f"`{n}: <number>`" for n in missing)
        raise HardwareError(
            f"{self.name}: no vendor has disclosed {listed}", field=f"hardware.{next(iter(missing))}",
            hint=f"supply them in a YAML/JSON hardware file (`base: {self.name}` + {lines}) and pass --hardware FILE")

    def compute_field(self, path: tuple[str, ...]) -> str:
        """The number a matmul precision path reads: its first precision the chip has."""
        for dtype in path:
            if self.has(COMPUTE_FIELDS[dtype]):
                return COMPUTE_FIELDS[dtype]
        return COMPUTE_FIELDS[path[-1]]

    def has(self, name: str) -> bool:
        return self.figure(name).tag != "absent"

    def peak_tflops(self, path: tuple[str, ...], why: str) -> tuple[float, str]:
        """Peak of the first precision in `path` the chip has; undisclosed rates are errors."""
        for dtype in path:
            fname = COMPUTE_FIELDS[dtype]
            if self.has(fname):
                return self.need(fname, why), dtype
        raise HardwareError(f"{self.name} has none of the matmul precisions {path}", field="hardware",
                            hint="pick another --weights scheme")

    @property
    def chips_per_node(self) -> int:
        return int(self.need("chips_per_node", "sizing a deployment in --nodes"))

    @property
    def scaleup_domain(self) -> int:
        return int(self.need("scaleup_domain", "placing TP/EP groups"))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "vendor": self.vendor,
                "origin": self.origin, "dies_per_card": self.dies_per_card,
                "figures": {k: v.to_json() for k, v in self.figures.items()},
                "efficiency": self.efficiency.to_json(), "notes": list(self.notes)}
