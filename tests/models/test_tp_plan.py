"""Tensor-parallel weight plan: every parameter of tiny Qwen3.5, Qwen3-Next and Qwen3 shards to the shape a
per-rank model has, shard-then-gather gives back the full weight, and the sharded projections compute exactly the
full projections' per-rank heads (column-parallel) and partial sums (row-parallel).

The models have n_v / n_k = 3 (gated delta) so the per-section split differs from a plain chunk of the fused rows,
and Qwen3 has fewer KV heads than ranks in one case (KV heads replicated)."""
from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open

from lmdeploy.pytorch.models.loader import build_model, load_hf_config
from lmdeploy.pytorch.models.model_init import params_on_meta
from lmdeploy.pytorch.models.qwen3_next import interleaved_ba_to_blocked, interleaved_qkvz_to_blocked
from lmdeploy.pytorch.models.registry import get_model_class
from lmdeploy.pytorch.models.tp_geometry import rank_hf_config, text_config_of, tp_geometry
from lmdeploy.pytorch.models.tp_plan import gather_shards, shard_state_dict, tp_shard_plan

HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=6, num_attention_heads=4, num_key_value_heads=2)
CASES = {
    'qwen3_5': ('qwen3_5', HYBRID, 2),
    'qwen3_next': ('qwen3_next', HYBRID, 2),
    'qwen3_gqa': ('qwen3', dict(num_attention_heads=6, num_key_value_heads=2), 2),
    'qwen3_kv_replicated': ('qwen3', dict(num_attention_heads=4, num_key_value_heads=1), 2),
}


@pytest.fixture(scope='module', params=list(CASES))
def sharded(request, tiny_model_factory):
    arch, overrides, tp = CASES[request.param]
    path = tiny_model_factory(arch, **overrides)
    model, _ = build_model(path, torch.device('cpu'), 'float32', 'cpu')
    hf_config = load_hf_config(path)
    geometry = tp_geometry(hf_config, tp)
    plan = tp_shard_plan(model, geometry)
    shards = [shard_state_dict(model, plan, geometry, r) for r in range(tp)]
    return dict(path=path, model=model, hf_config=hf_config, geometry=geometry, plan=plan, shards=shards)


def test_every_shard_has_the_shape_of_a_per_rank_model(sharded):
    geometry, hf_config = sharded['geometry'], sharded['hf_config']
    with params_on_meta():
        rank_model = get_model_class(hf_config.architectures[0])(rank_hf_config(hf_config, geometry.tp))
    expected = {name: tuple(p.shape) for name, p in rank_model.named_parameters()}
    for shard in sharded['shards']:
        assert {name: tuple(t.shape) for name, t in shard.items()} == expected


def test_per_rank_state_and_kv_shapes(sharded):
    """Per rank: conv state [conv_dim / tp, K], recurrent state [n_v / tp, d_k, d_v] (this
    engine's layout), KV heads n_kv / tp (at
    least one, replicated)."""
    hf_config, tp = sharded['hf_config'], sharded['geometry'].tp
    cls = get_model_class(hf_config.architectures[0])
    full, rank = (cls.build_model_config(c, 'float32') for c in (hf_config, rank_hf_config(hf_config, tp)))
    assert rank.num_kv_heads == max(1, full.num_kv_heads // tp)
    text = text_config_of(hf_config)
    for spec in rank.state_specs:
        if spec.name == 'conv':
            conv_dim = 2 * text.linear_num_key_heads * text.linear_key_head_dim + \
                text.linear_num_value_heads * text.linear_value_head_dim
            assert spec.shape[0] == conv_dim // tp
        else:
            assert spec.shape == (text.linear_num_value_heads // tp, text.linear_key_head_dim,
                                  text.linear_value_head_dim)
    assert len(rank.state_specs) == len(full.state_specs)


def test_shard_then_gather_is_the_full_weight(sharded):
    for name, param in sharded['model'].named_parameters():
        parts = [shard[name] for shard in sharded['shards']]
        assert torch.equal(gather_shards(parts, sharded['plan'][name], sharded['geometry']), param), name


def _linears(model, suffix):
    return [(name, m) for name, m in model.named_modules() if name.endswith(suffix)]


def test_row_parallel_partial_sums_are_the_full_output(sharded):
    """out_proj / o_proj / down_proj: sum over ranks of (the rank's contiguous input slice @ its shard) = full."""
    torch.manual_seed(0)
    tp = sharded['geometry'].tp
    layers = [*_linears(sharded['model'], 'o_proj'), *_linears(sharded['model'], 'out_proj'),
              *_linears(sharded['model'], 'mlp.down_proj'), *_linears(sharded['model'], 'shared_expert.down_proj')]
    assert layers
    for name, layer in layers:
        x = torch.randn(3, layer.weight.size(1), dtype=torch.float64)
        full = x @ layer.weight.double().T
        width = x.size(1) // tp
        partial = sum(x[:, r * width:(r + 1) * width] @ shards[f'{name}.weight'].double().T
                      for r, shards in enumerate(sharded['shards']))
        torch.testing.assert_close(partial, full, rtol=1e-12, atol=1e-12)


def test_column_parallel_outputs_are_the_ranks_heads(sharded):
    """Each rank's fused projection output, split by its own section sizes, is the full output's heads of that
    rank: query (with its gate) and KV heads of attention; q, k, v, z heads and b, a of gated DeltaNet."""
    torch.manual_seed(0)
    g = sharded['geometry']
    text = text_config_of(sharded['hf_config'])
    x = torch.randn(3, text.hidden_size, dtype=torch.float64)
    for name, attn in _linears(sharded['model'], 'self_attn'):
        full = attn.qkv_proj(x.float()).double()
        q_unit = sum(attn.qkv_proj.shard_sizes[:1]) // attn.num_heads
        q, k, v = full.split(attn.qkv_proj.shard_sizes, dim=-1)
        for r in range(g.tp):
            out = x @ sharded['shards'][r][f'{name}.qkv_proj.weight'].double().T
            h, (lo, hi) = g.heads_per_rank, g.kv_head_range(r)
            want_q = q.unflatten(-1, (attn.num_heads, q_unit))[:, r * h:(r + 1) * h].flatten(-2)
            d = attn.head_dim
            want_k = k.unflatten(-1, (attn.num_kv_heads, d))[:, lo:hi].flatten(-2)
            want_v = v.unflatten(-1, (attn.num_kv_heads, d))[:, lo:hi].flatten(-2)
            torch.testing.assert_close(out, torch.cat([want_q, want_k, want_v], -1), rtol=1e-5, atol=1e-5)
    for name, net in _linears(sharded['model'], 'linear_attn'):
        q, k, v, z = (x @ net.in_proj_qkvz.weight.double().T).split(net.qkv_sizes + [net.qkv_sizes[2]], dim=-1)
        b, a = (x @ net.in_proj_ba.weight.double().T).chunk(2, dim=-1)
        nk, nv = net.num_k_heads // g.tp, net.num_v_heads // g.tp
        for r in range(g.tp):
            shard = sharded['shards'][r]
            out = x @ shard[f'{name}.in_proj_qkvz.weight'].double().T

            def heads(t, n, d, r=r):
                return t.unflatten(-1, (-1, d))[:, r * n:(r + 1) * n].flatten(-2)
            want = [heads(q, nk, net.head_k_dim), heads(k, nk, net.head_k_dim), heads(v, nv, net.head_v_dim),
                    heads(z, nv, net.head_v_dim)]
            torch.testing.assert_close(out, torch.cat(want, -1), rtol=1e-12, atol=1e-12)
            ba = x @ shard[f'{name}.in_proj_ba.weight'].double().T
            torch.testing.assert_close(ba, torch.cat([heads(b, nv, 1), heads(a, nv, 1)], -1), rtol=1e-12, atol=1e-12)
            assert torch.equal(shard[f'{name}.A_log'], net.A_log[r * nv:(r + 1) * nv])
            conv = shard[f'{name}.conv1d.weight']
            assert conv.shape == (net.conv_dim // g.tp, 1, net.conv1d.kernel_size)


def test_sharded_experts_sum_to_the_full_experts(sharded):
    """MoE on the intermediate dimension: per expert, the SwiGLU of the rank's gate/up rows through its down
    columns, summed over ranks, is the full expert (a torch reference of the expert MLP)."""
    experts = _linears(sharded['model'], 'mlp.experts')
    if not experts:
        pytest.skip('dense model')
    torch.manual_seed(0)
    x = torch.randn(3, experts[0][1].gate_up_proj.size(-1), dtype=torch.float64)

    def swiglu(gate_up, down, e):
        gate, up = (x @ gate_up[e].double().T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ down[e].double().T

    for name, module in experts:
        for e in range(module.num_experts):
            partial = sum(swiglu(s[f'{name}.gate_up_proj'], s[f'{name}.down_proj'], e) for s in sharded['shards'])
            torch.testing.assert_close(partial, swiglu(module.gate_up_proj, module.down_proj, e), rtol=1e-12,
                                       atol=1e-12)


def test_qwen3_next_shards_are_contiguous_key_head_groups_of_the_checkpoint(sharded):
    """Qwen3-Next stores in_proj_qkvz / in_proj_ba grouped per key head: rank r's shard is the r-th contiguous
    chunk of the checkpoint's rows, reordered as a model of n_k / tp key heads reorders it."""
    if sharded['hf_config'].architectures[0] != 'Qwen3NextForCausalLM':
        pytest.skip('Qwen3-Next only')
    import glob
    text, tp = text_config_of(sharded['hf_config']), sharded['geometry'].tp
    nk, nv = text.linear_num_key_heads // tp, text.linear_num_value_heads // tp
    checked = 0
    for file in glob.glob(f'{sharded["path"]}/*.safetensors'):
        with safe_open(file, 'pt') as f:
            for key in f.keys():
                if not key.endswith(('in_proj_qkvz.weight', 'in_proj_ba.weight')):
                    continue
                for r, chunk in enumerate(f.get_tensor(key).chunk(tp, dim=0)):
                    if key.endswith('qkvz.weight'):
                        want = interleaved_qkvz_to_blocked(chunk, nk, text.linear_key_head_dim, nv,
                                                           text.linear_value_head_dim)
                    else:
                        want = interleaved_ba_to_blocked(chunk, nk, nv)
                    assert torch.equal(sharded['shards'][r][key], want), key
                    checked += 1
    assert checked == 2 * tp * text.layer_types.count('linear_attention')


def test_the_plan_refuses_a_parameter_it_does_not_know(sharded):
    model = copy.deepcopy(sharded['model'])
    model.register_parameter('mystery', torch.nn.Parameter(torch.zeros(2), requires_grad=False))
    with pytest.raises(ValueError, match=r"does not know \['mystery'\]"):
        tp_shard_plan(model, sharded['geometry'])
