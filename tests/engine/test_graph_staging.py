"""`StaticInputs.stage` (CPU): one host-side write and copy fills a graph key's static buffers exactly as the
device-side fill does (against `fill_decode` / `fill_prefill` of a second set of buffers), across mirrors left
stale by larger batches; the staged inputs and payloads come back with every value; payloads that do not fit are
refused with nothing written; `CUDAGraphRunner.stage` stages only what a graph runs; `ModelAgent._upload_plain`
stages or uploads every payload; on the GPU, staged forwards equal the upload and fill."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from lmdeploy.pytorch.engine.cache_inputs import CacheCheckpointInputs
from lmdeploy.pytorch.engine.static_inputs import GraphKey, StaticInputs
from lmdeploy.pytorch.kernels.cuda.gated_delta_rule import max_graph_chunks
from lmdeploy.pytorch.model_inputs import ModelInputs, SamplingInputs

CPU = torch.device('cpu')
MAX_TOKENS, MAX_SEQS, MAX_PAGES, KBS = 512, 10, 12, 64


def _buffers(lora: bool, extra_bytes: int = 4096) -> StaticInputs:
    return StaticInputs(MAX_TOKENS, MAX_SEQS, MAX_PAGES, CPU, has_lora=lora,
                        max_chunks=max_graph_chunks(MAX_TOKENS, MAX_SEQS), kernel_block_size=KBS,
                        extra_bytes=extra_bytes)


def _batch(rng: random.Random, lens: list[int], decode: bool, lora: bool) -> ModelInputs:
    """Random values in every field (so a row written from the wrong place shows), host lengths consistent."""
    total, b = sum(lens), len(lens)
    kv = [n + rng.randrange(0, 200) for n in lens]
    width = rng.randrange(1, MAX_PAGES + 1)

    def ints(n, lo=0, hi=10**6):
        return torch.tensor([rng.randrange(lo, hi) for _ in range(n)], dtype=torch.int64)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return ModelInputs(
        input_ids=ints(total), position_ids=ints(total), q_lens=torch.tensor(lens), kv_lens=torch.tensor(kv),
        cu_seqlens_q=torch.tensor(cu), block_tables=ints(b * width, 1).view(b, width), slot_mapping=ints(total),
        logits_indices=torch.tensor(cu[1:]) - 1, state_ids=ints(b, 1, 64),
        is_fresh=torch.tensor([rng.random() < 0.5 for _ in lens]), q_lens_list=lens, kv_lens_list=kv,
        max_seqlen_q=1 if decode else max(lens), max_seqlen_k=max(kv), lora_ids=ints(b, 0, 4) if lora else None)


def _key(inputs: ModelInputs, decode: bool) -> GraphKey:
    t, b = inputs.input_ids.numel(), inputs.batch_size
    if decode:
        size = next(s for s in (1, 2, 4, 8, MAX_SEQS) if s >= b)
        return GraphKey(size, size, True)
    seqs = next(s for s in (4, 8, MAX_SEQS) if s >= b + 2)
    return GraphKey(next(n for n in (16, 32, 64, 128, 256, 512) if n >= t and n > seqs), seqs, False)


def _cases(seed: int) -> list[tuple[list[int], bool]]:
    rng = random.Random(seed)
    cases = [([MAX_TOKENS // 8 - 1] * 8, False), ([1] * MAX_SEQS, True)]   # large batches first: stale rows
    for _ in range(12):
        if rng.random() < 0.4:
            cases.append(([1] * rng.randrange(1, MAX_SEQS + 1), True))
        else:
            b = rng.randrange(1, MAX_SEQS - 1)
            cases.append(([rng.randrange(1, MAX_TOKENS // b - 1) for _ in range(b)], False))
    return cases


@pytest.mark.parametrize('lora', [False, True])
@pytest.mark.parametrize('seed', [0, 1, 2])
def test_stage_fills_every_row_a_graph_reads_as_the_device_fill_does(seed, lora):
    rng = random.Random(100 + seed)
    staged, filled = _buffers(lora), _buffers(lora)
    for lens, decode in _cases(seed):
        inputs = _batch(rng, lens, decode, lora and rng.random() < 0.8)
        key = _key(inputs, decode)
        assert staged.stage(inputs, key, []) is not None
        (filled.fill_decode(inputs, key.num_seqs) if decode else filled.fill_prefill(inputs, key))
        got, want = staged.view(key), filled.view(key)
        for name in ('input_ids', 'position_ids', 'slot_mapping', 'q_lens', 'kv_lens', 'cu_seqlens_q',
                     'state_ids', 'is_fresh', 'lora_ids', 'graph_chunk_indices'):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a, b), (name, key, lens)
        b, width = inputs.batch_size, inputs.block_tables.size(1)
        assert torch.equal(got.block_tables[:b, :width], inputs.block_tables)
        if not decode:   # the pad and empty sequences' rows name page 0 (the pad sequence reads them)
            assert torch.equal(got.block_tables[b:], want.block_tables[b:]) and not got.block_tables[b:].any()


def _same(got, want) -> None:
    for f in dataclasses.fields(want):
        if not f.init:
            continue
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


def _payloads():
    plans = CacheCheckpointInputs(kv_restore_plan=torch.tensor([[3], [9]]),
                                  state_restore_plan=torch.tensor([[1, 2, 3], [4, 5, 6]]))
    sampling = SamplingInputs(temperature=torch.tensor([0.0, 0.7]), top_k=torch.tensor([0, 20]),
                              top_p=torch.tensor([1.0, 0.9]), repetition_penalty=torch.tensor([1.0, 1.1]),
                              penalty_ids=[None, None], banned_ids=[None, None], generators=[None, None],
                              all_greedy=False)
    return [sampling, None, plans]


def test_staged_inputs_and_payloads_keep_every_value():
    rng = random.Random(7)
    static = _buffers(lora=True)
    for lens, decode in (([40, 3], False), ([1, 1, 1], True)):
        inputs = _batch(rng, lens, decode, lora=True)
        inputs = dataclasses.replace(inputs, record_routed_experts=True)
        got, payloads = static.stage(inputs, _key(inputs, decode), _payloads())
        _same(got, inputs)
        assert got.logits_indices.data_ptr() != inputs.logits_indices.data_ptr()   # a view of the scratch
        assert payloads[1] is None
        for g, want in zip(payloads, _payloads()):
            if want is not None:
                _same(g, want)


def test_payloads_that_do_not_fit_the_scratch_are_refused_untouched():
    static = _buffers(lora=False, extra_bytes=64)
    inputs = _batch(random.Random(3), [30, 2], False, lora=False)
    before = static.arena.clone()
    big = CacheCheckpointInputs(kv_save_plan=torch.zeros(2, 64, dtype=torch.int64))
    assert static.stage(inputs, _key(inputs, False), [big]) is None
    assert torch.equal(static.arena, before)
    assert static.stage(inputs, _key(inputs, False), [None]) is not None   # the logits rows alone fit


def test_runner_stages_only_what_a_graph_runs(monkeypatch):
    from lmdeploy.pytorch.engine.cuda_graph import CUDAGraphRunner
    runner = CUDAGraphRunner(None, None, max_batch_size=4, max_pages=MAX_PAGES, device=CPU,
                             max_prefill_tokens=256, kernel_block_size=KBS)
    rng = random.Random(5)
    fits = _batch(rng, [100, 20], False, lora=False)
    key = runner.key_of(fits)
    staged, _ = runner.stage(fits, [])
    assert runner._staged == (staged, key)
    # the staged device inputs keep their key: `run` does not compute it again
    monkeypatch.setattr('lmdeploy.pytorch.engine.cuda_graph.prefill_key', lambda *a: pytest.fail('key computed'))
    assert runner.key_of(staged) == key
    monkeypatch.undo()
    too_long = _batch(rng, [300], False, lora=False)
    assert runner.key_of(too_long) is None and runner.stage(too_long, []) is None


def _run(engine, prompts: list[list[int]], stagger: int) -> list[tuple[list[int], torch.Tensor]]:
    from lmdeploy.pytorch.messages import SamplingParams
    outs: dict[int, list[int]] = {}
    ids, pending, steps = [], list(prompts), 0
    while pending or engine.has_work:
        while pending and len(ids) * stagger <= steps:
            ids.append(engine.add_request(pending.pop(0), SamplingParams(max_new_tokens=24), collect_logits=True,
                                          callback=lambda o: outs.setdefault(o.seq_id, []).extend(o.new_token_ids)))
        engine.step()
        steps += 1
    engine.check_integrity()
    return [(outs[i], engine.pop_collected_logits(i)) for i in ids]


@pytest.mark.gpu
def test_staged_graph_forwards_equal_the_upload_and_fill(tiny_model_factory, monkeypatch):
    """A hybrid on CUDA with prefix caching: prompts sharing a non-aligned prefix (restores from the cache),
    staggered so prefill chunks run beside decodes, replayed through graphs with staged inputs and with the old
    upload + fill (`LMDEPLOY_GRAPH_STAGING=0`): the same graphs on the same buffer contents, so the same tokens
    and logits."""
    pytest.importorskip('fla')
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    path = tiny_model_factory('qwen3_5')
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(0, 1000, (301,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 1000, (n,), generator=g).tolist() for n in (0, 5, 90, 700, 3, 40)]
    common = dict(device_type='cuda', dtype='bfloat16', block_size=16, kernel_block_size=8, num_gpu_blocks=512,
                  max_batch_size=8, max_prefill_token_num=512, enable_prefix_caching=True)
    results, runners = [], []
    for staging in ('1', '0'):
        monkeypatch.setenv('LMDEPLOY_GRAPH_STAGING', staging)
        engine = Engine(path, PytorchEngineConfig(**common))
        results.append(_run(engine, prompts[:1], 0) + _run(engine, prompts[1:], stagger=2))
        runners.append(engine.agent.graph_runner)
    assert runners[0].num_staged > 20 and runners[1].num_staged == 0
    assert runners[0].num_prefill_replays > 0 and runners[0].num_replays == runners[1].num_replays
    for (tokens, logits), (ref_tokens, ref_logits) in zip(*results):
        assert tokens == ref_tokens
        assert torch.equal(logits, ref_logits)


def test_agent_stages_plain_forwards_and_uploads_the_rest(tiny_model_factory, make_engine, monkeypatch):
    """`ModelAgent._upload_plain` on the CPU with a graph runner's buffers: a forward a graph runs is staged (the
    packable payloads in the scratch, a sampling payload with per-row lists and the feed uploaded on their own); one
    no graph runs, and any forward with `LMDEPLOY_GRAPH_STAGING=0`, goes through the plain upload. Every value
    comes back either way."""
    from lmdeploy.pytorch.engine.async_scheduling import TokenFeed
    from lmdeploy.pytorch.engine.cuda_graph import CUDAGraphRunner
    agent = make_engine(tiny_model_factory('qwen3_next')).agent
    runner = CUDAGraphRunner(None, None, max_batch_size=4, max_pages=MAX_PAGES, device=CPU,
                             max_prefill_tokens=256, kernel_block_size=KBS)
    monkeypatch.setattr(agent, 'graph_runner', runner)
    sampling, _, plans = _payloads()
    listed = dataclasses.replace(sampling, penalty_ids=[None, torch.tensor([3, 4])])   # not packable
    feed = TokenFeed(torch.arange(4), torch.tensor([[0], [1], [0], [-1], [0]]))
    rng = random.Random(11)
    for staging, lens, staged in ((True, [100, 20], True), (True, [300], False), (False, [100, 20], False)):
        monkeypatch.setattr(agent, '_staged_uploads', staging)
        inputs = _batch(rng, lens, False, lora=False)
        before = runner.num_staged
        for payloads in ((sampling, plans), (listed, plans)):
            got, moved, fed = agent._upload_plain(inputs, payloads, feed)
            assert (runner.num_staged > before) == staged and (runner._staged is not None) == staged
            runner._staged, before = None, runner.num_staged
            _same(got, inputs)
            _same(moved[1], plans)
            assert torch.equal(moved[0].temperature, sampling.temperature)
            assert [None if t is None else t.tolist() for t in moved[0].penalty_ids] == \
                [None if t is None else t.tolist() for t in payloads[0].penalty_ids]
            assert torch.equal(fed.table, feed.table) and fed.source is feed.source
