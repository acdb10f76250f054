"""The trainer and the engine in separate processes: `deltamoe serve --weight-updates --ep 2` in a
subprocess, the trainer here pushes its weights over HTTP + gloo, and the server (both of its ranks)
then answers like an engine loaded from the trainer's checkpoint."""

from __future__ import annotations

import httpx
import pytest

from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.train.rl.http_sync import HTTPWeightSync
from deltamoe.train.rl.weight_push import policy_tensors

KEY = "sk-rl"


@pytest.mark.slow
def test_push_to_a_separate_server_process(tmp_path, micro_model_config, serve_process):
    config = micro_model_config.replace(max_position_embeddings=128)
    save_checkpoint(build_model(config, seed=2), tmp_path / "old")
    trainer = build_model(config, seed=9)
    save_checkpoint(trainer, tmp_path / "new")
    with serve_process([str(tmp_path / "old"), "--ep", "2", "--threads", "1", "--cache-memory", "16MiB",
                        "--log-level", "warning", "--weight-updates", "--api-key", KEY], up_within_s=180) as (_, url):
        sync = HTTPWeightSync(url, KEY, bucket_bytes=16 * 1024)
        stats = sync.push(policy_tensors(trainer))
        sync.close()
        assert stats["version"] == 1
        prompt = [256, 51, 43, 52, 61]
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"model": str(tmp_path / "old"), "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        want, old = (LLMEngine.from_pretrained(tmp_path / name, EngineConfig(cache_memory="16MiB")).generate(
            [prompt], SamplingParams(max_tokens=6, temperature=0), progress=False)[0].text for name in ("new", "old"))
        assert want != old and r.json()["choices"][0]["text"] == want
