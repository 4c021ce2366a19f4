"""The vision-encoder cache (`engine/vision_cache.py`): LRU under a byte budget, keyed by image content hash; a
repeated image in a new prompt prefix skips the vision tower, and a prefix-cache hit covering an image never
encodes it at all. Counted by wrapping the model's `encode_images`."""
from __future__ import annotations

import pytest
import torch
from engines import engine_factory
from vl_helpers import draw_image, user_message

from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.vision_cache import VisionEncoderCache
from lmdeploy.pytorch.messages import SamplingParams
from lmdeploy.serve.tokenizer import Tokenizer
from lmdeploy.serve.vision.processor import ImageProcessor


def test_lru_keeps_recent_entries_within_the_byte_budget():
    cache = VisionEncoderCache(max_bytes=3 * 64)  # three entries of 16 float32
    for key in (1, 2, 3):
        cache.put(key, torch.full((16,), float(key)))
    assert cache.get(1) is not None          # 1 becomes the most recent
    cache.put(4, torch.zeros(16))            # evicts 2, the least recently used
    assert cache.get(2) is None and cache.get(3) is not None and cache.get(4) is not None
    cache.put(5, torch.zeros(64))            # larger than the whole budget: not kept, nothing evicted
    assert cache.get(5) is None
    s = cache.stats
    assert (s.entries, s.bytes, s.hits, s.misses) == (3, 3 * 64, 3, 2)
    with pytest.raises(ValueError):
        VisionEncoderCache(-1)


@pytest.fixture(scope='module')
def vl(tiny_model_factory):
    path = tiny_model_factory('qwen3_5_vl')
    tokenizer = Tokenizer(path)
    return path, tokenizer


make_engine = engine_factory(block_size=16, kernel_block_size=8, num_gpu_blocks=64, max_batch_size=4)


def counting_engine(path: str, **overrides) -> tuple[Engine, list[int]]:
    """An engine whose `calls` list gets one entry (the number of images) per vision-tower call."""
    engine = make_engine(path, **overrides)
    calls: list[int] = []
    encode = engine.model.encode_images

    def counting(pixels, grids):
        calls.append(len(grids))
        return encode(pixels, grids)
    engine.model.encode_images = counting
    return engine, calls


def prompt(vl, engine: Engine, *parts):
    path, tokenizer = vl
    processor = ImageProcessor(path, engine.model_config.image_token_id)
    ids = tokenizer.encode(tokenizer.apply_chat_template(user_message(*parts)), add_special_tokens=False)
    return processor.expand(ids, [p for p in parts if not isinstance(p, str)])


def run(engine: Engine, ids, spans) -> list[int]:
    out: list[int] = []
    engine.add_request(ids, SamplingParams(max_new_tokens=2), callback=lambda o: out.extend(o.new_token_ids),
                       mm_spans=spans)
    while engine.has_work:
        engine.step()
        engine.check_integrity()
    return out


def test_a_repeated_image_in_a_new_prompt_hits_the_encoder_cache(vl):
    engine, calls = counting_engine(vl[0])
    image = draw_image(31, (96, 64))
    first = run(engine, *prompt(vl, engine, 'Look at this:', image))
    assert calls == [1] and engine.stats['vision_cache_misses'] == 1
    # A different text before the same image: no prefix hit could cover it, the encoder cache does.
    run(engine, *prompt(vl, engine, 'Now this one, please:', image))
    assert calls == [1]
    stats = engine.stats
    assert (stats['vision_cache_hits'], stats['vision_cache_entries']) == (1, 1)
    assert stats['vision_cache_bytes'] == engine.model.num_image_tokens(prompt(vl, engine, image)[1][0].data.grid_thw) \
        * engine.model_config.hidden_size * 4
    # Cached embeddings give the same tokens as a fresh engine without the cache.
    cold, cold_calls = counting_engine(vl[0], vision_encoder_cache_mb=0)
    assert run(cold, *prompt(vl, cold, 'Look at this:', image)) == first
    assert 'vision_cache_hits' not in cold.stats and cold_calls == [1]
def test_a_prefix_hit_covering_the_image_skips_its_encoding(vl):
    engine, calls = counting_engine(vl[0], enable_prefix_caching=True, prefix_cache_state_budget=16,
                                vision_encoder_cache_mb=0)
    image = draw_image(32, (64, 96))
    ids, spans = prompt(vl, engine, 'Look at this:', image, 'What is it?')
    run(engine, ids, spans)
    assert calls == [1]
    # The same prompt with a new question after the image: the hit covers the image, nothing is encoded.
    more_ids, more_spans = prompt(vl, engine, 'Look at this:', image, 'What colour is it, roughly?')
    assert more_spans[0].start == spans[0].start and more_spans[0].content_hash == spans[0].content_hash
    engine.add_request(more_ids, SamplingParams(max_new_tokens=1), mm_spans=more_spans)
    engine.run_until_idle()
    engine.check_integrity()
    assert calls == [1]
