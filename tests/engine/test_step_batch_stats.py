"""The per-step record's `batch` (`engine_stats.StepBatch`): what each step's forward held, checked against the
token arithmetic of the requests themselves, with the synchronous loop and with async scheduling.

Requests that stop by length feed every prompt token once and every generated token but the last once (the last is
sampled, never fed), so over a run the batches' tokens sum to sum(prompt) + sum(new - 1), and the decode pieces to
sum(new - 1). The 90-token prompt exceeds the 64-token prefill budget, so it is chunked.
"""
from __future__ import annotations

import pytest
import torch
from engines import engine_factory

from lmdeploy.pytorch.messages import SamplingParams

make_engine = engine_factory(block_size=16, kernel_block_size=8, num_gpu_blocks=96, max_batch_size=8,
                             max_prefill_token_num=64)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


@pytest.mark.parametrize('async_scheduling', [False, True], ids=['sync', 'async'])
def test_step_batches_account_for_every_fed_token(tiny_model_factory, async_scheduling):
    engine = make_engine(tiny_model_factory('qwen3_5'), async_scheduling=async_scheduling)
    batches = []
    engine.add_step_listener(lambda stats: batches.append(stats.batch))
    lengths, new = [20, 90, 33, 7], [5, 3, 9, 1]
    for i, (n, k) in enumerate(zip(lengths, new)):
        engine.add_request(prompt(n, i), SamplingParams(max_new_tokens=k, min_new_tokens=k, temperature=0.0,
                                                        stop_token_ids=()))
    engine.run_until_idle()
    engine.check_integrity()
    assert sum(b.num_tokens for b in batches) == sum(lengths) + sum(k - 1 for k in new)
    assert sum(b.num_decode_seqs for b in batches) == sum(k - 1 for k in new)
    # the first step is prefill only, prefill chunks share steps with decode pieces, decode-only steps end the run
    assert batches[0].num_seqs and not batches[0].num_decode_seqs
    assert any(0 < b.num_decode_seqs < b.num_seqs for b in batches)
    assert all(b.num_tokens <= 64 for b in batches)
    pure = [b for b in batches if b.is_pure_decode]
    assert pure and all(b.num_tokens == b.num_seqs for b in pure)
    assert max(b.num_seqs for b in pure) >= 2
    assert engine.stats_snapshot.batch == batches[-1]
    if async_scheduling:
        assert engine.num_overlapped_steps >= 3
