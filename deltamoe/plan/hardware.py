"""Finding an accelerator: a catalog name or alias, or a YAML/JSON file that adds or overrides an entry.

The description itself (`Figure`, `Efficiency`, `Hardware`) lives in `accelerator.py`, the
built-in entries in `catalog.py`; this module reads both, and neither reads it.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
    if path.is_dir():
        raise HardwareError(f"hardware file {path} is a directory", field="hardware",
                            hint="pass a YAML or JSON file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise HardwareError(f"hardware file {path} is not UTF-8 text (byte {e.start}: {e.reason})",
                            field="hardware", hint="save it as UTF-8 YAML or JSON") from e
    except OSError as e:
        raise HardwareError(f"hardware file {path} cannot be read: {e.strerror or e}", field="hardware") from e
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise HardwareError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}",
                            field="hardware") from e
    return hardware_from_dict(data, origin=str(path))


_META = {"name", "base", "description", "vendor", "split_unit", "dies_per_card", "efficiency", "notes"}
# Counts of chips: whole numbers (the rest of NUMBERS are rates and sizes).
INTEGER_NUMBERS = {"chips_per_node", "scaleup_domain"}


def hardware_from_dict(data: Any, origin: str = "user") -> Hardware:
    """Build an entry from a mapping; `base` (or a catalog `name`) supplies what is not given."""
    if not isinstance(data, dict):
        raise HardwareError(f"{origin}: expected a mapping of hardware fields, got {type(data).__name__}",
                            field="hardware")
    unknown = sorted((k for k in data if k not in _META and k not in NUMBERS), key=str)  # keys may be ints
    if unknown:
        raise HardwareError(f"{origin}: unknown field {unknown[0]!r}", field=f"hardware.{unknown[0]}",
                            hint=f"numbers: {', '.join(NUMBERS)}; also {', '.join(sorted(_META))}")
    name = data.get("name")
    if name is None or name == "":
        raise HardwareError(f"{origin}: missing or empty 'name'", field="hardware.name")
    for key in ("name", "base", "description", "vendor"):
        if key in data and not isinstance(data[key], str):
            raise HardwareError(f"{origin}: {key} must be a string, got {type(data[key]).__name__} "
                                f"{data[key]!r}", field=f"hardware.{key}", hint=f'quote it: {key}: "..."')
    notes = data.get("notes")
    if notes is not None and not (isinstance(notes, list) and all(isinstance(n, str) for n in notes)):
        raise HardwareError(f"{origin}: notes must be a list of strings, got {type(notes).__name__} {notes!r}",
                            field="hardware.notes", hint='notes: ["first note", "second note"]')
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
            figures[key] = _parse_figure(data[key], key, origin, integer=key in INTEGER_NUMBERS)
    eff = base.efficiency
    if "efficiency" in data:
        eff = _parse_efficiency(data["efficiency"], eff, origin)
    return Hardware(
        name=name, description=str(data.get("description", base.description)),
        vendor=str(data.get("vendor", base.vendor)), figures=figures, efficiency=eff,
        split_unit=_parse_int(data.get("split_unit", base.split_unit), "split_unit", origin),
        dies_per_card=_parse_int(data.get("dies_per_card", base.dies_per_card), "dies_per_card", origin),
        origin=origin, notes=tuple(base.notes if notes is None else notes),
    )


# Above this a figure is a typo, and GB x 1e9 x chips would overflow to inf in the estimates.
MAX_FIGURE = 1e12


def _parse_int(value: Any, key: str, origin: str) -> int:
    number = _number(value)
    if number is None or not number.is_integer() or number < 1 or number > MAX_FIGURE:
        raise HardwareError(f"{origin}: {key} must be a positive integer, got {value!r}", field=f"hardware.{key}")
    return int(number)


def _number(value: Any) -> float | None:
    """A finite number, from a YAML/JSON number or a numeric string; None otherwise.

    PyYAML (YAML 1.1) reads `2.5e3`, `2e3` and `1e-300` as strings (it wants a dot and a signed
    exponent), so a string that Python reads as a float counts as that number.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return value if math.isfinite(value) else None


def _parse_figure(value: Any, key: str, origin: str, integer: bool = False) -> Figure:
    if value is None:
        return UNKNOWN(f"{origin}: marked unknown")
    if isinstance(value, dict):
        extra = sorted((k for k in value if k not in ("value", "tag", "source")), key=str)
        if extra:
            raise HardwareError(f"{origin}: {key} has unknown key {extra[0]!r} (expected value, tag, source)",
                                field=f"hardware.{key}")
        tag = value.get("tag", "user")
        if tag not in TAGS:
            raise HardwareError(f"{origin}: {key}.tag must be one of {TAGS}, got {tag!r}", field=f"hardware.{key}")
        inner = value.get("value")
        if inner is None:
            return Figure(None, tag if tag in ("unknown", "absent") else "unknown", str(value.get("source", origin)))
        number = _parse_int(inner, key, origin) if integer else _positive(inner, key, origin)
        return Figure(float(number), tag, str(value.get("source", origin)))
    number = _parse_int(value, key, origin) if integer else _positive(value, key, origin)
    return Figure(float(number), "user", origin)


def _positive(value: Any, key: str, origin: str) -> float:
    """A finite number > 0 (NaN and inf are refused: they would pass `<= 0` and poison every estimate)."""
    number = _number(value)
    if number is None or number <= 0 or number > MAX_FIGURE:
        raise HardwareError(f"{origin}: {key} must be a positive number (finite, at most {MAX_FIGURE:g}), "
                            f"got {value!r}", field=f"hardware.{key}",
                            hint="write numbers as 2500, 2.5e+3 or 2.5e3" if isinstance(value, str) else None)
    return number


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
