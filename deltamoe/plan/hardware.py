"""Finding an accelerator: a catalog name or alias, or a YAML/JSON file that adds or overrides an entry.

The description itself (`Figure`, `Efficiency`, `Hardware`) lives in `accelerator.py`, the
built-in entries in `catalog.py`; this module reads both, and neither reads it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from deltamoe.errors import HardwareError
from deltamoe.plan.accelerator import NUMBERS, TAGS, UNKNOWN, Efficiency, Figure, Hardware
from deltamoe.plan.catalog import ALIASES, CATALOG, GENERIC_EFFICIENCY


def list_hardware() -> list[str]:
    return sorted(CATALOG)


def get_hardware(name_or_file: str) -> Hardware:
    """A catalog name (or alias), or a YAML/JSON file that adds or overrides an entry."""
    key = name_or_file.strip().lower()
    key = ALIASES.get(key, key)
    if key in CATALOG:
        return CATALOG[key]
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
    base_name = data.get("base", name if name.lower() in CATALOG else None)
    if base_name is not None:
        base_key = ALIASES.get(str(base_name).lower(), str(base_name).lower())
        if base_key not in CATALOG:
            raise HardwareError(f"{origin}: base {base_name!r} is not in the catalog; known: "
                                f"{', '.join(list_hardware())}", field="hardware.base")
        base = CATALOG[base_key]
    else:
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


FRACTIONS = {"mfu_prefill", "mfu_decode", "mbu", "scaleup_eff", "scaleout_eff", "overlap_eff"}  # the rest: times


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
        if k in FRACTIONS and changes[k] > 1:
            raise HardwareError(f"{origin}: efficiency.{k} is a fraction of a peak, in (0, 1]; got {v}",
                                field=f"hardware.efficiency.{k}")
    changes["source"] = f"{base.source}; overridden in {origin}"
    return dataclasses.replace(base, **changes)
