"""Vision: deltamoe's packed image encoder side by side with transformers' Kimi-K2.5 MoonViT at the
same dims (images/s, image tokens/s per image size), and the engine's time to first token for an
image + text prompt vs text alone vs a prefix-cache hit on a repeated image.

The encoder is the `tiny-vision` preset's tower + projector scaled to `--width` (random weights);
the peer is `Kimi_K25VisionModel` + `Kimi_K25MultimodalProjection` with the same hidden size,
heads, layers, MLP width and patch size (sdpa attention), fed the same patches. TTFT is one
request through `LLMEngine` (prefill + the first sampled token) on the `tiny-vision` model:
an image of `--ttft-size` pixels plus 33 text tokens, the same 33 text tokens alone, a text
prompt as long as the image prompt, and the image prompt again with its blocks in the prefix
cache (the encoder does not run).

    .venv/bin/python bench/bench_vision.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, median_seconds, result_name, write_result  # noqa: E402

from deltamoe.config import load_preset  # noqa: E402
from deltamoe.model.load import build_model  # noqa: E402
from deltamoe.model.vision import patchify  # noqa: E402
from deltamoe.serve.engine.config import EngineConfig  # noqa: E402
from deltamoe.serve.engine.llm_engine import LLMEngine  # noqa: E402
from deltamoe.serve.engine.sampling import SamplingParams  # noqa: E402
from deltamoe.vision.preprocess import PreparedImage, image_token_count  # noqa: E402


def encoder_models(width: int, layers: int):
    """deltamoe's tower + projector and transformers' K2.5 pair, same dims (random weights)."""
    from transformers.models.kimi_k25 import modeling_kimi_k25 as k25
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig

    base = load_preset("tiny-vision")
    heads = max(1, width // 64)
    vision = base.vision.__class__(**{**base.vision.__dict__, "hidden_size": width, "num_hidden_layers": layers,
                                      "num_attention_heads": heads, "head_dim": width // heads,
                                      "intermediate_size": 4 * width, "pos_emb_height": 64, "pos_emb_width": 64})
    config = base.replace(vision=vision)
    ours = build_model(config, seed=0).eval()
    vcfg = Kimi_K25VisionConfig(patch_size=vision.patch_size, num_attention_heads=heads, num_hidden_layers=layers,
                                hidden_size=width, intermediate_size=4 * width,
                                rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    cfg = Kimi_K25Config(vision_config=vcfg.to_dict(), text_config={"model_type": "deepseek_v3",
                                                                     "hidden_size": config.hidden_size},
                         projection_hidden_size=width)
    cfg.vision_config._attn_implementation = "sdpa"
    theirs_tower = k25.Kimi_K25VisionModel(cfg.vision_config).eval()
    theirs_proj = k25.Kimi_K25MultimodalProjection(cfg).eval()

    def theirs(images: list[torch.Tensor]) -> torch.Tensor:
        p = vision.patch_size
        pixels = torch.cat([patchify(img, p) for img in images]).view(-1, 3, p, p)
        grid = torch.tensor([[1, img.shape[-2] // p, img.shape[-1] // p] for img in images])
        return theirs_proj(theirs_tower(pixels, grid_thw=grid).pooler_output)

    return ours, theirs, vision


def bench_encoder(sizes: list[int], batch: int, width: int, layers: int, repeats: int) -> list[dict]:
    ours, theirs, vision = encoder_models(width, layers)
    rows = []
    for size in sizes:
        images = [torch.randn(3, size, size) for _ in range(batch)]
        tokens = image_token_count(vision, size, size) * batch
        with torch.inference_mode():
            t_ours = median_seconds(lambda: ours.encode_images(images), repeats)
            t_theirs = median_seconds(lambda: theirs(images), repeats)
        rows.append({"size": size, "batch": batch, "tokens_per_image": tokens // batch,
                     "deltamoe_images_per_s": batch / t_ours, "deltamoe_tokens_per_s": tokens / t_ours,
                     "transformers_images_per_s": batch / t_theirs, "transformers_tokens_per_s": tokens / t_theirs,
                     "speedup": t_theirs / t_ours})
        print(f"encoder {size}x{size} x{batch}: deltamoe {batch / t_ours:.1f} img/s, transformers "
              f"{batch / t_theirs:.1f} img/s ({t_theirs / t_ours:.2f}x)", flush=True)
    return rows


def bench_ttft(size: int, repeats: int) -> dict:
    model = build_model(load_preset("tiny-vision"), seed=0).eval()
    v = model.config.vision
    n = image_token_count(v, size, size)
    g = torch.Generator().manual_seed(0)
    # 33 text tokens: the prompt's last full block ends before its last token, so a repeat can hit it
    text = torch.randint(0, 256, (33,), generator=g).tolist()
    long_text = torch.randint(0, 256, (n + 33,), generator=g).tolist()
    hits: list[int] = []
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(ids: list[int], images: list[PreparedImage] | None, cache: bool, warm: bool = False) -> float:
        engine = LLMEngine(model, config=EngineConfig(cache_memory="256MiB", enable_prefix_caching=cache,
                                                      max_num_batched_tokens=4096))
        if warm:
            engine.generate([ids], params, progress=False, images=[images])
        t0 = time.perf_counter()
        done = engine.generate([ids], params, progress=False, images=[images] if images else None)
        elapsed = time.perf_counter() - t0
        if warm:
            hits.append(done[0].num_cached_tokens)
        return elapsed

    def median(fn) -> float:
        fn()
        return sorted(fn() for _ in range(repeats))[repeats // 2]

    image = PreparedImage(torch.randn(3, size, size, generator=g), n, content_hash=1)
    ids = [model.config.media_placeholder_token_id] * n + text
    out = {"image_size": size, "image_tokens": n, "text_tokens": len(text),
           "image_plus_text_s": median(lambda: ttft(ids, [image], cache=False)),
           "text_alone_s": median(lambda: ttft(text, None, cache=False)),
           "text_same_length_s": median(lambda: ttft(long_text, None, cache=False)),
           "repeated_image_prefix_hit_s": median(lambda: ttft(ids, [image], cache=True, warm=True))}
    out["prefix_hit_tokens"] = hits[-1]
    print(f"TTFT ({size}x{size} image = {n} tokens + {len(text)} text, {hits[-1]} from the prefix cache on a "
          f"repeat): image+text {out['image_plus_text_s'] * 1e3:.1f} ms, "
          f"text alone {out['text_alone_s'] * 1e3:.1f} ms, text of the same length "
          f"{out['text_same_length_s'] * 1e3:.1f} ms, repeated image (prefix hit) "
          f"{out['repeated_image_prefix_hit_s'] * 1e3:.1f} ms", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (a smoke test)")
    p.add_argument("--width", type=int, default=256, help="encoder hidden size")
    p.add_argument("--layers", type=int, default=4, help="encoder blocks")
    p.add_argument("--batch", type=int, default=4, help="images per encoder call")
    p.add_argument("--ttft-size", type=int, default=224, help="image side in pixels for the TTFT runs")
    a = p.parse_args()
    sizes = [32, 64] if a.quick else [64, 224, 448]
    repeats = 2 if a.quick else 5
    width, layers = (64, 1) if a.quick else (a.width, a.layers)
    enc = bench_encoder(sizes, 2 if a.quick else a.batch, width, layers, repeats)
    ttft = bench_ttft(64 if a.quick else a.ttft_size, 3 if a.quick else 5)
    print(markdown_table(["image", "tokens/image", "deltamoe img/s", "deltamoe tok/s", "transformers img/s", "ratio"],
                         [[f"{r['size']}x{r['size']}", r["tokens_per_image"], f"{r['deltamoe_images_per_s']:.1f}",
                           f"{r['deltamoe_tokens_per_s']:.0f}", f"{r['transformers_images_per_s']:.1f}",
                           f"{r['speedup']:.2f}x"] for r in enc]))
    path = write_result(result_name("vision", a.quick), {
        "quick": a.quick, "encoder": {"width": width, "layers": layers, "rows": enc}, "ttft": ttft})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
