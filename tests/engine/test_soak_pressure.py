"""The engine soak (`test_soak.py`) with the benchmark's pressure pools: KV and checkpoint pools at 50% and 25% of
the working set its traffic reaches on roomy pools (`lmdeploy/bench/pressure.py`). Same checks as the soak: the
pools' accounting after every step, no pin outliving its step, greedy outputs equal to a cache-off control (near
ties counted), and every block and row back with the cache once it is evicted (no leak)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import test_soak as soak

from lmdeploy.bench.pressure import pools_at, working_set

REQUESTS_PER_POOL = 40
MAX_TOKENS = 144  # prompt + reply of one request, as in the soak's 20-block pool
CONCURRENCY = 4


@dataclass(frozen=True)
class PressurePool(soak.Pool):
    tokens: int = MAX_TOKENS

    @property
    def max_tokens(self) -> int:
        return self.tokens


def test_soak_with_pressure_pools(tiny_model_factory, monkeypatch):
    path = tiny_model_factory('qwen3_5')
    peaks = {'blocks': 0, 'checkpoints': 0}
    make_engine = soak.make_engine

    def measured(path, pool, tp=1):
        engine = make_engine(path, pool, tp)

        def measure(stats):
            peaks['blocks'] = max(peaks['blocks'], stats.num_kv_blocks - stats.num_free_kv_blocks)
            peaks['checkpoints'] = max(peaks['checkpoints'], stats.prefix_cache.live_checkpoints)

        if pool is not None:  # not the cache-off control
            engine.add_step_listener(measure)
        return engine

    monkeypatch.setattr(soak, 'make_engine', measured)
    figures = soak.Figures()
    requests = soak.soak_pool(path, PressurePool(400, CONCURRENCY, 200, 40), REQUESTS_PER_POOL,
                              random.Random(soak.SEED), figures)
    ws = working_set(peaks['blocks'], peaks['checkpoints'], MAX_TOKENS, soak.BLOCK_SIZE, CONCURRENCY)
    before = figures.counts['evicted_checkpoints']
    assert before == 0, 'the roomy pass must not evict'
    for k, pressure in enumerate((0.5, 0.25)):
        pools = pools_at(ws, pressure, CONCURRENCY)
        assert pools.num_blocks < 400 and pools.state_budget < peaks['checkpoints']
        requests += soak.soak_pool(path, PressurePool(pools.num_blocks, CONCURRENCY, pools.state_budget, 40),
                                   REQUESTS_PER_POOL, random.Random(soak.SEED + 1 + k), figures)
    soak.compare(requests, soak.control_outputs(path, requests), figures)
    counts = figures.counts
    assert counts['evicted_checkpoints'] > 0 and counts['hits'] > 0, 'the pressure pools never filled or never hit'
    print(f'\nsoak under pressure (working set {ws}): {figures.line()}')
