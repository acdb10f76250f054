"""`deltamoe generate --image` and `/image` in `deltamoe chat` (in-process, tiny-vision preset)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from deltamoe.cli import main
from deltamoe.config import load_preset


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "square.png"
    img = Image.new("RGB", (48, 32), "white")
    img.paste((200, 0, 0), (8, 8, 24, 24))
    img.save(path)
    return path


def offline(prompt, picture, **kw):
    from deltamoe.model.load import load_model
    from deltamoe.serve.engine.config import EngineConfig
    from deltamoe.serve.engine.llm_engine import LLMEngine
    from deltamoe.serve.engine.sampling import SamplingParams
    from deltamoe.vision.preprocess import load_image

    engine = LLMEngine(load_model("tiny-vision"), config=EngineConfig(cache_memory="16MiB"))
    image = load_image(picture, load_preset("tiny-vision").vision)
    return engine.generate([prompt], SamplingParams(temperature=0.0, **kw), progress=False, images=[[image]])[0].text


def test_generate_with_image_matches_the_engine(picture, capsys):
    args = ["generate", "tiny-vision", "--image", str(picture), "-p", "what?", "--max-tokens", "4",
            "--temperature", "0", "--ignore-eos", "--cache-memory", "16MiB"]
    assert main(args) == 0
    assert capsys.readouterr().out == offline("what?", picture, max_tokens=4, ignore_eos=True) + "\n"


def test_generate_image_errors_are_exit_2(picture, tmp_path, capsys):
    assert main(["generate", "tiny", "--image", str(picture), "-p", "x"]) == 2
    assert "no vision tower" in capsys.readouterr().err
    assert main(["generate", "tiny-vision", "--image", str(tmp_path), "-p", "x"]) == 2
    assert f"image: {tmp_path} is a directory" in capsys.readouterr().err
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n broken")
    assert main(["generate", "tiny-vision", "--image", str(bad), "-p", "x", "--cache-memory", "16MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"image {bad}" in err and ("corrupt" in err or "not an image" in err)


def test_chat_image_command(picture, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/image {picture}\n/image /no/such.png\nhi\n/exit\n"))
    assert main(["chat", "tiny-vision", "--max-tokens", "3", "--temperature", "0", "--cache-memory", "16MiB"]) in (0, None)
    out = capsys.readouterr().out
    assert "(image 48x32, 6 tokens; sent with your next message)" in out
    assert "cannot read /no/such.png" in out


def test_images_with_speculative_decoding_give_the_plain_tokens(picture, capsys):
    """The speculative runner encodes a step's images before its calls (it crashed with a TypeError,
    then refused them); greedy output is plain decoding's."""
    args = ["generate", "tiny-vision", "--image", str(picture), "-p", "x", "--no-compile", "--cache-memory", "16MiB",
            "--max-tokens", "12", "--temperature", "0"]
    assert main(args) in (0, None)
    plain = capsys.readouterr().out
    assert main([*args, "--speculative", "mtp", "--num-draft-tokens", "2"]) in (0, None)
    speculative = capsys.readouterr().out
    assert plain.strip() and speculative == plain
