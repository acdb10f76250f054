import json

import pytest
import torch

from deltamoe.config import load_preset
from deltamoe.errors import ConfigError
from deltamoe.tokenizers import ByteTokenizer
from deltamoe.train.data import build_data
from deltamoe.train.data.text import TextSource, pack_documents, read_documents
from deltamoe.train.data.tokenizer import HFTokenizerFile, data_tokenizer

EOS = 257


def test_pack_documents_exact_rows():
    rows = pack_documents([[1, 2, 3], [4], [5, 6, 7, 8]], seq_len=4, eos=EOS)
    # stream: 1 2 3 E 4 E 5 6 7 8 E -> two full rows, the 3-token tail dropped
    assert rows.tolist() == [[1, 2, 3, EOS], [4, EOS, 5, 6]]


def test_jsonl_and_text_sources(tmp_path):
    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t}) for t in ["ab", "cde", "", "fghij"]) + "\n\n")
    assert read_documents(jl) == ["ab", "cde", "", "fghij"]
    src = TextSource(jl, ByteTokenizer(), seq_len=3, seed=0, eval_fraction=0.25, eval_rows=8, eos=EOS)
    a, b, c, d, e, f, g, h, i, j = b"abcdefghij"
    # a b E | c d e | E E f | g h i | j E  (tail dropped): 4 rows, the last one held out
    assert src.train.tolist() == [[a, b, EOS], [c, d, e], [EOS, EOS, f]]
    assert src.eval.tolist() == [[g, h, i]] and src.eval_rows == 1
    first_epoch = src.rows("train", 0, 3)
    assert sorted(first_epoch.input_ids.tolist()) == sorted(src.train.tolist())
    assert first_epoch.labels.equal(first_epoch.input_ids)  # plain LM: every token is scored
    assert sorted(src.rows("train", 3, 3).input_ids.tolist()) == sorted(src.train.tolist())  # epoch 2
    txt = tmp_path / "plain.txt"
    txt.write_text("hello world")
    assert TextSource(txt, ByteTokenizer(), 4, 0, 0.0, 8, EOS).train.flatten().tolist() == [*b"hello world", EOS]


def test_missing_file_names_it(tmp_path, micro):
    missing = tmp_path / "nope.jsonl"
    cfg = micro(**{"data.path": str(missing)})
    with pytest.raises(ConfigError) as e:
        build_data(cfg, load_preset("tiny"))
    assert str(missing) in str(e.value) and e.value.field == "data.path"


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 has no string \"text\""):
        read_documents(p)


def test_checkpoint_tokenizer_json_is_used(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    got = data_tokenizer(str(tmp_path), load_preset("tiny"))
    assert isinstance(got, HFTokenizerFile) and got.encode("hello world hi") == [1, 2, 0]
    assert isinstance(data_tokenizer(None, load_preset("tiny")), ByteTokenizer)


def test_text_rows_via_build_data(tmp_path, micro):
    p = tmp_path / "corpus.txt"
    p.write_text("abcdefgh" * 40)
    data = build_data(micro(**{"data.path": str(p), "data.seq_len": 16}), load_preset("tiny"))
    rows = data.rows("train", 0, 2)
    assert rows.input_ids.shape == (2, 16) and rows.input_ids.dtype == torch.long
    assert not data.scores_answers and data.eval_rows == 1  # 5 % of 20 rows
