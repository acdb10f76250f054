"""Parameter counts on the meta device: the exact K3 figures from spec §7, and `deltamoe info`."""

import json
import subprocess
import sys

from deltamoe.config import load_preset
from deltamoe.model.params import count_parameters


def test_kimi_k3_exact_counts():
    c = count_parameters(load_preset("kimi-k3"))
    assert c.total == 2_779_484_476_000
    assert c.active == 104_189_612_640
    assert c.routed_experts == 2_722_740_830_208
    assert c.vision == 447_358_976
    assert c.total_with_vision == 2_779_931_834_976
    wb = c.weight_bytes()
    assert round(wb["bf16"] / 1e12, 2) == 5.56
    assert round(wb["all_4bit"] / 1e12, 2) == 1.39
    assert round(wb["mxfp4_experts"] / 2**30, 1) == 1453.6  # spec: 1.56 TB = 1,453.6 GiB


def test_k31_pro_adds_the_indexers():
    k3 = count_parameters(load_preset("kimi-k3"))
    k31 = count_parameters(load_preset("kimi-k3.1-pro"))
    assert k31.total - k3.total == 178_526_208
    assert k31.active - k3.active == 178_526_208


def test_mtp_layers_counted_apart():
    cfg = load_preset("tiny")
    with_mtp = count_parameters(cfg)
    without = count_parameters(cfg.replace(num_nextn_predict_layers=0))
    assert with_mtp.mtp > 0 and with_mtp.total - without.total == with_mtp.mtp
    assert with_mtp.active == without.active


def test_info_cli_json():
    out = subprocess.run([sys.executable, "-m", "deltamoe", "info", "kimi-k3", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["total"] == 2_779_484_476_000 and data["active"] == 104_189_612_640
    assert data["layers"] == {"kda": 69, "mla": 24, "dsa": 0}


def test_info_cli_bad_model_is_one_line_exit_2():
    out = subprocess.run([sys.executable, "-m", "deltamoe", "info", "kimi-k9"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "model" in out.stderr and "kimi-k3" in out.stderr
