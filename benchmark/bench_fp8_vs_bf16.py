"""FP8 against bf16 weights on a real-depth model shape, with dummy weights (`load_format='dummy'`): weight memory,
decode tokens/s at batch 1 and 64, cold TTFT of an 8K-token prompt.

Shapes (config.json written to a temp folder; no checkpoint needed):
  - `qwen3.5-35b-a3b` (default): 40 layers (3 gated DeltaNet : 1 attention), hidden 2048, 256 experts top-8,
    moe 512, shared 512; ~67 GiB in bf16, ~35 GiB in FP8: both fit one H200.
  - `qwen3-next-80b`: 48 layers, 512 experts top-10; ~149 GiB in bf16 (refused before allocating, with the estimate)
    and ~79 GiB in FP8: the start-up check for the full-size model on one H200.
The FP8 variant adds the releases' `quantization_config` (blocks 128x128, routers / shared-expert gates / DeltaNet
b,a projections / lm_head left bf16). Decode: B requests of 128 prompt tokens, then tokens/s over 64 decode steps
(CUDA graphs on). TTFT: one 8192-token prompt, prefix caching off, after a warm-up request. Greedy; no eos.

    python benchmark/bench_fp8_vs_bf16.py [--shape qwen3.5-35b-a3b|qwen3-next-80b] [--weights bf16 fp8]
    python benchmark/bench_fp8_vs_bf16.py --smoke     # a 2-layer shape on the CPU: checks the logic only
    python benchmark/bench_fp8_vs_bf16.py --shape qwen3-next-80b --weights bf16 fp8 --startup-only  # does it fit

Prints one line per measurement, a markdown table and a JSON line. A few minutes per shape on an H200.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmdeploy.messages import PytorchEngineConfig  # noqa: E402
from lmdeploy.pytorch.engine.engine import Engine  # noqa: E402
from lmdeploy.pytorch.messages import SamplingParams  # noqa: E402

_COMMON = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, moe_intermediate_size=512,
               shared_expert_intermediate_size=512, full_attention_interval=4, rms_norm_eps=1e-6,
               max_position_embeddings=32768, hidden_act='silu', tie_word_embeddings=False, eos_token_id=None,
               bos_token_id=None, torch_dtype='bfloat16', norm_topk_prob=True, attention_bias=False)
SHAPES = {
    'smoke': dict(_COMMON, architectures=['Qwen3_5MoeForCausalLM'], model_type='qwen3_5_moe_text', hidden_size=256,
                  head_dim=64, num_attention_heads=4, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=64, linear_value_head_dim=64, moe_intermediate_size=128,
                  shared_expert_intermediate_size=128, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                  vocab_size=1024, rope_parameters={'rope_type': 'default', 'rope_theta': 10000000.0,
                                                    'partial_rotary_factor': 0.25}),
    'qwen3.5-35b-a3b': dict(_COMMON, architectures=['Qwen3_5MoeForCausalLM'], model_type='qwen3_5_moe_text',
                            num_hidden_layers=40, num_experts=256, num_experts_per_tok=8, vocab_size=248320,
                            rope_parameters={'rope_type': 'default', 'rope_theta': 10000000.0,
                                             'partial_rotary_factor': 0.25}),
    'qwen3-next-80b': dict(_COMMON, architectures=['Qwen3NextForCausalLM'], model_type='qwen3_next',
                           num_hidden_layers=48, num_experts=512, num_experts_per_tok=10, vocab_size=151936,
                           intermediate_size=5120, decoder_sparse_step=1, mlp_only_layers=[],
                           rope_theta=10000000.0, partial_rotary_factor=0.25),
}
FP8_CONFIG = {'quant_method': 'fp8', 'weight_block_size': [128, 128], 'activation_scheme': 'dynamic',
              'modules_to_not_convert': ['lm_head', 'mlp.gate', 'shared_expert_gate', 'in_proj_ba', 'in_proj_b',
                                         'in_proj_a', 'mtp.fc']}


def write_config(shape: str, weights: str, folder: str) -> str:
    config = dict(SHAPES[shape])
    if weights == 'fp8':
        config['quantization_config'] = FP8_CONFIG
    with open(os.path.join(folder, 'config.json'), 'w') as f:
        json.dump(config, f)
    return folder


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_tokens_per_s(engine: Engine, batch: int, vocab: int, steps: int = 64) -> float:
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, vocab, (128,), generator=gen).tolist() for _ in range(batch)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=steps + 16))
    while len(engine.scheduler.running) < batch or any(len(s.token_ids) <= 128 for s in engine.scheduler.running):
        engine.step()
    for _ in range(4):  # settle into pure decode batches
        engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    elapsed = time.perf_counter() - start
    engine.run_until_idle()
    return batch * steps / elapsed


def cold_ttft_s(engine: Engine, vocab: int, length: int = 8192) -> float:
    prompt = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    first = []
    sync()
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_new_tokens=1),
                       callback=lambda out: first.append(time.perf_counter()) if out.new_token_ids else None)
    while not first:
        engine.step()
    engine.run_until_idle()
    return first[0] - start


def measure(shape: str, weights: str, device: str, ttft_tokens: int, steps: int, startup_only: bool = False
            ) -> dict:
    row = {'shape': shape, 'weights': weights}
    cuda = device == 'cuda'
    with tempfile.TemporaryDirectory() as folder:
        write_config(shape, weights, folder)
        if cuda:
            torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated() if cuda else 0
        config = PytorchEngineConfig(device_type=device, dtype='bfloat16', load_format='dummy', max_batch_size=64,
                                     max_prefill_token_num=8192, session_len=16384, cache_max_entry_count=0.5,
                                     num_gpu_blocks=0 if cuda else 512)
        try:
            start = time.perf_counter()
            engine = Engine(folder, config)
        except ValueError as err:  # e.g. the weights do not fit: the estimate says so before allocating
            row['error'] = str(err)
            print(row, flush=True)
            return row
        row['startup_s'] = time.perf_counter() - start
        row['weight_gib'] = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**30
        params = list(engine.model.parameters())
        row['fp8_param_share'] = sum(p.numel() for p in params if p.dtype == torch.float8_e4m3fn) / sum(
            p.numel() for p in params)
        row['allocated_gib'] = ((torch.cuda.memory_allocated() if cuda else 0) - before) / 2**30
        vocab = SHAPES[shape]['vocab_size']
        engine.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=4))  # it starts, and it generates
        engine.run_until_idle()
        if startup_only:
            print(row, flush=True)
            del engine
            gc.collect()
            return row
        cold_ttft_s(engine, vocab, 1024)
        row['ttft_8k_ms'] = 1000 * cold_ttft_s(engine, vocab, ttft_tokens)
        for batch in (1, 64):
            row[f'decode_b{batch}_tok_s'] = decode_tokens_per_s(engine, batch, vocab, steps)
        print(row, flush=True)
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--shape', choices=sorted(set(SHAPES) - {'smoke'}), default='qwen3.5-35b-a3b')
    parser.add_argument('--weights', nargs='+', choices=['bf16', 'fp8'], default=['bf16', 'fp8'])
    parser.add_argument('--smoke', action='store_true', help='tiny shape on the CPU (checks the logic only)')
    parser.add_argument('--startup-only', action='store_true',
                        help='start the engine and generate 4 tokens; no TTFT or decode measurement')
    args = parser.parse_args()
    device = 'cpu' if args.smoke else 'cuda'
    shape, ttft_tokens, steps = ('smoke', 256, 4) if args.smoke else (args.shape, 8192, 64)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}  torch {torch.__version__}  "
          f"LMDEPLOY_FP8_GEMM={os.environ.get('LMDEPLOY_FP8_GEMM', 'triton')}", flush=True)
    rows = [measure(shape, weights, device, ttft_tokens, steps, args.startup_only) for weights in args.weights]
    print('\n| shape | weights | weight GiB | start-up s | decode b1 tok/s | decode b64 tok/s | cold TTFT 8K ms |')
    print('|---|---|---|---|---|---|---|')
    for r in rows:
        if 'error' in r:
            print(f"| {r['shape']} | {r['weights']} | {r['error']} | | | | |")
            continue
        if 'ttft_8k_ms' not in r:  # --startup-only
            print(f"| {r['shape']} | {r['weights']} | {r['weight_gib']:.1f} | {r['startup_s']:.0f} | | | |")
            continue
        print(f"| {r['shape']} | {r['weights']} | {r['weight_gib']:.1f} | {r['startup_s']:.0f} | "
              f"{r['decode_b1_tok_s']:.1f} | {r['decode_b64_tok_s']:.0f} | {r['ttft_8k_ms']:.0f} |")
    print(json.dumps(rows))


if __name__ == '__main__':
    main()
