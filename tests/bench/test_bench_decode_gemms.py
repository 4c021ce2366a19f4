"""`benchmark/bench_decode_gemms.py --smoke`: the engine model's linears, grouped by weight shape with their count
per forward, hold exactly the 2-D matmul weights of the transformers model of the same config (the experts' 3-D
weights and the embedding aside), so the per-forward GEMM table covers every dense GEMM of a decode step."""
from __future__ import annotations

import pytest
from bench_scripts import bench_script

transformers = pytest.importorskip('transformers')


@pytest.mark.parametrize('shape', ['qwen3.5-9b', 'qwen3.5-35b-a3b', 'qwen3-next-80b'])
def test_linear_groups_cover_the_reference_models_dense_weights(shape):
    with bench_script('bench_decode_gemms') as module:
        groups = module.main(['--smoke', '--shape', shape])
        args = module.argparse.Namespace(shape=shape, experts=64, smoke=True)
        config, model_name, _ = module.make_config(args)
    with module.torch.device('meta'):
        reference = getattr(transformers, model_name)(config)
    want = sum(p.numel() for name, p in reference.named_parameters()
               if p.dim() == 2 and 'embed_tokens' not in name and 'experts.' not in name)
    assert sum(out_f * in_f * count for (out_f, in_f), count, _ in groups) == want
    assert [count for (out_f, _), count, names in groups if names == ['lm_head']] == [1]
