"""Accelerator descriptions: every number with its provenance, and user overrides from a file.

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
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

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


# ----------------------------------------------------------------- lookup
def _catalog() -> dict[str, Hardware]:
    from deltamoe.plan.catalog import CATALOG

    return CATALOG


def _aliases() -> dict[str, str]:
    from deltamoe.plan.catalog import ALIASES

    return ALIASES


def list_hardware() -> list[str]:
    return sorted(_catalog())


def get_hardware(name_or_file: str) -> Hardware:
    """A catalog name (or alias), or a YAML/JSON file that adds or overrides an entry."""
    key = name_or_file.strip().lower()
    key = _aliases().get(key, key)
    if key in _catalog():
        return _catalog()[key]
    path = Path(name_or_file)
    if path.suffix.lower() in (".yaml", ".yml", ".json") or path.exists():
        return load_hardware_file(path)
    raise HardwareError(f"unknown hardware {name_or_file!r}; known: {', '.join(list_hardware())}",
                        field="hardware", hint="or pass a YAML/JSON hardware file")


def load_hardware_file(path: Path) -> Hardware:
    if not path.exists():
        raise HardwareError(f"hardware file {path} does not exist", field="hardware")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise HardwareError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}",
                            field="hardware") from e
    return hardware_from_dict(data, origin=str(path))


_META = {"name", "base", "description", "vendor", "split_unit", "dies_per_card", "efficiency", "notes"}


def hardware_from_dict(data: Any, origin: str = "user") -> Hardware:
    """Build an entry from a mapping; `base` (or a catalog `name`) supplies what is not given."""
    if not isinstance(data, dict):
        raise HardwareError(f"{origin}: expected a mapping of hardware fields, got {type(data).__name__}",
                            field="hardware")
    unknown = sorted(set(data) - _META - set(NUMBERS))
    if unknown:
        raise HardwareError(f"{origin}: unknown field {unknown[0]!r}", field=f"hardware.{unknown[0]}",
                            hint=f"numbers: {', '.join(NUMBERS)}; also {', '.join(sorted(_META))}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise HardwareError(f"{origin}: missing or empty 'name'", field="hardware.name")
    base_name = data.get("base", name if name.lower() in _catalog() else None)
    if base_name is not None:
        base_key = _aliases().get(str(base_name).lower(), str(base_name).lower())
        if base_key not in _catalog():
            raise HardwareError(f"{origin}: base {base_name!r} is not in the catalog; known: "
                                f"{', '.join(list_hardware())}", field="hardware.base")
        base = _catalog()[base_key]
    else:
        from deltamoe.plan.catalog import GENERIC_EFFICIENCY

        base = Hardware(name=name, description="user-defined", vendor="generic", figures={},
                        efficiency=GENERIC_EFFICIENCY)
    figures = dict(base.figures)
    for key in NUMBERS:
        if key in data:
            figures[key] = _parse_figure(data[key], key, origin)
    eff = base.efficiency
    if "efficiency" in data:
        eff = _parse_efficiency(data["efficiency"], eff, origin)
    return Hardware(
        name=name, description=str(data.get("description", base.description)),
        vendor=str(data.get("vendor", base.vendor)), figures=figures, efficiency=eff,
        split_unit=_parse_int(data.get("split_unit", base.split_unit), "split_unit", origin),
        dies_per_card=_parse_int(data.get("dies_per_card", base.dies_per_card), "dies_per_card", origin),
        origin=origin, notes=tuple(data.get("notes", base.notes)),
    )


def _parse_int(value: Any, key: str, origin: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HardwareError(f"{origin}: {key} must be a positive integer, got {value!r}", field=f"hardware.{key}")
    return value


def _parse_figure(value: Any, key: str, origin: str) -> Figure:
    if value is None:
        return UNKNOWN(f"{origin}: marked unknown")
    if isinstance(value, dict):
        extra = sorted(set(value) - {"value", "tag", "source"})
        if extra:
            raise HardwareError(f"{origin}: {key} has unknown key {extra[0]!r} (expected value, tag, source)",
                                field=f"hardware.{key}")
        tag = value.get("tag", "user")
        if tag not in TAGS:
            raise HardwareError(f"{origin}: {key}.tag must be one of {TAGS}, got {tag!r}", field=f"hardware.{key}")
        inner = value.get("value")
        if inner is None:
            return Figure(None, tag if tag in ("unknown", "absent") else "unknown", str(value.get("source", origin)))
        return Figure(_positive(inner, key, origin), tag, str(value.get("source", origin)))
    return Figure(_positive(value, key, origin), "user", origin)


def _positive(value: Any, key: str, origin: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise HardwareError(f"{origin}: {key} must be a positive number, got {value!r}", field=f"hardware.{key}")
    return float(value)


def _parse_efficiency(value: Any, base: Efficiency, origin: str) -> Efficiency:
    if not isinstance(value, dict):
        raise HardwareError(f"{origin}: efficiency must be a mapping", field="hardware.efficiency")
    names = {f.name for f in dataclasses.fields(Efficiency)} - {"source"}
    changes: dict[str, Any] = {}
    for k, v in value.items():
        if k not in names:
            raise HardwareError(f"{origin}: unknown efficiency field {k!r}; known: {', '.join(sorted(names))}",
                                field=f"hardware.efficiency.{k}")
        changes[k] = _positive(v, f"efficiency.{k}", origin)
    changes["source"] = f"{base.source}; overridden in {origin}"
    return dataclasses.replace(base, **changes)


__all__ = ["Figure", "Efficiency", "Hardware", "get_hardware", "list_hardware", "hardware_from_dict",
           "load_hardware_file", "NUMBERS"]
