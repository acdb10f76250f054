"""Catalog provenance, undisclosed numbers, and user hardware files."""

import json

import pytest

from deltamoe.errors import HardwareError
from deltamoe.plan.accelerator import NUMBERS, TAGS
from deltamoe.plan.hardware import get_hardware, list_hardware

REQUIRED = {"h100", "h200", "b200", "gb200-nvl72", "atlas-800i-a3", "cloudmatrix384", "ascend-950pr",
            "ascend-950dt", "atlas-950-superpod", "mtt-s5000", "zhenwu-810e", "zhenwu-m890", "m890-superpod"}


def test_catalog_covers_the_issue_and_tags_every_number():
    assert REQUIRED <= set(list_hardware())
    for name in list_hardware():
        hw = get_hardware(name)
        assert set(hw.figures) == set(NUMBERS), name
        for key, fig in hw.figures.items():
            assert fig.tag in TAGS, (name, key)
            assert fig.source, (name, key)  # every number (or its absence) says where that comes from
            assert (fig.value is None) == (fig.tag in ("unknown", "absent")), (name, key)


def test_key_figures():
    pod = get_hardware("m890-superpod")
    assert pod.chips_per_node == 64 and pod.scaleup_domain == 64
    assert pod.figure("scaleup_gbps").value == 800
    assert 64 * pod.figure("mem_gb").value == pytest.approx(9216)  # "about 9 TB"
    assert pod.figure("hbm_tbps").tag == "unknown"
    a3 = get_hardware("ascend-910c")  # alias; one device = one die
    assert a3.name == "atlas-800i-a3" and a3.dies_per_card == 2 and a3.chips_per_node == 16
    assert a3.figure("fp8_tflops").tag == "absent"
    assert get_hardware("gb200").scaleup_domain == 72
    assert get_hardware("h200").figure("hbm_tbps").tag == "vendor"


def test_undisclosed_number_names_itself():
    with pytest.raises(HardwareError) as e:
        get_hardware("zhenwu-m890").need("hbm_tbps", "the decode roofline")
    assert e.value.field == "hardware.hbm_tbps"
    assert "not disclosed" in str(e.value) and "hbm_tbps" in e.value.hint


def test_unknown_name_lists_the_catalog():
    with pytest.raises(HardwareError) as e:
        get_hardware("tpu-v9")
    assert "h200" in str(e.value) and "m890-superpod" in str(e.value)


def test_yaml_file_overrides_a_catalog_entry(tmp_path):
    f = tmp_path / "pod.yaml"
    f.write_text("name: my-pod\nbase: m890-superpod\nhbm_tbps: 4.0\n"
                 "fp8_tflops: {value: 1200, source: my lab}\nefficiency: {mbu: 0.5}\n")
    hw = get_hardware(str(f))
    assert hw.name == "my-pod" and hw.need("hbm_tbps", "x") == 4.0
    assert hw.figure("hbm_tbps").tag == "user"
    assert hw.figure("fp8_tflops").source == "my lab"
    assert hw.figure("mem_gb").value == 144  # inherited from the base
    assert hw.efficiency.mbu == 0.5


def test_json_file_adds_a_new_entry(tmp_path):
    f = tmp_path / "chip.json"
    f.write_text(json.dumps({"name": "x1", "mem_gb": 96, "hbm_tbps": 3, "bf16_tflops": 500, "scaleup_gbps": 400,
                             "scaleup_domain": 8, "chips_per_node": 8, "scaleout_gbps": 50}))
    hw = get_hardware(str(f))
    assert hw.chips_per_node == 8 and hw.figure("fp8_tflops").tag == "unknown"


@pytest.mark.parametrize("text, field", [
    ("name: a\nbase: h200\nhbm_tbs: 4\n", "hardware.hbm_tbs"),
    ("name: a\nbase: h200\nhbm_tbps: fast\n", "hardware.hbm_tbps"),
    ("name: a\nbase: h200\nhbm_tbps: -1\n", "hardware.hbm_tbps"),
    ("base: h200\n", "hardware.name"),
    ("name: a\nbase: nope\n", "hardware.base"),
    ("name: a\nbase: h200\nefficiency: {speed: 2}\n", "hardware.efficiency.speed"),
    ("name: a\nbase: h200\nefficiency: {mfu_decode: 50}\n", "hardware.efficiency.mfu_decode"),  # a fraction
    ("name: a\nbase: h200\nmem_gb: {value: 1, tag: rumour}\n", "hardware.mem_gb"),
    ("- not a mapping\n", "hardware"),
])
def test_malformed_file_names_the_field(tmp_path, text, field):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(HardwareError) as e:
        get_hardware(str(f))
    assert e.value.field == field


def test_catalog_and_accelerator_never_import_the_lookup_module():
    """accelerator.py (types) <- catalog.py (entries) <- hardware.py (lookup): no cycle, not even a lazy one."""
    import ast
    from pathlib import Path

    import deltamoe.plan as plan

    folder = Path(plan.__file__).parent
    for name, forbidden in (("accelerator", {"deltamoe.plan.hardware", "deltamoe.plan.catalog"}),
                            ("catalog", {"deltamoe.plan.hardware"})):
        tree = ast.parse((folder / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not imported & forbidden, (name, imported & forbidden)


@pytest.mark.parametrize("text, field, words", [
    ("name: a\nbase: h200\nnotes: 5\n", "hardware.notes", "notes must be a list of strings, got int"),
    ("name: a\nbase: h200\nnotes: hello\n", "hardware.notes", "notes must be a list of strings, got str"),
    ("name: a\nbase: h200\nvendor: 7\n", "hardware.vendor", "vendor must be a string, got int"),
    ("name: 123\nbase: h200\n", "hardware.name", "name must be a string, got int"),  # there, of the wrong type
    ("name: a\nbase: h200\nchips_per_node: 7.5\n", "hardware.chips_per_node", "must be a positive integer"),
    ("name: a\nbase: h200\nscaleup_domain: 2.5\n", "hardware.scaleup_domain", "must be a positive integer"),
    ("name: a\nbase: h200\nscaleup_domain: {value: 2.5}\n", "hardware.scaleup_domain", "must be a positive integer"),
    ("name: a\nbase: h200\nhbm_tbps: .nan\n", "hardware.hbm_tbps", "must be a positive number"),
    ("name: a\nbase: h200\nmem_gb: .inf\n", "hardware.mem_gb", "must be a positive number"),
    ("name: a\nbase: h200\nmem_gb: 1e300\n", "hardware.mem_gb", "must be a positive number"),
    ("name: a\nbase: h200\nfp8_tflops: {value: .nan}\n", "hardware.fp8_tflops", "must be a positive number"),
    ("name: a\nbase: h200\nefficiency: {mbu: .nan}\n", "hardware.efficiency.mbu", "must be a positive number"),
    ("name: a\nbase: h200\nefficiency: {layer_overhead_us: .inf}\n", "hardware.efficiency.layer_overhead_us",
     "must be a positive number"),
    ("name: a\nbase: h200\n1: x\n", "hardware.1", "unknown field"),
])
def test_wrong_types_and_non_finite_numbers_name_the_field(tmp_path, text, field, words):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(HardwareError) as e:
        get_hardware(str(f))
    assert e.value.field == field and words in str(e.value)


def test_json_nan_is_refused(tmp_path):
    f = tmp_path / "chip.json"
    f.write_text('{"name": "x", "base": "h200", "hbm_tbps": NaN}')
    with pytest.raises(HardwareError) as e:
        get_hardware(str(f))
    assert e.value.field == "hardware.hbm_tbps"


def test_unreadable_files_are_one_line_errors(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00bin")
    with pytest.raises(HardwareError) as e:
        get_hardware(str(binary))
    assert e.value.field == "hardware" and "is not UTF-8 text" in str(e.value) and "binary.yaml" in str(e.value)
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    with pytest.raises(HardwareError) as e:
        get_hardware(str(folder))
    assert e.value.field == "hardware" and "is a directory" in str(e.value)


def test_scientific_notation_and_whole_floats_are_numbers(tmp_path):
    """PyYAML reads 2.5e3 / 2e3 / 1e-3 as strings (YAML 1.1 wants `2.5e+3`): they count as numbers."""
    f = tmp_path / "sci.yaml"
    f.write_text("name: x\nbase: h200\nfp8_tflops: 2.5e3\nbf16_tflops: 1e3\nhbm_tbps: {value: 48e-1}\n"
                 "chips_per_node: 8.0\nscaleup_domain: 8e0\nnotes: [one, two]\n")
    hw = get_hardware(str(f))
    assert hw.need("fp8_tflops", "x") == 2500 and hw.need("bf16_tflops", "x") == 1000
    assert hw.need("hbm_tbps", "x") == 4.8 and hw.chips_per_node == 8 and hw.scaleup_domain == 8
    assert hw.notes == ("one", "two")
    f.write_text("name: x\nbase: h200\nfp8_tflops: fast\n")
    with pytest.raises(HardwareError) as e:
        get_hardware(str(f))
    assert "2.5e+3" in e.value.hint
