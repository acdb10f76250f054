"""Real evaluation and load clients against `deltamoe serve` (slow: subprocess server, real harnesses).

- lm-eval's `local-completions` model runs a local multiple-choice task (loglikelihood: `echo`
  with prompt logprobs) and a generate-until task; every loglikelihood, every generation and both
  scores equal what `model(ids).logits` gives for the same token ids.
- guidellm at a fixed concurrency completes with zero errors.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
MC = [{"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
      {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
      {"question": "Water is", "choices": ["wet", "dry", "square", "tall"], "answer": 0}]
GEN = [{"question": "Say hello:", "answer": "hello"}, {"question": "Count: one two", "answer": "three"}]


def hf_checkpoint(folder: Path, helpers):
    """A tiny random model with an HF byte-level BPE tokenizer that lm-eval and guidellm can load too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [d["question"] + " " + " ".join(d.get("choices", [d["answer"]])) for d in MC + GEN] * 10
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))
    model = build_model(helpers.k31_tiny(vocab_size=384), seed=6).eval()
    save_checkpoint(model, folder)
    return model


@pytest.fixture(scope="module")
def served(tmp_path_factory, helpers):
    folder = tmp_path_factory.mktemp("hfckpt")
    model = hf_checkpoint(folder, helpers)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "deltamoe", "serve", str(folder), "--port", str(port),
                             "--served-model-name", "tiny", "--max-model-len", "256", "--threads", "1",
                             "--log-level", "warning"], cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "deltamoe serve did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        yield url, folder, model
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def write_tasks(folder: Path) -> None:
    for name, rows in (("mc", MC), ("gen", GEN)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {{path}}\ntest_split: test\n"
    (folder / "dm_mc.yaml").write_text(
        "task: dm_mc\n" + common.format(path=folder / "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n")
    (folder / "dm_gen.yaml").write_text(
        "task: dm_gen\n" + common.format(path=folder / "gen.jsonl") + "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\n  temperature: 0\n'
        "metric_list:\n  - metric: exact_match\n")


@torch.no_grad()
def loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return sum(logp[len(context) + i - 1, t].item() for i, t in enumerate(continuation))


@torch.no_grad()
def greedy_until(model, tokenizer, ids: list[int], max_tokens: int, until: str) -> str:
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            break
        out.append(token)
        if until in tokenizer.decode(out):
            break
    return tokenizer.decode(out).split(until)[0]


@pytest.mark.parametrize("batch_size", [1, 4])  # 4: lm-eval sends a list of prompts a request
def test_lm_eval_scores_equal_the_model(served, tmp_path, batch_size):
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    url, folder, model = served
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    write_tasks(tmp_path)
    lm = LocalCompletionsAPI(model="tiny", base_url=f"{url}/v1/completions", tokenizer=str(folder),
                             tokenizer_backend="huggingface", num_concurrent=1, max_retries=1, max_length=256,
                             batch_size=batch_size)
    res = simple_evaluate(model=lm, tasks=["dm_mc", "dm_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
                          log_samples=True)
    # Multiple choice: each choice's loglikelihood as served, and the accuracy they give.
    correct = []
    for sample in sorted(res["samples"]["dm_mc"], key=lambda s: s["doc_id"]):
        doc = MC[sample["doc_id"]]
        direct = [loglikelihood(model, *lm._encode_pair(doc["question"], " " + c)) for c in doc["choices"]]
        served_lls = [float(r[0]) for r in sample["filtered_resps"]]
        assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(served_lls, direct)), (served_lls, direct)
        correct.append(max(range(len(direct)), key=direct.__getitem__) == doc["answer"])
    assert math.isclose(res["results"]["dm_mc"]["acc,none"], sum(correct) / len(correct))
    # Generate until "\n": the served text is the model's greedy continuation.
    matches = []
    for sample in sorted(res["samples"]["dm_gen"], key=lambda s: s["doc_id"]):
        doc = GEN[sample["doc_id"]]
        want = greedy_until(model, lm.tokenizer, lm.tok_encode(doc["question"]), 6, "\n")
        got = sample["filtered_resps"][0]
        assert got == want, (got, want)
        matches.append(float(got.strip() == doc["answer"]))
    assert math.isclose(res["results"]["dm_gen"]["exact_match,none"], sum(matches) / len(matches))


def test_guidellm_fixed_concurrency_has_no_errors(served, tmp_path):
    pytest.importorskip("guidellm")
    url, folder, _ = served
    out = tmp_path / "guidellm.json"
    cmd = [sys.executable, "-m", "guidellm", "run", "--backend", f"kind=openai_http,target={url},model=tiny",
           "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=16",
           "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
           "--tokenizer", f"kind=huggingface_auto,model={folder}", "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    requests = report["benchmarks"][0]["requests"]
    assert len(requests["successful"]) == 16 and not requests["errored"] and not requests["incomplete"]
