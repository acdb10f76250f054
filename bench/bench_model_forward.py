"""Whole-model forward tokens/s: deltamoe vs transformers KimiLinearForCausalLM, identical weights.

hidden 256, 8 layers (6 KDA + 2 MLA), T=2048, fp32, CPU. The transformers model is built with
random weights, saved with save_pretrained and loaded by deltamoe, so both run the same numbers.
Run: python bench/bench_model_forward.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, median_seconds, result_name, write_result  # noqa: E402


def kimi_linear_config(transformers, layers: int = 8, hidden: int = 256):
    full = [i for i in range(4, layers + 1, 4)]
    cfg = transformers.KimiLinearConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, num_local_experts=16,
        num_experts_per_tok=4, n_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
        linear_attn_config={"head_dim": 64, "num_heads": hidden // 64, "short_conv_kernel_size": 4,
                            "kda_layers": [i for i in range(1, layers + 1) if i not in full], "full_attn_layers": full},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="T=512, 2 repeats, writes model_forward_quick.json")
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    torch.set_num_threads(2)
    import transformers

    from deltamoe.model.load import load_model

    t = 512 if args.quick else args.seq_len
    torch.manual_seed(0)
    ref = transformers.KimiLinearForCausalLM(kimi_linear_config(transformers)).eval()
    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        ours = load_model(Path(d))
    ids = torch.randint(3, 4096, (1, t))
    with torch.no_grad():
        err = ((ours(ids).logits - ref(ids).logits).norm() / ref(ids).logits.norm()).item()
        repeats = 2 if args.quick else 3
        t_ours = median_seconds(lambda: ours(ids), repeats=repeats)
        t_ref = median_seconds(lambda: ref(ids), repeats=repeats)
    rows = [["deltamoe", f"{t / t_ours:,.0f}", f"{t_ours * 1e3:.0f}", f"{t_ref / t_ours:.2f}x"],
            ["transformers KimiLinear (torch fallbacks)", f"{t / t_ref:,.0f}", f"{t_ref * 1e3:.0f}", "1.00x"]]
    print(markdown_table(["forward, hidden 256, 8 layers, T=%d" % t, "tokens/s", "ms", "speedup"], rows))
    print(f"logits rel. error deltamoe vs transformers: {err:.2e}")
    write_result(result_name("model_forward", args.quick), {
        "seq_len": t, "hidden": 256, "layers": 8, "deltamoe_s": t_ours, "transformers_s": t_ref,
        "speedup": t_ref / t_ours, "logits_rel_err": err, "target": {"speedup": 1.5}})


if __name__ == "__main__":
    main()
