"""Chat requests with OpenAI `image_url` parts: data URLs through the real server equal the offline
engine on the same checkpoint; http(s) URLs only with the server's flag, within its limits; every
bad image is a 400 naming the part."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from types import SimpleNamespace

import httpx
import pytest
from PIL import Image

from deltamoe.config import load_preset
from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.api.chat_template import ChatTemplate
from deltamoe.serve.api.images import ImageOptions, extract_images
from deltamoe.serve.api.server import build_app
from deltamoe.serve.api.thread import ServerThread
from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.vision.preprocess import ImageLimits, load_image


def png(color, size=(40, 24)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(text: str, *urls: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def image_host():
    """A local http server with one small and one large image."""
    files = {"/red.png": png("red"), "/big.png": png("blue", (400, 400)) + bytes(5000)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-ckpt")
    save_checkpoint(build_model(load_preset("tiny-vision"), seed=4), folder)
    config = EngineConfig(cache_memory="16MiB", max_model_len=256)
    engine = AsyncLLMEngine.from_pretrained(folder, config)
    template = ChatTemplate.for_model(engine.tokenizer, folder)
    options = ImageOptions(allow_urls=True, fetch_timeout_s=5.0, limits=ImageLimits(max_bytes=4000))
    app = build_app(engine, "v", chat_template=template, image_options=options)
    strict = build_app(engine, "v", chat_template=template)  # the default: data URLs only
    offline = LLMEngine.from_pretrained(folder, EngineConfig(cache_memory="16MiB", max_model_len=256))
    with ServerThread(app) as thread, ServerThread(strict) as strict_thread:
        yield SimpleNamespace(url=thread.url, strict_url=strict_thread.url, template=template, offline=offline,
                              vision=engine.model_config.vision, folder=folder)


def post(url: str, messages: list[dict]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      json={"model": "v", "messages": messages, "max_tokens": 5, "temperature": 0})


def offline_text(server, messages: list[dict], images: list[bytes]) -> str:
    prepared = [load_image(d, server.vision) for d in images]
    marked, _ = extract_images(messages)
    ids = server.template.encode(marked, True, image_tokens=[[264] * p.num_tokens for p in prepared])
    params = SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=server.template.stop_token_ids)
    return server.offline.generate([ids], params, progress=False, images=[prepared])[0].text


def test_data_url_images_match_offline(server):
    red, green = png("red"), png("green", (64, 32))
    messages = chat("what colour?", data_url(red), data_url(green))
    resp = post(server.url, messages)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == offline_text(server, messages, [red, green])
    # <|user|>, 6 + 8 image tokens (40x24 -> 2x3 cells of 16 px, 64x32 -> 2x4), the text, <|end|>, <|assistant|>
    assert resp.json()["usage"]["prompt_tokens"] == 1 + 6 + 8 + len("what colour?") + 1 + 1


def test_several_choices_each_see_the_images(server):
    """n > 1 / best_of with images: choices 2.. fork choice 1's prefill (image rows included); each
    choice equals the same request with n = 1 and that choice's seed."""
    red = png("red")
    messages = chat("what colour?", data_url(red))
    body = {"model": "v", "messages": messages, "max_tokens": 5, "temperature": 1.0, "seed": 3, "logprobs": True}
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={**body, "n": 3})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    for i, choice in enumerate(choices):
        one = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={**body, "seed": 3 + i}).json()
        assert one["choices"][0]["message"]["content"] == choice["message"]["content"]
        lps = [[t["logprob"] for t in c["logprobs"]["content"]] for c in (one["choices"][0], choice)]
        assert lps[0] == pytest.approx(lps[1], abs=1e-4)
    # The image is seen: the same text without it gives the first token another logprob.
    plain = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={**body, "messages": chat("what colour?")}).json()["choices"][0]["logprobs"]["content"]
    with_image = choices[0]["logprobs"]["content"]
    assert plain[0]["logprob"] != pytest.approx(with_image[0]["logprob"], abs=1e-6)
    best = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={**body, "n": 1, "best_of": 2})
    assert best.status_code == 200 and len(best.json()["choices"]) == 1
    # One running sequence at a time: choice 2 cannot fork, so it prefills the prompt, images and all, itself.
    engine = AsyncLLMEngine.from_pretrained(server.folder, EngineConfig(cache_memory="16MiB", max_model_len=256,
                                                                        max_num_seqs=1))
    with ServerThread(build_app(engine, "v", chat_template=server.template)) as one_at_a_time:
        alone = httpx.post(f"{one_at_a_time.url}/v1/chat/completions", timeout=60, json={**body, "n": 2}).json()
    for got, want in zip(alone["choices"], choices[:2], strict=True):
        assert got["message"]["content"] == want["message"]["content"]
        assert [t["logprob"] for t in got["logprobs"]["content"]] == pytest.approx(
            [t["logprob"] for t in want["logprobs"]["content"]], abs=1e-4)


def test_image_urls_need_the_flag_and_respect_limits(server, image_host):
    messages = chat("hi", f"{image_host}/red.png")
    refused = post(server.strict_url, messages)
    assert refused.status_code == 400 and "--allow-image-urls" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "messages[0].content[0].image_url"
    fetched = post(server.url, messages)
    assert fetched.status_code == 200
    assert fetched.json()["choices"][0]["message"]["content"] == offline_text(server, messages, [png("red")])
    too_big = post(server.url, chat("hi", f"{image_host}/big.png"))
    assert too_big.status_code == 400 and "over the limit of 4000 bytes" in too_big.json()["error"]["message"]
    missing = post(server.url, chat("hi", f"{image_host}/nope.png"))
    assert missing.status_code == 400 and "HTTP 404" in missing.json()["error"]["message"]


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,%%%", "not valid base64"),
    (data_url(b"GIF89a-nonsense"), "corrupt or truncated|not an image"),
    (data_url(png("red")[:50]), "corrupt or truncated"),
    ("ftp://example.com/x.png", "expected a data: URL"),
])
def test_bad_images_are_400_naming_the_part(server, url, words):
    resp = post(server.url, [{"role": "system", "content": "s"}, *chat("x", url)])
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "messages[1].content[0].image_url"
    assert __import__("re").search(words, err["message"]), err["message"]


def test_data_urls_are_read_as_browsers_read_them(server):
    """`"data:image/png;base64,$(base64 img.png)"` wraps the payload at 76 columns, and padding is
    optional in forgiving-base64; the scheme and the `;base64` tag are case-insensitive."""
    payload = base64.b64encode(png("red")).decode()
    expected = post(server.url, chat("x", data_url(png("red"))))
    assert expected.status_code == 200, expected.text
    wrapped = "\n".join(payload[i:i + 76] for i in range(0, len(payload), 76))
    for url in (f"data:image/png;base64,{wrapped}", f"data:image/png;base64,{payload.rstrip('=')}",
                f"DATA:image/png;BASE64,{payload}"):
        resp = post(server.url, chat("x", url))
        assert resp.status_code == 200, (url[:40], resp.text)
        assert resp.json()["choices"][0]["message"] == expected.json()["choices"][0]["message"]
    from deltamoe.serve.api.images import forgiving_base64
    assert forgiving_base64("aGk") == forgiving_base64("aG\r\nk=") == b"hi"
    with pytest.raises(ValueError):  # 1 past a multiple of 4 is no base64 at all
        forgiving_base64("aGkhA")
    bad = post(server.url, chat("x", "data:image/png;base64,aGkhA"))
    assert bad.status_code == 400 and "not valid base64" in bad.json()["error"]["message"]


def test_tokenize_counts_image_placeholders(server, image_host):
    """/tokenize renders image parts as chat does (each image's placeholder tokens), so its count
    is the prompt_tokens a chat request with the same messages reports; the strict server's image
    rules hold there too."""
    image = png("green", (64, 32))
    messages = chat("what is it?", data_url(image))
    r = httpx.post(f"{server.url}/tokenize", timeout=60, json={"model": "v", "messages": messages})
    assert r.status_code == 200, r.text
    prepared = load_image(image, server.vision)
    marked, _ = extract_images(messages)
    expected = server.template.encode(marked, True, image_tokens=[[264] * prepared.num_tokens])
    assert r.json()["tokens"] == expected and r.json()["count"] == len(expected)
    assert expected.count(264) == prepared.num_tokens > 0
    usage = post(server.url, messages).json()["usage"]
    assert usage["prompt_tokens"] == len(expected)
    refused = httpx.post(f"{server.strict_url}/tokenize", timeout=60,
                         json={"model": "v", "messages": chat("x", f"{image_host}/red.png")})
    assert refused.status_code == 400 and "image_url" in refused.json()["error"]["message"]


def test_images_per_request_are_bounded_by_the_servers_option():
    import asyncio

    from deltamoe.errors import RequestError
    from deltamoe.serve.api.images import ImageRef, load_images
    config = load_preset("tiny-vision")
    refs = [ImageRef(data_url(png("red")), f"messages[0].content[{i}].image_url") for i in range(3)]
    assert len(asyncio.run(load_images(refs, config, ImageOptions(max_images=3)))) == 3
    with pytest.raises(RequestError, match=r"3 images, over the limit of 2 per request \(the server's "
                                           r"--image-max-count\)") as e:
        asyncio.run(load_images(refs, config, ImageOptions(max_images=2)))
    assert e.value.field == "messages[0].content[2].image_url"
