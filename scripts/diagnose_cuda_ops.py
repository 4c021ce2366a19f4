"""Which cuda-backend op makes a model's logits differ from the default backend? Runs the engine on CUDA with the
cuda backend minus one op at a time (that op falls back to the default torch implementation) and prints the max
logits error of each variant against the all-default run."""
from __future__ import annotations

import sys
import tempfile

import torch

from lmdeploy.demo_model import save_tiny_model
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.backends import cuda as cuda_backend
from lmdeploy.pytorch.backends.base import OpType
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams


def logits_of(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    engine = Engine(path, PytorchEngineConfig(device_type='cuda', dtype='float32', block_size=16,
                                              num_gpu_blocks=256, max_prefill_token_num=64))
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=1), collect_logits=True) for p in prompts]
    engine.run_until_idle()
    return [engine.pop_collected_logits(i) for i in ids]


def main() -> None:
    arch = sys.argv[1] if len(sys.argv) > 1 else 'qwen3_5'
    path = save_tiny_model(tempfile.mkdtemp(), arch=arch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (1, 7, 70)]
    full = dict(cuda_backend.BACKEND._builders)
    cuda_backend.BACKEND._builders = {}
    ref = logits_of(path, prompts)
    variants = [('all-cuda', None)] + [(f'without {op.name}', op) for op in full]
    for name, op in variants:
        cuda_backend.BACKEND._builders = {k: v for k, v in full.items() if k != op}
        try:
            got = logits_of(path, prompts)
            err = max((a - b).abs().max().item() for a, b in zip(got, ref))
            print(f'{arch} {name:28s} max err {err:.3e}', flush=True)
        except Exception as exc:
            print(f'{arch} {name:28s} FAILED {type(exc).__name__}: {exc}', flush=True)
    only = [op for op in full if op not in (OpType.PagedAttention, OpType.CacheBlockCopy)]
    for op in only:
        cuda_backend.BACKEND._builders = {op: full[op]}
        try:
            got = logits_of(path, prompts)
            err = max((a - b).abs().max().item() for a, b in zip(got, ref))
            print(f'{arch} only {op.name:23s} max err {err:.3e}', flush=True)
        except Exception as exc:
            print(f'{arch} only {op.name:23s} FAILED {type(exc).__name__}: {exc}', flush=True)


if __name__ == '__main__':
    main()
