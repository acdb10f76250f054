"""Tokenizers: a tiny HF tokenizer.json, a tiny tiktoken ranks file, the factory, and streaming with each."""

from __future__ import annotations

import base64
import json

import pytest

from deltamoe.errors import ConfigError
from deltamoe.serve.engine.detokenizer import IncrementalDetokenizer
from deltamoe.tokenizers.byte import ByteTokenizer
from deltamoe.tokenizers.hf import HFTokenizer
from deltamoe.tokenizers.load import load_tokenizer
from deltamoe.tokenizers.tiktoken_kimi import TiktokenKimiTokenizer

TEXT = "héllo wörld, 你好 hello world! 😀"


def stream(tok, ids) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces, "".join(pieces)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "héllo wörld", "你好 world"] * 20, trainer)
    folder = tmp_path_factory.mktemp("hf")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "bos_token": {"content": "<|endoftext|>"},
        "chat_template": "{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}"}))
    return folder


@pytest.fixture(scope="module")
def tiktoken_folder(tmp_path_factory):
    """256 single bytes + two merges ('he', 'hel'); specials named by tokenizer_config like Kimi's."""
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"hel"]
    folder = tmp_path_factory.mktemp("tiktoken")
    (folder / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": "[EOS]",
        "added_tokens_decoder": {"258": {"content": "[BOS]"}, "259": {"content": "[EOS]"},
                                 "260": {"content": "<|im_end|>"}, "261": {"content": "<|im_user|>"}}}))
    return folder


def test_hf_tokenizer_json(hf_folder):
    tok = load_tokenizer(hf_folder, vocab_size=1000)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == TEXT
    assert len(ids) < len(TEXT.encode())  # merges happened
    assert tok.eos_token_id == tok.bos_token_id == tok.special_tokens["<|endoftext|>"]
    pieces, text = stream(tok, ids)
    assert text == TEXT and "\ufffd" not in "".join(pieces)
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_token_id


def test_tiktoken_kimi_file(tiktoken_folder):
    tok = load_tokenizer(tiktoken_folder, vocab_size=600)
    assert isinstance(tok, TiktokenKimiTokenizer)
    assert tok.vocab_size == 258 + 256
    assert tok.encode("hello") == [257, ord("l"), ord("o")]  # 'hel' merged
    assert tok.bos_token_id == 258 and tok.eos_token_id == 259
    assert tok.special_tokens["<|im_end|>"] == 260 and tok.special_tokens["<|reserved_token_5|>"] == 263
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and stream(tok, ids)[1] == TEXT
    assert tok.encode("[EOS]") != [259]  # special names typed in text stay text
    assert tok.decode([257, 259]) == "hel" and tok.decode([257, 259], skip_special_tokens=False) == "hel[EOS]"


def test_factory_defaults_and_errors(tmp_path, tiktoken_folder):
    assert isinstance(load_tokenizer(None, 264), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path, 300), ByteTokenizer)  # a checkpoint without tokenizer files
    with pytest.raises(ConfigError) as e:
        load_tokenizer(tiktoken_folder, vocab_size=300)  # tokenizer bigger than the model
    assert e.value.field == "tokenizer"
    with pytest.raises(ConfigError):
        load_tokenizer(None, 100)
    with pytest.raises(ConfigError):
        load_tokenizer(tmp_path / "missing", 300)


def test_byte_stream_never_splits_a_character():
    tok = ByteTokenizer()
    pieces, text = stream(tok, tok.encode(TEXT))
    assert text == TEXT and all("\ufffd" not in p for p in pieces)
