"""Forced acceptance at the model level: one verify forward feeds [x, d_1 .. d_K] with a state cut after every draft
position (`StateCuts` into spare state rows), so accepting j drafts leaves exactly plain decoding's state after those
tokens, with no recomputation. The drafts replay plain greedy's own continuation, corrupted at position j + 1, so
every acceptance count 0 .. K happens; after each, the verify logits, the recurrent and conv states, and the next
decode step equal plain decoding's."""
from __future__ import annotations

import pytest
import torch

from lmdeploy.pytorch.config import CacheConfig
from lmdeploy.pytorch.engine.cache_engine import CacheEngine
from lmdeploy.pytorch.engine.spec_acceptance import greedy_accept
from lmdeploy.pytorch.model_inputs import ModelInputs, StateCuts, StepContext
from lmdeploy.pytorch.models.loader import build_model

pytest.importorskip('transformers')

LIN, FULL = 'linear_attention', 'full_attention'
BLOCK, PAGES, K, SLOT = 16, 4, 3, 1
ATOL = 1e-4


def _inputs(ids: list[int], start: int, fresh: bool, cut_slots: list[int] = ()) -> ModelInputs:
    n = len(ids)
    positions = torch.arange(start, start + n)
    cuts = None
    if cut_slots:  # the state after the first o fed tokens, o = 1 .. len(cut_slots), into cut_slots[o - 1]
        cuts = StateCuts(rows=[0] * len(cut_slots), offsets=list(range(1, len(cut_slots) + 1)),
                         slots=list(cut_slots), q_lens=[n], state_ids=[SLOT], is_fresh=[fresh])
    return ModelInputs(
        input_ids=torch.tensor(ids), position_ids=positions, q_lens=torch.tensor([n]),
        kv_lens=torch.tensor([start + n]), cu_seqlens_q=torch.tensor([0, n]),
        block_tables=torch.arange(PAGES)[None], slot_mapping=positions, logits_indices=torch.arange(n),
        state_ids=torch.tensor([SLOT]), is_fresh=torch.tensor([fresh]), q_lens_list=[n], kv_lens_list=[start + n],
        max_seqlen_q=n, max_seqlen_k=start + n, state_cuts=cuts)


def _states(cache: CacheEngine, slot: int) -> list[torch.Tensor]:
    return [view[slot].clone() for layer in cache.state_caches for view in layer.values()]


@pytest.fixture(scope='module', params=['cpu', pytest.param('cuda', marks=pytest.mark.gpu)])
def model_and_cache(tiny_model_factory, request):
    """float32 on the default backend (CPU) and on the cuda backend (GPU)."""
    device = request.param
    path = tiny_model_factory('qwen3_5', num_hidden_layers=3, layer_types=[LIN, FULL, LIN])
    model, config = build_model(path, torch.device(device), 'float32', device)
    cache = CacheEngine(config, CacheConfig(block_size=BLOCK, kernel_block_size=BLOCK, num_blocks=PAGES,
                                            num_state_slots=K + 3), torch.device(device))
    return model, config, cache


@torch.no_grad()
def test_every_acceptance_count_leaves_the_plain_decode_state(model_and_cache):
    model, config, cache = model_and_cache

    def run(inputs: ModelInputs) -> torch.Tensor:
        ctx = StepContext(inputs=inputs.to(cache.device), kv_caches=cache.kv_caches, state_caches=cache.state_caches,
                          kernel_block_size=BLOCK)
        return model.compute_logits(model(ctx))

    prompt = torch.randint(0, config.vocab_size, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    n = len(prompt)
    tokens = [int(run(_inputs(prompt, 0, True))[-1].argmax())]  # g_1
    after_prefill = cache.kv_pool.clone(), cache.state_pool.clone()
    plain_logits, plain_states = [], []
    for i in range(K + 1):  # plain greedy: feed g_{i+1}, keep its logits and the state after it
        logits = run(_inputs([tokens[i]], n + i, False))[-1]
        plain_logits.append(logits)
        plain_states.append(_states(cache, SLOT))
        tokens.append(int(logits.argmax()))
    next_logits = run(_inputs([tokens[K + 1]], n + K + 1, False))[-1]  # decode after all K + 1 fed
    seen = set()
    for j in range(K + 1):
        cache.kv_pool.copy_(after_prefill[0])
        cache.state_pool.copy_(after_prefill[1])
        drafts = tokens[1:K + 1]
        if j < K:
            drafts[j] = (drafts[j] + 1) % config.vocab_size  # the replayed continuation, wrong at draft j + 1
        cut_slots = list(range(SLOT + 1, SLOT + 1 + K))
        logits = run(_inputs([tokens[0], *drafts], n, False, cut_slots))
        accepted = greedy_accept(torch.tensor([drafts], device=logits.device), logits[None])
        assert int(accepted.num_accepted) == j
        seen.add(j)
        for i in range(j + 1):
            torch.testing.assert_close(logits[i], plain_logits[i], atol=ATOL, rtol=ATOL)
        assert accepted.tokens[0, :j + 1].tolist() == tokens[1:j + 2]
        # committed: x, d_1 .. d_j; the state after them is cut j + 1 (or the runtime row itself when all passed)
        if j < K:
            cache.copy_state_slots(torch.tensor([[cut_slots[j]], [SLOT]], device=cache.device))
        for got, want in zip(_states(cache, SLOT), plain_states[j]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # the next step feeds the emitted token over the stale KV of rejected drafts (masked by kv_len)
        logits = run(_inputs([tokens[j + 1]], n + j + 1, False))[-1]
        want = plain_logits[j + 1] if j < K else next_logits
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=ATOL)
    assert seen == set(range(K + 1))
