"""Image input end to end: loading (PIL, data URLs, allow-listed files, http from a loopback server), the pipeline's
prompt forms, the OpenAI server's `image_url` parts (official client), and bad images failing only their request.

The reference for what reaches the model is transformers: its image processor on the checkpoint's
`preprocessor_config.json` and `Qwen3_5ForConditionalGeneration.generate` on the expanded prompt."""
from __future__ import annotations

import base64
import contextlib
import http.server
import io
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from live_server import live_server
from prometheus_client.parser import text_string_to_metric_families
from vl_helpers import draw_image

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app
from lmdeploy.serve.pipeline import Pipeline
from lmdeploy.serve.vision.images import ImageLoadConfig, load_image

transformers = pytest.importorskip('transformers')
MODEL = 'tiny-vl'


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format='PNG')
    return buf.getvalue()


def data_url(image) -> str:
    return 'data:image/png;base64,' + base64.b64encode(png_bytes(image)).decode()


def engine_config(**overrides) -> PytorchEngineConfig:
    return PytorchEngineConfig(device_type='cpu', block_size=16, max_batch_size=4, num_gpu_blocks=256, **overrides)


@contextlib.contextmanager
def image_server(files: dict[str, tuple[int, str, bytes]]) -> Iterator[str]:
    """A loopback HTTP server answering `path -> (status, content type, body)`; yields its base URL."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            status, kind, body = files.get(self.path, (404, 'text/plain', b'not found'))
            self.send_response(status)
            self.send_header('Content-Type', kind)
            self.send_header('Content-Length', str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f'http://127.0.0.1:{server.server_address[1]}'
    finally:
        server.shutdown()
        server.server_close()


# ---- loading -------------------------------------------------------------------------------------------------------
def test_images_load_from_data_urls_allowed_files_and_http(tmp_path):
    image = draw_image(21, (40, 30))
    expected = np.asarray(image).tolist()
    assert np.asarray(load_image(data_url(image), ImageLoadConfig())).tolist() == expected
    (tmp_path / 'ok').mkdir()
    path = tmp_path / 'ok' / 'a.png'
    path.write_bytes(png_bytes(image))
    allowed = ImageLoadConfig(allowed_local_media_path=str(tmp_path / 'ok'))
    assert np.asarray(load_image(str(path), allowed)).tolist() == expected
    assert np.asarray(load_image(f'file://{path}', allowed)).tolist() == expected
    with image_server({'/a.png': (200, 'image/png', png_bytes(image))}) as url:
        assert np.asarray(load_image(f'{url}/a.png', ImageLoadConfig())).tolist() == expected


@pytest.mark.parametrize('case,match', [
    ('file_without_allow_list', 'not allowed'),
    ('file_outside_allowed_folder', 'outside the allowed folder'),
    ('malformed_base64', 'invalid base64'),
    ('not_an_image', 'not a readable image'),
    ('too_many_bytes', 'larger than 64 bytes'),
    ('too_many_pixels', 'pixels; the limit'),
    ('video_data_url', 'video input is not supported'),
    ('http_404', 'HTTP 404'),
    ('http_unreachable', 'fetching image'),
    ('http_too_large', 'larger than'),
])
def test_bad_images_raise_a_value_error_naming_the_problem(tmp_path, case, match):
    image = draw_image(22, (40, 30))
    (tmp_path / 'ok').mkdir()
    secret = tmp_path / 'secret.png'
    secret.write_bytes(png_bytes(image))
    allowed = ImageLoadConfig(allowed_local_media_path=str(tmp_path / 'ok'))
    big = png_bytes(draw_image(23, (200, 200)))
    with image_server({'/big.png': (200, 'image/png', big)}) as url:
        source, config = {
            'file_without_allow_list': (str(secret), ImageLoadConfig()),
            'file_outside_allowed_folder': (str(tmp_path / 'ok' / '..' / 'secret.png'), allowed),
            'malformed_base64': ('data:image/png;base64,@@@@', ImageLoadConfig()),
            'not_an_image': ('data:image/png;base64,' + base64.b64encode(b'hello').decode(), ImageLoadConfig()),
            'too_many_bytes': (data_url(image), ImageLoadConfig(max_image_bytes=64)),
            'too_many_pixels': (data_url(image), ImageLoadConfig(max_image_pixels=100)),
            'video_data_url': ('data:video/mp4;base64,AAAA', ImageLoadConfig()),
            'http_404': (f'{url}/missing.png', ImageLoadConfig()),
            'http_unreachable': ('http://127.0.0.1:9/x.png', ImageLoadConfig(fetch_timeout_s=2)),
            'http_too_large': (f'{url}/big.png', ImageLoadConfig(max_image_bytes=len(big) - 1)),
        }[case]
        with pytest.raises(ValueError, match=match):
            load_image(source, config)


# ---- pipeline ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def vl_path(tiny_model_factory):
    return tiny_model_factory('qwen3_5_vl')


@pytest.fixture(scope='module')
def vl_pipe(vl_path, tmp_path_factory):
    media = tmp_path_factory.mktemp('media')
    pipe = Pipeline(vl_path, engine_config(enable_prefix_caching=True), allowed_local_media_path=str(media))
    yield pipe, media
    pipe.close()


def reference_generate(path: str, text: str, images: list, max_new_tokens: int) -> list[int]:
    """transformers end to end: the chat template, its image processor, placeholder expansion, greedy generate."""
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    content = [{'type': 'image'} for _ in images] + [{'type': 'text', 'text': text}]
    ids = tokenizer.apply_chat_template([{'role': 'user', 'content': content}], add_generation_prompt=True,
                                        tokenize=False)
    ids = tokenizer.encode(ids, add_special_tokens=False)
    out = processor(images=images, return_tensors='pt')
    counts = iter((out['image_grid_thw'].prod(-1) // processor.merge_size ** 2).tolist())
    pad = model.config.image_token_id
    expanded = [t for tok in ids for t in ([pad] * next(counts) if tok == pad else [tok])]
    input_ids = torch.tensor([expanded])
    with torch.no_grad():
        gen = model.generate(input_ids=input_ids, pixel_values=out['pixel_values'],
                             image_grid_thw=out['image_grid_thw'], mm_token_type_ids=(input_ids == pad).int(),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return gen[0, len(expanded):].tolist()


def test_pipeline_image_prompt_forms_give_transformers_greedy_tokens(vl_pipe, vl_path):
    pipe, media = vl_pipe
    images = [draw_image(24, (96, 64)), draw_image(25, (64, 64))]
    (media / 'b.png').write_bytes(png_bytes(images[1]))
    gen = GenerationConfig(max_new_tokens=5, ignore_eos=True)
    expected = reference_generate(vl_path, 'Compare them.', images, 5)
    as_tuple = pipe(('Compare them.', images), gen)
    as_parts = pipe([{'role': 'user', 'content': [
        {'type': 'image_url', 'image_url': {'url': data_url(images[0])}},
        {'type': 'image_url', 'image_url': {'url': f'file://{media / "b.png"}'}},
        {'type': 'text', 'text': 'Compare them.'}]}], gen)
    assert as_tuple.token_ids == expected
    assert as_parts.token_ids == expected
    assert as_parts.input_token_len == as_tuple.input_token_len
    pipe.engine.check_integrity()


def test_a_bad_image_fails_its_request_only(vl_pipe):
    pipe, _ = vl_pipe
    good = ('Describe it.', draw_image(26, (64, 96)))
    bad = [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,xx'}},
                                        {'type': 'text', 'text': 'Describe it.'}]}]
    video = [{'role': 'user', 'content': [{'type': 'video_url', 'video_url': {'url': 'http://x/v.mp4'}}]}]
    with pytest.raises(ValueError, match='invalid base64'):
        pipe(bad)
    with pytest.raises(ValueError, match='video input is not supported'):
        pipe(video)
    out = pipe(good, GenerationConfig(max_new_tokens=3, ignore_eos=True))
    assert out.generate_token_len == 3
    pipe.engine.check_integrity()


def test_a_text_only_model_refuses_images(tiny_model_factory):
    with Pipeline(tiny_model_factory('qwen3_5'), engine_config()) as pipe:
        with pytest.raises(ValueError, match='takes no images'):
            pipe(('Describe it.', draw_image(27, (64, 64))))


# ---- OpenAI server -------------------------------------------------------------------------------------------------
def test_openai_client_sends_a_data_url_image_and_turn_two_hits_the_cache(vl_path):
    engine = AsyncEngine(vl_path, engine_config(enable_prefix_caching=True), model_name=MODEL)
    try:
        with live_server(create_app(engine, None, MODEL)) as server:
            client = server.client()
            image = draw_image(28, (128, 96))
            history = [{'role': 'user', 'content': [
                {'type': 'text', 'text': 'What is in this picture?'},
                {'type': 'image_url', 'image_url': {'url': data_url(image)}}]}]
            first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0,
                                                   extra_body={'ignore_eos': True})
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            history += [{'role': 'assistant', 'content': first.choices[0].message.content},
                        {'role': 'user', 'content': 'And the colours?'}]
            second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0,
                                                    extra_body={'ignore_eos': True})
            # Turn one's prompt (image included) is a prefix of turn two's and was checkpointed at its end.
            cached = second.usage.prompt_tokens_details.cached_tokens
            assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
            bad = [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,'
                                                                                     + 'A' * 8}}]}]
            with pytest.raises(Exception) as err:
                client.chat.completions.create(model=MODEL, messages=bad, max_tokens=2)
            assert getattr(err.value, 'status_code', None) == 400, err.value
            video = [{'role': 'user', 'content': [{'type': 'video_url', 'video_url': {'url': 'http://x/v.mp4'}}]}]
            with pytest.raises(Exception) as err:
                client.chat.completions.create(model=MODEL, messages=video, max_tokens=2)
            assert getattr(err.value, 'status_code', None) == 400 and 'video' in str(err.value)
            again = client.chat.completions.create(model=MODEL, messages=history[:1], max_tokens=6, temperature=0,
                                                   extra_body={'ignore_eos': True})
            assert again.choices[0].message.content == first.choices[0].message.content
            # The same image after a different text: no prefix hit covers it, the encoder cache does.
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{'role': 'user', 'content': [
                {'type': 'text', 'text': 'Another question first.'},
                {'type': 'image_url', 'image_url': {'url': data_url(image)}}]}])
            metrics = {(s.name, tuple(s.labels.items())): s.value for family in
                       text_string_to_metric_families(httpx.get(f'{server.url}/metrics').text) for s in family.samples}
            # The tower ran once for this image; every later use came from a cache.
            assert metrics[('lmdeploy:vision_cache_misses_total', ())] == 1
            assert metrics[('lmdeploy:vision_cache_hits_total', ())] >= 1
            assert metrics[('lmdeploy:vision_cache_entries', ())] == 1
        engine.engine.check_integrity()
    finally:
        engine.close()
