"""Block-wise FP8 GEMMs on the GPU: the Triton kernel against torch's `_scaled_mm` (where a block-scale layout works)
and the bf16 matmul, on the linear and MoE shapes of Qwen3-Next-80B / Qwen3.5-35B-A3B (hidden 2048), at 1, 64 and
8192 tokens. Every FP8 result is first checked against the torch reference (`kernels/default/blocked_fp8.py`); the
FP8 times include the activation quantization. The winner per shape says which `LMDEPLOY_FP8_GEMM` default to keep.
The linear GEMMs are first autotuned as the engine does at start-up (timed); the table gives the tuned tile and the
time with the fixed tile used before autotuning (`fixed_tile`).

    python benchmark/bench_fp8_gemm.py            # ~1 minute on an H200; prints a markdown table and a JSON line
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmdeploy.pytorch.backends.default.moe import fused_moe as ref_moe  # noqa: E402
from lmdeploy.pytorch.kernels.cuda import blocked_fp8 as cuda_fp8  # noqa: E402
from lmdeploy.pytorch.kernels.cuda.blocked_fp8_moe import fused_moe_blocked_fp8  # noqa: E402
from lmdeploy.pytorch.kernels.cuda.moe import fused_moe  # noqa: E402
from lmdeploy.pytorch.kernels.default import blocked_fp8 as ref  # noqa: E402

BLOCK = (128, 128)
# (name, out features, in features): attention qkv+gate, o_proj, gated-delta in/out, shared expert, lm_head-sized
LINEARS = [('attn qkv+gate', 9216, 2048), ('attn o_proj', 2048, 4096), ('gdn in_proj_qkvz', 12288, 2048),
           ('gdn out_proj', 2048, 4096), ('shared gate_up', 1024, 2048), ('dense 8192x2048', 8192, 2048)]
MOES = [('qwen3-next 512e top10', 512, 10, 512), ('qwen3.5-35b 256e top8', 256, 8, 512)]


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape[-2:]
    blocks = w.float().unflatten(-1, (k // BLOCK[1], BLOCK[1])).unflatten(-3, (n // BLOCK[0], BLOCK[0]))
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / ref.FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).to(ref.FP8_DTYPE).flatten(-4, -3).flatten(-2, -1)
    return q, scale


def bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def linear_rows(tokens_list: list[int]) -> list[dict]:
    rows = []
    for name, n, k in LINEARS:
        w = torch.randn(n, k, device='cuda') * 0.02
        wq, ws = quantize(w)
        w16 = w.bfloat16()
        for tokens in tokens_list:
            x = torch.randn(tokens, k, device='cuda').bfloat16()
            expected = ref.linear_blocked_fp8(x.float(), wq, ws, None, BLOCK)
            got = cuda_fp8.linear_blocked_fp8(x, wq, ws, None, BLOCK)
            err = ((got.float() - expected).norm() / expected.norm()).item()
            fixed = cuda_fp8.fixed_tile(tokens)
            row = {'kind': 'linear', 'shape': name, 'tokens': tokens, 'N': n, 'K': k, 'rel_err_triton': err,
                   'bf16_ms': bench(partial(torch.nn.functional.linear, x, w16)),
                   'triton_fp8_ms': bench(partial(cuda_fp8.linear_blocked_fp8, x, wq, ws, None, BLOCK)),
                   'fixed_fp8_ms': bench(partial(cuda_fp8.linear_blocked_fp8, x, wq, ws, None, BLOCK, tile=fixed)),
                   'tile': tuned_tile(n, k, tokens), 'fixed_tile': fixed}
            if cuda_fp8.torch_scaled_mm_supported(x.device):
                got_t = cuda_fp8.linear_blocked_fp8(x, wq, ws, None, BLOCK, use_torch=True)
                row['rel_err_torch'] = ((got_t.float() - expected).norm() / expected.norm()).item()
                row['torch_fp8_ms'] = bench(partial(cuda_fp8.linear_blocked_fp8, x, wq, ws, None, BLOCK,
                                                    use_torch=True))
            rows.append(row)
            print(row, flush=True)
    return rows


def tuned_tile(n: int, k: int, tokens: int) -> str:
    """The autotuner's choice for this (N, K, row bucket), as BLOCK_M x BLOCK_N / warps / stages."""
    tile = cuda_fp8.tuned_tile(n, k, tokens, BLOCK, torch.bfloat16)
    if tile is None:
        return 'fixed' if not cuda_fp8.AUTOTUNE else 'untuned'
    return f'{tile[0]}x{tile[1]}/w{tile[2]}/s{tile[3]}'


def tune(tokens_list: list[int]) -> None:
    """What the engine does at start-up (`ModelAgent.tune_kernels`), for the linear shapes here, timed."""
    shapes = {(n, k, BLOCK) for _, n, k in LINEARS}
    began = time.perf_counter()
    keys = cuda_fp8.tune_blocked_gemm_fp8(shapes, max(tokens_list), torch.bfloat16, torch.device('cuda', 0))
    print(f'start-up autotuning: {keys} keys ({len(shapes)} shapes x row buckets up to '
          f'{cuda_fp8.m_bucket(max(tokens_list))}) in {time.perf_counter() - began:.1f} s '
          '(first start in this process: includes compiling each tile)', flush=True)


def moe_rows(tokens_list: list[int]) -> list[dict]:
    rows = []
    hidden = 2048
    for name, experts, top_k, inter in MOES:
        gate_up = torch.randn(experts, 2 * inter, hidden, device='cuda') * 0.02
        down = torch.randn(experts, hidden, inter, device='cuda') * 0.02
        (gu_q, gu_s), (d_q, d_s) = quantize(gate_up), quantize(down)
        gu16, d16 = gate_up.bfloat16(), down.bfloat16()
        del gate_up, down
        for tokens in tokens_list:
            x = torch.randn(tokens, hidden, device='cuda').bfloat16()
            weights, ids = torch.randn(tokens, experts, device='cuda').softmax(-1).topk(top_k, dim=-1)
            got = fused_moe_blocked_fp8(x, gu_q, d_q, weights, ids, gu_s, d_s, BLOCK)
            if tokens <= 64:  # the torch reference loops over experts: fine for small batches
                expected = ref.fused_moe_blocked_fp8(x.float(), gu_q, d_q, weights, ids, gu_s, d_s, BLOCK)
                err = ((got.float() - expected).norm() / expected.norm()).item()
            else:
                expected = ref_moe(x, gu16, d16, weights, ids).float()
                err = ((got.float() - expected).norm() / expected.norm()).item()  # includes quantization error
            rows.append({'kind': 'moe', 'shape': name, 'tokens': tokens, 'rel_err_triton': err,
                         'bf16_ms': bench(partial(fused_moe, x, gu16, d16, weights, ids)),
                         'triton_fp8_ms': bench(partial(fused_moe_blocked_fp8, x, gu_q, d_q, weights, ids, gu_s, d_s,
                                                        BLOCK))})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--tokens', type=int, nargs='+', default=[1, 64, 8192])
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f'device: {torch.cuda.get_device_name()}  torch {torch.__version__}  scaled_mm block layout: '
          f'{cuda_fp8.torch_scaled_mm_supported(torch.device("cuda", 0))}')
    tune(args.tokens)
    rows = linear_rows(args.tokens) + moe_rows(args.tokens)
    print('\n| kind | shape | tokens | bf16 ms | triton fp8 ms (tuned) | fp8 / bf16 | tuned tile | fixed-tile fp8 ms '
          '| torch fp8 ms | rel err (triton / torch) |')
    print('|---|---|---|---|---|---|---|---|---|---|')
    for r in rows:
        torch_ms = f"{r['torch_fp8_ms']:.4f}" if 'torch_fp8_ms' in r else 'n/a'
        torch_err = f"{r['rel_err_torch']:.1e}" if 'rel_err_torch' in r else 'n/a'
        fixed_ms = f"{r['fixed_fp8_ms']:.4f}" if 'fixed_fp8_ms' in r else 'n/a'
        print(f"| {r['kind']} | {r['shape']} | {r['tokens']} | {r['bf16_ms']:.4f} | {r['triton_fp8_ms']:.4f} | "
              f"{r['triton_fp8_ms'] / r['bf16_ms']:.2f}x | {r.get('tile', 'n/a')} | {fixed_ms} | {torch_ms} | "
              f"{r['rel_err_triton']:.1e} / {torch_err} |")
    print(json.dumps(rows))


if __name__ == '__main__':
    main()
