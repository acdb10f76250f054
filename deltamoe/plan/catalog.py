"""The built-in accelerator catalog (spec/hardware-and-recipes.md §1), one entry per system.

Tags: V vendor-published, R reported, D derived by arithmetic, and `unknown` where no source
states the number (Zhenwu HBM bandwidth, Ascend 950 BF16 rate, ...). A `--nodes` unit is a
server for HGX/Atlas nodes and the whole pod for SuperPoD/NVL72 entries.
"""

from __future__ import annotations

from deltamoe.plan.accelerator import ABSENT, UNKNOWN, D, Efficiency, Figure, Hardware, R, V

# ------------------------------------------------------------------ sources
NV_DENSE = "SemiAnalysisAI/InferenceX-app gpu-specs.ts (dense values, topology, NIC)"
NV_H100 = "nvidia.com/en-us/data-center/h100 (mirror jishuzhan.net/article/1872432607539499010)"
NV_H200 = "nvidia.com/en-us/data-center/h200 (mirror lzwjava.github.io/nvidia-h200-gpu-specs-en)"
NV_B200 = "nvidia.com/en-us/data-center/dgx-b200; HGX B200 180 GB 7.7 TB/s (zdszero.github.io Hardware)"
NV_GB200 = "nvidia.com/en-us/data-center/gb200-nvl72 (sparse 20/10/5 PF halved; 186 GB; 8 TB/s)"
NV_B300 = "verda.com/blog/gb300-nvl72-architecture; InferenceX gpu-specs.ts"
DEEPEP = "github.com/deepseek-ai/DeepEP README (H800: ~160 GB/s NVLink, CX-7 ~50 GB/s RDMA)"
CM384 = "arxiv.org/abs/2506.12708 (CloudMatrix384); UB 392 GB/s per 910C: reportify.ai/social-media/711244532271168"
A3_DIES = "docs.sglang.io ascend_npu_reference: A3 node = 8 x 910C = 16 dies as vLLM/SGLang devices"
TPU_910C = "techpowerup.com/335749 (910C 2 x 64 GB HBM2E, ~3.2 TB/s R); 752 TF BF16 per package (CM384 paper)"
ASC950 = "huawei.com/en/news/2025/9/hc-xu-keynote-speech; lucaberton.com/blog/huawei-atlas-950-superpod"
ASC950_RECIPE = "vllm-ascend docs/source/tutorials/models/Kimi-K3.md: 4 x 950DT = EP32 (8 per node)"
MTT = "ldeepai.com/tech-hub/moore-threads-mtt-s5000-1000-tflops-fp8-gpu"
ZW810 = "servernews.ru/1136036 (96 GB, ICN 700 GB/s, 16-card systems); 119 TF: hxjkbz.com/n/959285"
M890 = "letsdatascience.com/news/t-head-unveils-zhenwu-m890 (144 GB, 800 GB/s, FP8/FP4 supported)"
M890_PF = "corenewsdaily.com Zhenwu M890 '0.6 PF FP16' (single source, low confidence)"
PANMAI = "kad8.com/network/t-head-panmai-920 (400 Gb/s SmartNIC), one per chip assumed"
M890_POD = "'Lingjun Zhenwu M890 SuperPoD' as reported: 64 chips, 800 GB/s all-to-all [SKU unconfirmed]"

# ------------------------------------------------------------ efficiencies
# Anchors: DeepSeek's H800 prefill profile reaches ~0.58 PF/s per GPU = 29 % of FP8 peak with
# communication inside the step (spec §3.7); the roofline here charges all-to-all separately,
# so the matmul fraction is higher. DeepEP reaches 153-158 of ~160-200 GB/s NVLink and 43-58
# of 50 GB/s RDMA (§1.1). The per-layer overhead and collective latencies are what remains of
# the measured K3 bs-1 TPOT on 8 x B300 (8.5 ms vs a 2.1 ms HBM roofline, §3.6). Two-batch
# overlap hides about half of the shorter of compute and communication: SGLang measures
# 27-35 % prefill and ~25 % decode gains from TBO, short of what full hiding would give.
NVIDIA_EFF = Efficiency(
    mfu_prefill=0.45, mfu_decode=0.5, mbu=0.7, scaleup_eff=0.75, scaleout_eff=0.85,
    scaleup_latency_us=10.0, scaleout_latency_us=25.0, layer_overhead_us=25.0, overlap_eff=0.5,
    source="anchored on DeepEP's measured bandwidths (github.com/deepseek-ai/DeepEP), DeepSeek-V3's prefill "
           "profile and K3's batch-1 TPOT on 8 x B300 (rows of `deltamoe plan --validate`)",
)
# DeepEP-Ascend reaches 102-152 GB/s of ~196 GB/s per die inside a node (§1.1); CANN graph
# launch and HCCL collectives cost more per layer than CUDA graphs + NCCL.
ASCEND_EFF = Efficiency(
    mfu_prefill=0.35, mfu_decode=0.35, mbu=0.55, scaleup_eff=0.6, scaleout_eff=0.6,
    scaleup_latency_us=20.0, scaleout_latency_us=50.0, layer_overhead_us=60.0, overlap_eff=0.5,
    source="anchored on DeepEP-Ascend's measured bandwidths (github.com/sgl-project/sgl-kernel-npu); latencies "
           "assumed (no public per-collective figure)",
)
# No public serving measurement exists for these chips: the NVIDIA numbers with a lower MBU.
GENERIC_EFFICIENCY = Efficiency(
    mfu_prefill=0.4, mfu_decode=0.4, mbu=0.6, scaleup_eff=0.7, scaleout_eff=0.7,
    scaleup_latency_us=15.0, scaleout_latency_us=40.0, layer_overhead_us=40.0, overlap_eff=0.5,
    source="assumed: no published serving measurement on this platform",
)


def _nvidia(name: str, desc: str, mem: Figure, hbm: Figure, bf16: float, fp8: float, fp4: float | None,
            link: Figure, domain: Figure, nic: Figure, node: Figure, src: str, split: int = 8,
            int8: float | None = None) -> Hardware:
    figures = {
        "mem_gb": mem, "hbm_tbps": hbm, "bf16_tflops": V(bf16, NV_DENSE), "fp8_tflops": V(fp8, NV_DENSE),
        "fp4_tflops": V(fp4, src) if fp4 else ABSENT("no FP4 tensor cores (Hopper)"),
        "int8_tops": V(int8 if int8 is not None else fp8, NV_DENSE),
        "scaleup_gbps": link, "scaleup_domain": domain, "scaleout_gbps": nic, "chips_per_node": node,
    }
    return Hardware(name=name, description=desc, vendor="nvidia", figures=figures, efficiency=NVIDIA_EFF,
                    split_unit=split)


def _ascend_910c_die(domain: Figure, node: Figure) -> dict[str, Figure]:
    """One 910C die: vendor figures are per two-die package, frameworks count dies."""
    return {
        "mem_gb": V(64, A3_DIES), "hbm_tbps": D(1.6, "3.2 TB/s per package (R) / 2 dies; " + TPU_910C),
        "bf16_tflops": D(376, "752 TF per package (CM384 paper) / 2 dies"),
        "fp8_tflops": ABSENT("910C has no FP8"), "fp4_tflops": ABSENT("910C has no FP4"),
        "int8_tops": D(752, "assumes INT8 = 2 x BF16 (not verified), per die"),
        "scaleup_gbps": D(196, "UB 392 GB/s per 910C (R) / 2 dies; " + CM384),
        "scaleup_domain": domain, "chips_per_node": node,
        "scaleout_gbps": D(12.5, "CM384 RoCE 76.8 Tbps / 384 NPUs = 200 Gb/s per package, / 2 dies"),
    }


_ENTRIES: list[Hardware] = [
    _nvidia("h100", "NVIDIA H100 SXM, HGX 8-GPU node", V(80, NV_H100), V(3.35, NV_H100), 989, 1979, None,
            V(450, "NVLink4 900 GB/s bidirectional (NVIDIA)"), V(8, NV_DENSE), V(50, "CX-7 400 Gb/s (NVIDIA)"),
            V(8, NV_DENSE), NV_H100),
    _nvidia("h800", "NVIDIA H800 SXM (export H100: NVLink cut to 400 GB/s bidirectional)", R(80, DEEPEP),
            R(3.35, DEEPEP), 989, 1979, None, R(200, "NVLink 400 GB/s bidirectional (NVIDIA H800 spec); "
                                                    "DeepEP measures ~160 GB/s"),
            R(8, DEEPEP), R(50, DEEPEP), R(8, DEEPEP), DEEPEP),
    _nvidia("h200", "NVIDIA H200 SXM, HGX 8-GPU node", V(141, NV_H200), V(4.8, NV_H200), 989, 1979, None,
            V(450, "NVLink4 900 GB/s bidirectional"), V(8, NV_DENSE), V(50, "CX-7 400 Gb/s"), V(8, NV_DENSE),
            NV_H200),
    _nvidia("b200", "NVIDIA B200, HGX 8-GPU node", V(180, NV_B200), V(7.7, NV_B200), 2250, 4500, 9000,
            V(900, "NVLink5 1.8 TB/s bidirectional"), V(8, NV_DENSE), V(50, "CX-7 400 Gb/s"), V(8, NV_DENSE),
            NV_B200),
    _nvidia("b300", "NVIDIA B300 (Blackwell Ultra), HGX 8-GPU node", V(268, NV_B300), V(8, NV_B300), 2250, 4500,
            13500, V(900, "NVLink5"), V(8, NV_DENSE), V(100, "CX-8 800 Gb/s"), V(8, NV_DENSE), NV_B300,
            int8=150),
    _nvidia("gb200-nvl72", "NVIDIA GB200 NVL72 rack: 72 GPUs in one NVLink domain (a --nodes unit = a rack)",
            V(186, NV_GB200), V(8, NV_GB200), 2500, 5000, 10000, V(900, "NVLink5, 130 TB/s per rack"),
            V(72, NV_GB200), V(50, "400 Gb/s per GPU"), V(72, NV_GB200), NV_GB200, split=4),
    Hardware(
        name="atlas-800i-a3",
        description="Huawei Atlas 800I A3 node: 8 x Ascend 910C = 16 dies (one device per die)",
        vendor="ascend", dies_per_card=2, split_unit=16, efficiency=ASCEND_EFF,
        figures=_ascend_910c_die(V(16, A3_DIES), V(16, A3_DIES)),
        notes=("vendor figures are per 910C package; --tp-size counts dies (dies_per_card = 2)",),
    ),
    Hardware(
        name="cloudmatrix384",
        description="Huawei CloudMatrix384 / Atlas 900 A3 SuperPoD: 384 x 910C = 768 dies on one UB fabric",
        vendor="ascend", dies_per_card=2, split_unit=16, efficiency=ASCEND_EFF,
        figures=_ascend_910c_die(R(768, CM384 + " (384 packages)"), R(768, CM384)),
        notes=("UB all-to-all across the pod, ~269 TB/s aggregate (R)",),
    ),
    Hardware(
        name="ascend-950pr", description="Huawei Ascend 950PR (Q1 2026), 8-card server",
        vendor="ascend", efficiency=ASCEND_EFF,
        figures={
            "mem_gb": V(128, ASC950 + ' ("HiBL 1.0")'), "hbm_tbps": V(1.6, ASC950),
            "bf16_tflops": UNKNOWN("BF16 rate not stated (n/s)"), "fp8_tflops": V(1000, ASC950 + " FP8/MXFP8/HiF8"),
            "fp4_tflops": V(2000, ASC950 + " MXFP4"), "int8_tops": UNKNOWN("INT8 rate not stated"),
            "scaleup_gbps": V(2000, ASC950), "scaleup_domain": D(8, ASC950_RECIPE),
            "chips_per_node": D(8, ASC950_RECIPE), "scaleout_gbps": UNKNOWN("RoCE rate per chip not stated"),
        },
    ),
    Hardware(
        name="ascend-950dt", description="Huawei Ascend 950DT (Q4 2026), 8-card server",
        vendor="ascend", efficiency=ASCEND_EFF,
        figures={
            "mem_gb": V(144, ASC950 + ' ("HiZQ 2.0")'), "hbm_tbps": V(4.0, ASC950),
            "bf16_tflops": UNKNOWN("BF16 rate not stated (n/s)"), "fp8_tflops": V(1000, ASC950),
            "fp4_tflops": V(2000, ASC950), "int8_tops": UNKNOWN("INT8 rate not stated"),
            "scaleup_gbps": V(2000, ASC950), "scaleup_domain": D(8, ASC950_RECIPE),
            "chips_per_node": D(8, ASC950_RECIPE), "scaleout_gbps": UNKNOWN("RoCE rate per chip not stated"),
        },
    ),
    Hardware(
        name="atlas-950-superpod",
        description="Huawei Atlas 950 SuperPoD: 8,192 x 950DT on UB 2.0 (a --nodes unit = an 8-card server)",
        vendor="ascend", efficiency=ASCEND_EFF,
        figures={
            "mem_gb": V(144, ASC950), "hbm_tbps": V(4.0, ASC950),
            "bf16_tflops": UNKNOWN("BF16 rate not stated (n/s)"), "fp8_tflops": V(1000, ASC950 + " (8 EF / 8192)"),
            "fp4_tflops": V(2000, ASC950 + " (16 EF / 8192)"), "int8_tops": UNKNOWN("INT8 rate not stated"),
            "scaleup_gbps": D(1990, "UB 2.0 16.3 PB/s / 8192 chips"), "scaleup_domain": V(8192, ASC950),
            "chips_per_node": D(8, ASC950_RECIPE), "scaleout_gbps": UNKNOWN("UBoE/RoCE rate between pods not stated"),
        },
        notes=("first deliveries reported as 1,024-card pods (R)",),
    ),
    Hardware(
        name="mtt-s5000", description="Moore Threads MTT S5000 (all figures reported, none vendor-confirmed)",
        vendor="mthreads", efficiency=GENERIC_EFFICIENCY,
        figures={
            "mem_gb": R(80, MTT), "hbm_tbps": R(1.6, MTT), "bf16_tflops": UNKNOWN("n/s"),
            "fp8_tflops": R(1000, MTT), "fp4_tflops": UNKNOWN("n/s"), "int8_tops": UNKNOWN("n/s"),
            "scaleup_gbps": R(784, MTT + " MTLink"), "scaleup_domain": UNKNOWN("MTLink domain size n/s"),
            "chips_per_node": UNKNOWN("server size n/s"), "scaleout_gbps": UNKNOWN("n/s"),
        },
    ),
    Hardware(
        name="zhenwu-810e", description="T-Head Zhenwu 810E PPU, 16-card ICN system",
        vendor="thead", efficiency=GENERIC_EFFICIENCY,
        figures={
            "mem_gb": V(96, ZW810), "hbm_tbps": UNKNOWN("PPU HBM bandwidth n/s"),
            "bf16_tflops": D(119, "16,384 cards = 1,945 PF (precision unstated, R); " + ZW810),
            "fp8_tflops": UNKNOWN("n/s"), "fp4_tflops": ABSENT("no FP4 reported"), "int8_tops": UNKNOWN("n/s"),
            "scaleup_gbps": V(700, ZW810 + " ICN, 7 ports"), "scaleup_domain": V(16, ZW810),
            "chips_per_node": V(16, ZW810), "scaleout_gbps": UNKNOWN("host PCIe 5.0 x16; NIC n/s"),
        },
    ),
    Hardware(
        name="zhenwu-m890", description="T-Head Zhenwu M890 (May 2026), 8-card server",
        vendor="thead", efficiency=GENERIC_EFFICIENCY,
        figures={
            "mem_gb": V(144, M890), "hbm_tbps": UNKNOWN("M890 HBM bandwidth not disclosed"),
            "bf16_tflops": R(600, M890_PF), "fp8_tflops": UNKNOWN("supported (V), rate not disclosed"),
            "fp4_tflops": UNKNOWN("supported (V), rate not disclosed"), "int8_tops": UNKNOWN("n/s"),
            "scaleup_gbps": V(800, M890), "scaleup_domain": UNKNOWN("server size n/s"),
            "chips_per_node": UNKNOWN("server size n/s"), "scaleout_gbps": D(50, PANMAI),
        },
    ),
    Hardware(
        name="m890-superpod",
        description="Lingjun Zhenwu M890 SuperPoD: 64 x M890, 800 GB/s all-to-all, ~9.2 TB (a --nodes unit = a pod)",
        vendor="thead", efficiency=GENERIC_EFFICIENCY, split_unit=8,
        figures={
            "mem_gb": V(144, M890), "hbm_tbps": UNKNOWN("M890 HBM bandwidth not disclosed"),
            "bf16_tflops": R(600, M890_PF), "fp8_tflops": UNKNOWN("supported (V), rate not disclosed"),
            "fp4_tflops": UNKNOWN("supported (V), rate not disclosed"), "int8_tops": UNKNOWN("n/s"),
            "scaleup_gbps": R(800, M890_POD), "scaleup_domain": R(64, M890_POD),
            "chips_per_node": R(64, M890_POD), "scaleout_gbps": D(50, PANMAI),
        },
        notes=("only the 128-card Panjiu AL128 supernode is documented; the 64-chip SKU is unconfirmed",
               "total memory 64 x 144 GB = 9.2 TB (derived)"),
    ),
]

CATALOG: dict[str, Hardware] = {h.name: h for h in _ENTRIES}
ALIASES: dict[str, str] = {
    "h100-sxm": "h100", "h200-sxm": "h200", "h800-sxm": "h800", "gb200": "gb200-nvl72", "nvl72": "gb200-nvl72",
    "ascend-910c": "atlas-800i-a3", "910c": "atlas-800i-a3", "a3": "atlas-800i-a3",
    "atlas-900-a3-superpod": "cloudmatrix384", "cm384": "cloudmatrix384",
    "950pr": "ascend-950pr", "950dt": "ascend-950dt", "m890": "zhenwu-m890", "810e": "zhenwu-810e",
    "s5000": "mtt-s5000", "zhenwu-m890-superpod": "m890-superpod",
}
