"""Qwen3.5 vision-language on the CPU engine against transformers (`Qwen3_5ForConditionalGeneration`): the vision
tower, image embeddings in place of the placeholders, interleaved M-RoPE and the position offset images leave for
the tokens after them (decode, chunked prefill). Images are drawn with PIL and preprocessed by the checkpoint's own
`preprocessor_config.json` through transformers' image processor."""
from __future__ import annotations

import pytest
import torch
from engines import engine_factory
from numeric import assert_close
from vl_helpers import draw_image, encode, load_vl, reference_logits

from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams

transformers = pytest.importorskip('transformers')

ATOL = 2e-4


@pytest.fixture(scope='module')
def vl(tiny_model_factory):
    return load_vl(tiny_model_factory('qwen3_5_vl'))


make_engine = engine_factory(block_size=16, kernel_block_size=8, num_gpu_blocks=64, max_batch_size=4,
                             max_prefill_token_num=512)


def run_collecting(engine: Engine, ids, spans, max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy generation; returns the sequence fed (prompt + tokens) and the logits of every fed token."""
    out_ids: list[int] = []
    seq_id = engine.add_request(ids, SamplingParams(max_new_tokens=max_new_tokens), collect_logits=True,
                                mm_spans=spans, callback=lambda out: out_ids.extend(out.new_token_ids))
    while engine.has_work:
        engine.step()
        engine.check_integrity()
    return list(ids) + out_ids, engine.pop_collected_logits(seq_id)


PROMPTS = {
    'no_image': lambda: ('Describe the weather today in one short sentence.',),
    'one_image': lambda: ('Look:', draw_image(1, (70, 100)), 'What is in the picture?'),
    'two_images': lambda: (draw_image(2, (128, 64)), 'and', draw_image(3, (96, 96)), 'Which one is brighter?'),
}


@pytest.mark.parametrize('name', list(PROMPTS))
def test_teacher_forced_logits_match_transformers_through_decode(vl, name):
    path, model, _, _ = vl
    ids, spans = encode(vl, *PROMPTS[name]())
    assert len(spans) == sum(not isinstance(p, str) for p in PROMPTS[name]())
    engine = make_engine(path)
    fed, logits = run_collecting(engine, ids, spans, max_new_tokens=6)
    # The reference sees the prompt with its images plus the generated text tokens (teacher forcing).
    expected = reference_logits(model, fed, spans, model.config.image_token_id)[:len(fed) - 1]
    assert_close(logits, expected, atol=ATOL, rtol=ATOL, what=f'{name} logits')
    if spans:  # the images leave an offset: the tokens after them sit at positions other than their index
        assert all(span.position_delta < 0 for span in spans)


@pytest.mark.parametrize('chunk', [5, 12, 16])
def test_chunked_prefill_with_images_matches_transformers(vl, chunk):
    path, model, _, _ = vl
    ids, spans = encode(vl, 'Look:', draw_image(4, (64, 64)), 'and', draw_image(5, (100, 70)), 'compare them.')
    engine = make_engine(path, max_prefill_token_num=chunk)
    fed, logits = run_collecting(engine, ids, spans, max_new_tokens=3)
    expected = reference_logits(model, fed, spans, model.config.image_token_id)[:len(fed) - 1]
    assert_close(logits, expected, atol=ATOL, rtol=ATOL, what=f'chunk {chunk} logits')


def test_vision_tower_matches_transformers_image_features(vl):
    path, model, _, processor = vl
    pixels = [processor.preprocess(draw_image(s, size)) for s, size in ((6, (64, 128)), (7, (90, 90)))]
    engine = make_engine(path)
    with torch.no_grad():
        mine = engine.model.encode_images(torch.cat([p.pixel_values for p in pixels]), [p.grid_thw for p in pixels])
        ref = model.model.get_image_features(torch.cat([p.pixel_values for p in pixels]),
                                             torch.tensor([p.grid_thw for p in pixels])).pooler_output
    assert_close(mine, torch.cat(ref), atol=1e-5, rtol=1e-5, what='merged image embeddings')


def test_a_bad_image_span_is_refused_before_any_work(vl, tiny_model_factory):
    path, _, _, _ = vl
    ids, spans = encode(vl, 'Look:', draw_image(8, (64, 64)), 'ok?')
    engine = make_engine(path)
    span = spans[0]
    shifted = (type(span)(span.start - 1, span.end - 1, span.content_hash, span.grid, span.data),)
    with pytest.raises(ValueError, match='image token'):
        engine.add_request(ids, SamplingParams(max_new_tokens=1), mm_spans=shifted)
    wrong_grid = (type(span)(span.start, span.end, span.content_hash, (1, 1, 1), span.data),)
    with pytest.raises(ValueError, match='grid'):
        engine.add_request(ids, SamplingParams(max_new_tokens=1), mm_spans=wrong_grid)
    assert not engine.has_work
    text_only = make_engine(tiny_model_factory('qwen3_5'))
    with pytest.raises(ValueError, match='takes no images'):
        text_only.add_request([1] * len(ids), SamplingParams(max_new_tokens=1), mm_spans=spans)
