"""Warm start (`engine/warm_start.py`): the eager warm-up's shapes cover every specialization class of the token
and sequence counts, its padding writes nothing a sequence owns (CPU), and on CUDA the first request after
start-up compiles nothing (GPU; its time is the benchmark's, `benchmark/bench_real_depth.py`)."""
from __future__ import annotations

import gc
import time

import pytest
import torch

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.warm_start import padding_inputs, warm_up_shapes
from lmdeploy.pytorch.messages import SamplingParams


def _class(n: int) -> str:
    """Triton's specialization class of an integer argument."""
    return 'one' if n == 1 else 'x16' if n % 16 == 0 else 'other'


@pytest.mark.parametrize('max_tokens,max_batch', [(8192, 128), (4096, 16), (64, 4), (100, 3), (5, 1), (1, 1)])
def test_warm_up_shapes_cover_every_specialization_class(max_tokens, max_batch):
    shapes = warm_up_shapes(max_tokens, max_batch)
    assert shapes and len(shapes) == len({tuple(s) for s in shapes})
    assert all(1 <= len(s) <= max_batch and sum(s) <= max_tokens and min(s) >= 1 for s in shapes)
    assert [max_tokens] in shapes   # the largest forward
    seen = {(_class(sum(s)), _class(len(s)), sum(s) == len(s)) for s in shapes}
    # every (tokens, sequences) class pair a forward of these bounds can have, decode (T == B) and not
    want = set()
    for tokens in range(1, max_tokens + 1):
        for seqs in {1, 2, 3, 15, 16, 17, 32, max_batch, tokens}:
            if 1 <= seqs <= min(tokens, max_batch):
                want.add((_class(tokens), _class(seqs), tokens == seqs))
    assert want <= seen, sorted(want - seen)
    # one-sequence prefills below the token count where the conv widens its tiles (512), in both classes
    short = {_class(s[0]) for s in shapes if len(s) == 1 and 1 < s[0] < 512}
    assert short >= ({'x16', 'other'} if max_tokens >= 32 else {'other'} if max_tokens >= 2 else set()), shapes


@pytest.mark.parametrize('max_tokens,max_batch,kbs', [(8192, 128, 64), (64, 4, 16), (100, 3, 8), (5, 1, 64)])
def test_warm_up_plan_covers_the_block_table_width_classes(max_tokens, max_batch, kbs):
    """The attention kernels specialize on the table's row stride: decode and prefill forwards each see widths of
    one page, a multiple of 16 and neither (H200 run 2: decodes of 16 and 79 pages compiled on first use), the
    smallest and the largest prefill (split-KV and one-pass attention) each all of them, and every width holds
    the pages its sequences need."""
    from lmdeploy.pytorch.engine.warm_start import warm_up_plan
    plan = warm_up_plan(max_tokens, max_batch, kbs)
    assert [q for q, _ in plan][:len(warm_up_shapes(max_tokens, max_batch))] == warm_up_shapes(max_tokens, max_batch)
    for decode in (True, False):
        widths = [w for q, w in plan if (sum(q) == len(q)) == decode]
        if widths:
            assert {_class(w) for w in widths} == {'one', 'x16', 'other'}, (decode, widths)
    assert all(w >= -(-max(q) // kbs) for q, w in plan)
    prefills = [q for q, _ in plan if sum(q) != len(q)]
    for end in (min(prefills, key=sum), max(prefills, key=sum)):   # split-KV and one-pass prefill attention
        want = {'x16', 'other'} | ({'one'} if max(end) <= kbs else set())
        assert {_class(w) for q, w in plan if q == end} >= want, (end, plan)
    inputs = padding_inputs([5, 1], kernel_block_size=8, table_width=17)
    assert inputs.block_tables.shape == (2, 17) and inputs.block_tables.eq(0).all()


def test_padding_inputs_write_nothing_a_sequence_owns():
    inputs = padding_inputs([5, 1, 20], kernel_block_size=8, has_lora=True)
    assert inputs.input_ids.numel() == 26 and inputs.cu_seqlens_q.tolist() == [0, 5, 6, 26]
    assert inputs.slot_mapping.eq(-1).all() and inputs.state_ids.eq(0).all() and inputs.is_fresh.all()
    assert inputs.kv_lens.tolist() == inputs.q_lens.tolist() == [5, 1, 20]   # no history: nothing read from KV
    assert inputs.block_tables.shape == (3, 3) and inputs.block_tables.eq(0).all()   # page 0, 20 keys wide
    assert inputs.logits_indices.tolist() == [4, 5, 25] and inputs.lora_ids.tolist() == [0, 0, 0]
    assert inputs.position_ids.tolist()[:6] == [0, 1, 2, 3, 4, 0] and not inputs.is_decode


def test_eager_warm_up_leaves_pools_and_requests_untouched(tiny_model_factory):
    """The warm-up forwards and draws (run here on the CPU, where start-up skips them) change no KV page, no state
    row but the dummy row 0 and not the global RNG, and the engine then generates exactly what a fresh one does."""
    path = tiny_model_factory('qwen3_5')
    config = PytorchEngineConfig(device_type='cpu', block_size=16, num_gpu_blocks=32, max_batch_size=4,
                                 max_prefill_token_num=48)
    engine = Engine(path, config)
    kv = engine.cache_engine.kv_pool.clone()
    states = engine.cache_engine.state_pool[1:].clone()
    rng = torch.get_rng_state()
    assert engine.agent.warm_up_eager() >= 0
    assert torch.equal(engine.cache_engine.kv_pool, kv) and torch.equal(engine.cache_engine.state_pool[1:], states)
    assert torch.equal(torch.get_rng_state(), rng)   # its random draws use a generator of their own
    engine.check_integrity()
    prompt = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()

    def generate(e: Engine) -> list[int]:
        out = []
        e.add_request(prompt, SamplingParams(max_new_tokens=6), callback=lambda o: out.extend(o.new_token_ids))
        e.run_until_idle()
        return out
    assert generate(engine) == generate(Engine(path, config))


def _compiled_binaries() -> set[tuple[str, str]]:
    """(kernel name, specialization key) of every compiled-handle binary built so far."""
    from lmdeploy.pytorch.kernels.cuda.launch import FastKernel
    return {(k.fn.__name__, repr(key)) for k in gc.get_objects() if isinstance(k, FastKernel) for key in k._compiled}


def _ttft(engine: Engine, prompt: list[int]) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_new_tokens=2))
    engine.run_until_idle()
    torch.cuda.synchronize()
    return time.perf_counter() - began


@pytest.mark.gpu
@pytest.mark.parametrize('eager', [True, False], ids=['eager', 'graphs'])
def test_first_request_after_start_up_compiles_nothing(tiny_model_factory, eager):
    """Eager mode and graphs (a prompt past the graphs' largest bucket runs eager chunks): after start-up, the first
    request of an odd length (then a mixed batch) builds no new Triton binary. Its time against a later request is
    printed, not asserted (a bound on wall time flakes under load, H200 run 6): the first-request row of
    `benchmark/bench_real_depth.py` measures it."""
    if not torch.cuda.is_available():
        pytest.skip('needs CUDA')
    pytest.importorskip('fla')
    path = tiny_model_factory('qwen3_5', max_position_embeddings=16384)
    engine = Engine(path, PytorchEngineConfig(device_type='cuda', dtype='bfloat16', block_size=64, num_gpu_blocks=512,
                                              max_batch_size=8, max_prefill_token_num=8192, eager_mode=eager))
    assert engine.startup_seconds > 0
    before = _compiled_binaries()
    g = torch.Generator().manual_seed(0)
    lens = [999, 5003]
    firsts = [_ttft(engine, torch.randint(0, 1000, (n,), generator=g).tolist()) for n in lens]
    for n in lens[:1]:
        engine.add_request(torch.randint(0, 1000, (n,), generator=g).tolist(), SamplingParams(max_new_tokens=8))
    engine.add_request(torch.randint(0, 1000, (37,), generator=g).tolist(), SamplingParams(max_new_tokens=8))
    engine.run_until_idle()
    new = sorted(_compiled_binaries() - before)
    assert not new, f'requests compiled Triton kernels after start-up: {new}'
    laters = [_ttft(engine, torch.randint(0, 1000, (n,), generator=g).tolist()) for n in lens]
    for n, first, later in zip(lens, firsts, laters):
        print(f'{n} tokens: first {first * 1e3:.1f} ms, later {later * 1e3:.1f} ms '
              f'(start-up {engine.startup_seconds:.1f} s)')
