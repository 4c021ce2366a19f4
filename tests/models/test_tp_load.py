"""`build_rank_model` with dummy weights: each rank draws its shards directly, and the shards gathered over ranks
are exactly the TP=1 dummy model's parameters (so TP=1 and TP=N dummy runs compare, as issue 24's real-depth check
needs); its `ModelConfig` is the per-rank one with the full model's vocabulary and special ids."""
from __future__ import annotations

import pytest
import torch

from lmdeploy.pytorch.models.loader import build_model, load_hf_config
from lmdeploy.pytorch.models.tp_geometry import tp_geometry
from lmdeploy.pytorch.models.tp_load import build_rank_model
from lmdeploy.pytorch.models.tp_plan import gather_shards, tp_shard_plan

HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=6, num_attention_heads=4, num_key_value_heads=2)
CASES = {'qwen3_5': ('qwen3_5', HYBRID), 'qwen3_next': ('qwen3_next', HYBRID),
         'qwen3_kv_replicated': ('qwen3', dict(num_attention_heads=4, num_key_value_heads=1))}


@pytest.mark.parametrize('case', list(CASES))
def test_dummy_rank_shards_gather_to_the_tp1_dummy_model(tiny_model_factory, case):
    arch, overrides = CASES[case]
    path = tiny_model_factory(arch, **overrides)
    cpu = torch.device('cpu')
    full, full_config = build_model(path, cpu, 'float32', 'cpu', load_format='dummy')
    ranks = [build_rank_model(path, cpu, 'float32', 'cpu', 2, r, load_format='dummy') for r in range(2)]
    geometry = tp_geometry(load_hf_config(path), 2)
    plan = tp_shard_plan(full, geometry)
    params = [dict(model.named_parameters()) for model, _ in ranks]
    for name, param in full.named_parameters():
        assert torch.equal(gather_shards([p[name] for p in params], plan[name], geometry), param), name
    rank_config = ranks[0][1]
    assert rank_config.vocab_size == full_config.vocab_size
    assert rank_config.eos_token_ids == full_config.eos_token_ids
    assert rank_config.num_kv_heads == max(1, full_config.num_kv_heads // 2)
