import pytest

from deltamoe.tokenizers import ByteTokenizer, Tokenizer


def test_round_trip_and_specials():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    text = "héllo 世界 ✓"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == tok.bos_token_id == 256 and max(ids[1:]) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|bos|>")
    assert (tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (257, 258, 264)
    assert tok.special_tokens["<|end|>"] == 263
    with pytest.raises(ValueError):
        tok.token_bytes(999)
