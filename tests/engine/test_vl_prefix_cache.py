"""Prefix caching with images (tiny Qwen3.5-VL, CPU, exact `cached_tokens`): image identity in the keys, no
checkpoint or chunk end inside an image, a checkpoint at the end of the prompt's last image carrying the position
offset, and warm runs equal to cold ones (and to transformers) after hits at, just after and well after an image."""
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


make_engine = engine_factory(block_size=16, kernel_block_size=8, num_gpu_blocks=96, max_batch_size=4,
                             enable_prefix_caching=True, prefix_cache_state_budget=24, max_prefill_token_num=512)


def run(engine: Engine, ids, spans, max_new_tokens: int = 1) -> tuple[int, torch.Tensor]:
    """Serve one request to the end; returns its cached prompt tokens and the logits of every fed token."""
    cached: list[int] = []
    seq_id = engine.add_request(ids, SamplingParams(max_new_tokens=max_new_tokens), collect_logits=True,
                                mm_spans=spans, callback=lambda out: cached.append(out.num_cached))
    while engine.has_work:
        engine.step()
        engine.check_integrity()
    return cached[-1], engine.pop_collected_logits(seq_id)


def prefix(ids, spans, n):
    """The first `n` tokens of a prompt with the spans they hold (none may be cut)."""
    assert all(s.end <= n or s.start >= n for s in spans)
    return ids[:n], tuple(s for s in spans if s.end <= n)


def checkpoint_steps(engine: Engine) -> list[int]:
    return sorted(ck.step for ck in engine.scheduler.trie.checkpoints.live())


def test_no_checkpoint_and_no_chunk_end_inside_an_image(vl):
    path = vl[0]
    ids, spans = encode(vl, 'Here:', draw_image(41, (96, 96)), 'and', draw_image(42, (64, 64)), 'compare.')
    engine = make_engine(path, max_prefill_token_num=7)
    ends: list[int] = []
    make = engine.inputs_maker.make

    def recording(sched):
        ends.extend(seq.num_computed + n for seq, n in zip(sched.seqs, sched.num_new_tokens))
        return make(sched)
    engine.inputs_maker.make = recording
    run(engine, ids, spans)
    inside = lambda step: any(s.start < step < s.end for s in spans)  # noqa: E731
    assert ends and not any(inside(e) for e in ends)
    steps = checkpoint_steps(engine)
    assert not any(inside(s) for s in steps)
    assert spans[-1].end in steps and len(ids) in steps   # the last image's end and the prompt's end
    assert spans[0].start in ends and spans[0].end in ends  # a 7-token budget stops before the 16-token image


def test_the_last_image_end_checkpoint_serves_a_new_question_exactly(vl):
    path, model, _, _ = vl
    image = draw_image(43, (128, 64))
    engine = make_engine(path)
    ids, spans = encode(vl, 'Look at this picture:', image, 'What is in it?')
    assert run(engine, ids, spans)[0] == 0
    # Without chunking the prompt still ends a piece at the image end, whose checkpoint records the offset there.
    cks = {ck.step: ck for ck in engine.scheduler.trie.checkpoints.live()}
    end = spans[-1].end
    assert cks[end].position_offset == spans[-1].position_delta < 0
    assert cks[len(ids)].position_offset == spans[-1].position_delta
    new_ids, new_spans = encode(vl, 'Look at this picture:', image, 'Which colours do you see there?')
    cached, warm = run(engine, new_ids, new_spans, max_new_tokens=3)
    assert cached == end
    cold = run(make_engine(path, enable_prefix_caching=False), new_ids, new_spans, max_new_tokens=3)[1]
    # A hit feeds only the tokens after it: its logits are the cold run's from there on.
    assert_close(warm, cold[cached:], atol=ATOL, rtol=ATOL, what='warm vs cold after the image')


@pytest.mark.parametrize('after', [1, 5], ids=['one_token_after', 'mid_text_after'])
def test_warm_equals_cold_and_transformers_after_a_hit_past_the_image(vl, after):
    path, model, _, _ = vl
    image = draw_image(44, (96, 64))
    ids, spans = encode(vl, 'Picture:', image, 'Describe the shapes and their colours in detail please.')
    engine = make_engine(path)
    cut = spans[-1].end + after
    run(engine, *prefix(ids, spans, cut))   # its prompt-end checkpoint sits `after` tokens past the image
    cached, warm = run(engine, ids, spans, max_new_tokens=4)
    assert cached == cut
    cold = run(make_engine(path, enable_prefix_caching=False), ids, spans, max_new_tokens=4)[1]
    assert_close(warm, cold[cut:], atol=ATOL, rtol=ATOL, what=f'warm vs cold, hit {after} after the image')
    # The warm logits are those of the tokens fed after the hit: compare them with transformers too.
    expected = reference_logits(model, ids, spans, model.config.image_token_id)
    assert_close(warm[:len(ids) - cut], expected[cut:], atol=ATOL, rtol=ATOL, what='warm vs transformers')


def test_two_images_with_the_same_tokens_never_share_a_hit(vl):
    path = vl[0]
    first, second = draw_image(45, (96, 96)), draw_image(46, (96, 96))  # same size: identical token ids
    engine = make_engine(path)
    ids, spans = encode(vl, 'Look:', first, 'What is it?')
    run(engine, ids, spans)
    other_ids, other_spans = encode(vl, 'Look:', second, 'What is it?')
    assert other_ids == ids and other_spans[0].content_hash != spans[0].content_hash
    cached, warm = run(engine, other_ids, other_spans, max_new_tokens=2)
    assert cached == 0
    cold = run(make_engine(path, enable_prefix_caching=False), other_ids, other_spans, max_new_tokens=2)[1]
    assert_close(warm, cold, atol=ATOL, rtol=ATOL, what='other image')
    # The first image again is a full hit (its prompt-end checkpoint with kept logits).
    assert run(engine, ids, spans)[0] == len(ids)
    stats = engine.stats
    assert stats['miss_reasons'].get('novel', 0) >= 2 and stats['hit_tokens'] == len(ids)
