"""`deltamoe info`: byte counts are whole numbers in JSON, and every table column has a header."""

from __future__ import annotations

import json

from deltamoe.cli import main
from deltamoe.config import load_preset
from deltamoe.model.params import count_parameters


def test_json_weight_bytes_are_ints_rounded_up(capsys) -> None:
    assert main(["info", "tiny", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    exact = count_parameters(load_preset("tiny")).weight_bytes()
    assert doc["weight_bytes"] == {"bf16": 7_713_648, "fp8": 3_857_766, "mxfp4_experts": 4_248_432,
                                   "all_4bit": 1_928_412}
    assert all(type(v) is int for v in doc["weight_bytes"].values())
    assert exact["fp8"] != int(exact["fp8"]) and doc["weight_bytes"]["fp8"] == int(exact["fp8"]) + 1


def test_table_columns_all_have_headers(capsys) -> None:
    assert main(["info", "tiny"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "quantity" in line)
    cells = [c.strip() for c in header.strip("┃│ ").split("┃")]
    assert cells == ["quantity", "exact", "approx. / share"], header
    assert "3,857,766 B" in out and "3,857,765" not in out
