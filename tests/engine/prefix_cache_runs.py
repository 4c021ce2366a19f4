"""The prefix-cache engine tests' runs: tiny CPU engines with prefix caching on, requests driven to idle with the
block / state-slot accounting checked after every step, and warm runs compared with a cache-off control.

Geometry: block_size B = 16, kernel pages of 8 tokens (2 pages per block). A warm run's logits cover the tokens it
actually feeds (`prompt[cached:]` plus the generated ones but the last); the control's cover the whole prompt.
The `model_path` fixture is in tests/engine/conftest.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from engines import engine_factory
from numeric import assert_close

from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams

B = 16
ATOL = 1e-4
MAX_STEPS = 1000
DENSE, HYBRID = ('qwen3',), ('qwen3_5', 'qwen3_next')
ARCHS = DENSE + HYBRID
# Engines run with the shipped defaults unless a test says otherwise. The checkpoint policies layered on the base
# design (prompt-end logits, branch points, reply checkpoints, value eviction) change some exact numbers; tests of
# the base mechanism switch off the ones that would, by name.
NO_REPLY = dict(prefix_cache_reply_checkpoints=False)
BASE = dict(prefix_cache_reply_checkpoints=False, prefix_cache_prompt_logits=False,
            prefix_cache_branch_checkpoints=False, prefix_cache_value_eviction=False)


make_engine = engine_factory(block_size=B, kernel_block_size=8, num_gpu_blocks=96, max_batch_size=8,
                             max_prefill_token_num=512, enable_prefix_caching=True)


def ids(length: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Run:
    prompt: list[int]
    cached: int = 0                                        # EngineOutput.num_cached
    generated: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None                     # [fed tokens, vocab]: prompt[cached:] + generated[:-1]


def submit(engine: Engine, prompt: list[int], max_new_tokens: int = 1) -> tuple[int, Run]:
    run = Run(list(prompt))

    def on_output(out):
        run.cached = out.num_cached
        run.generated += out.new_token_ids

    return engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens), callback=on_output,
                              collect_logits=True), run


def drive(engine: Engine, after_step=None) -> None:
    """Step until idle, checking the KV / state-slot accounting after every step."""
    for _ in range(MAX_STEPS):
        if not engine.has_work:
            return
        engine.step()
        engine.check_integrity()
        if after_step is not None:
            after_step()
    raise AssertionError(f'the engine is still busy after {MAX_STEPS} steps (a request is never admitted?)')


def generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int = 1, after_step=None) -> list[Run]:
    """Submit all prompts at once (they share forwards), run to idle."""
    pending = [submit(engine, p, max_new_tokens) for p in prompts]
    drive(engine, after_step)
    for seq_id, run in pending:
        run.logits = engine.pop_collected_logits(seq_id)
    return [run for _, run in pending]


def one(engine: Engine, prompt: list[int], max_new_tokens: int = 1) -> Run:
    return generate(engine, [prompt], max_new_tokens)[0]


def assert_warm_equals_cold(warm: Run, cold: Run) -> None:
    assert cold.cached == 0
    assert warm.generated == cold.generated, 'greedy tokens differ between warm and cold'
    assert warm.logits.shape[0] == len(warm.prompt) - warm.cached + len(warm.generated) - 1
    assert_close(warm.logits, cold.logits[warm.cached:], atol=ATOL, rtol=0, what=f'warm logits (cached {warm.cached})')


def check_against_cold(path: str, warm_runs: list[Run], max_new_tokens: int = 1, **overrides) -> None:
    """Replay every warm prompt on a cache-off engine and compare."""
    cold = make_engine(path, cache=False, **overrides)
    for warm in warm_runs:
        assert_warm_equals_cold(warm, one(cold, warm.prompt, max_new_tokens))


def live_steps(engine: Engine) -> list[int]:
    return sorted(ck.step for ck in engine.scheduler.trie.checkpoints.live())
