"""Prefix caching's invariants on the device side, on tiny CPU engines: every block a forward writes is owned by
the request writing it (never a trie block or a checkpoint's frozen block; copies go only where the plans say),
and the model agent runs restores, then the forward, then saves."""
from __future__ import annotations

import pytest
import torch
from prefix_cache_runs import (
    HYBRID,
    B,
    check_against_cold,
    generate,
    ids,
    make_engine,
    one,
)

from lmdeploy.pytorch.kernels.default import paged_attention


@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_5'])
def test_every_block_a_forward_writes_is_request_owned(model_path, arch, monkeypatch):
    path = model_path(arch)
    engine = make_engine(path, max_prefill_token_num=23)
    scheduler, pages_per_block = engine.scheduler, B // 8
    written = []

    def checked_fill(k, v, k_cache, v_cache, slot_mapping):
        trie = scheduler.trie
        blocks = set((slot_mapping // k_cache.size(1) // pages_per_block).tolist())
        node_blocks = set(trie.kv.owners())
        frozen = {ck.frozen_block_id for ck in trie.checkpoints.live()} if trie.checkpoints is not None else set()
        assert not blocks & node_blocks, f'a forward writes trie-owned blocks {blocks & node_blocks}'
        assert not blocks & frozen, f'a forward writes frozen checkpoint blocks {blocks & frozen}'
        assert blocks <= {b for seq in scheduler.running for b in seq.block_ids}
        written.append(blocks)
        return fill(k, v, k_cache, v_cache, slot_mapping)

    def checked_plans(out):
        """Copy destinations: restores land in request-owned, non-trie blocks; saves in this step's frozen blocks."""
        node_blocks = set(scheduler.trie.kv.owners())
        owned = {b for seq in out.seqs + [seq for seq, _ in out.logits_hits] for b in seq.block_ids}
        assert all(dst in owned and dst not in node_blocks for _, dst in out.kv_restores)
        assert sorted(dst for _, dst in out.kv_saves) == sorted(
            ck.frozen_block_id for _, ck in out.reserved if ck.frozen_block_id is not None)
        assert all(src in owned for src, _ in out.kv_saves)

    fill = paged_attention.fill_kv_cache
    monkeypatch.setattr(paged_attention, 'fill_kv_cache', checked_fill)  # undone before the cold control runs
    base = ids(80, seed=17)
    schedule = scheduler.schedule

    def checked_schedule():
        out = schedule()
        checked_plans(out)
        return out

    monkeypatch.setattr(scheduler, 'schedule', checked_schedule)
    runs = [one(engine, base, 4)]
    # Resumes at 46 (hybrid) / 64 (dense) although blocks 2 and 3 ([32, 64)) are cached in the trie: the
    # continuation is recomputed into private blocks (prior-art trap 4).
    runs += generate(engine, [base[:64] + ids(10, seed=18), base[:40] + ids(3, seed=19)], max_new_tokens=4)
    runs += generate(engine, [base[:64] + ids(10, seed=18) + ids(20, seed=20)] * 2, max_new_tokens=4)
    # Wave 3 (94 tokens, twice) resumes at the wave-2 prefill end 74; the second copy is admitted one step later.
    # Hybrid: by then the first copy's prompt-end checkpoint (with its logits) serves the whole prompt: only restore
    # copies and decodes write. Dense: the first copy's chunk attached block 4 ([64, 80)): 5 blocks.
    assert [r.cached for r in runs] == ([0, 46, 23, 74, 94] if arch in HYBRID else [0, 64, 32, 64, 80])
    assert len(written) > 10
    monkeypatch.undo()
    check_against_cold(path, runs, 4)


@pytest.mark.parametrize('arch', HYBRID)
def test_model_agent_orders_restores_forward_saves(model_path, arch):
    engine = make_engine(model_path(arch))
    prefix = ids(2 * B + 5, seed=21)
    one(engine, prefix)
    cache_engine, model, maker = engine.cache_engine, engine.model, engine.inputs_maker
    order, plans = [], []
    copy_blocks, copy_slots, forward, make_cache_inputs = (cache_engine.copy_logical_blocks,
                                                           cache_engine.copy_state_slots, model.forward,
                                                           maker.make_cache_inputs)

    def label(plan, kinds):
        ci = plans[-1]
        return next(kind for kind in kinds if getattr(ci, f'{kind}_plan') is not None
                    and torch.equal(getattr(ci, f'{kind}_plan'), plan.cpu()))

    def recording_make(sched):
        ci = make_cache_inputs(sched)
        plans.append(ci)
        order.append('step')
        return ci

    def blocks(plan):
        order.append(label(plan, ('kv_restore', 'kv_save')))
        copy_blocks(plan)

    def slots(plan):
        order.append(label(plan, ('state_restore', 'state_save')))
        copy_slots(plan)

    def model_forward(*args, **kwargs):
        order.append('forward')
        return forward(*args, **kwargs)

    maker.make_cache_inputs = recording_make
    cache_engine.copy_logical_blocks, cache_engine.copy_state_slots = blocks, slots
    model.forward = model_forward
    # Resumes at 37 (restore frozen block + state) and ends its prefill at 47 (save partial block + state).
    run = one(engine, prefix + ids(10, seed=22), max_new_tokens=2)
    assert run.cached == 2 * B + 5
    assert order[:6] == ['step', 'kv_restore', 'state_restore', 'forward', 'kv_save', 'state_save']
    # Every later group of copies (decode, reply checkpoint) keeps the same order.
    rank = {'kv_restore': 0, 'state_restore': 1, 'forward': 2, 'kv_save': 3, 'state_save': 4}
    groups = ' '.join(order).split('step')
    for group in groups:
        ranks = [rank[op] for op in group.split()]
        assert ranks == sorted(ranks), group
