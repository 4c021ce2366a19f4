"""The small ops of one Qwen3.5-9B prefill forward (`--tokens` tokens, bf16) on the device: the fused prefill kernels
(the default; called directly here) against the sequence `LMDEPLOY_FUSED_PREFILL=0` runs, in ms per call and
in GB/s of the bytes the fused form must move (every input read once, every output written once), beside the
device's copy bandwidth (a `clone` of 1 GiB).

- `silu_and_mul`: the MLP activation on `gate_up_proj`'s output [T, 2 * 12288] (torch: `F.silu(gate) * up`);
- `sigmoid_gate_mul`: gated attention's output gate, gate = per-head slices of `q_proj`'s output (16 heads x 256);
- `gated_rms_norm`: the DeltaNet output norm, z = heads of a channel slice of `in_proj_qkvz`'s output (32 x 128):
  `rms_norm_rows` (z in place, 16 rows per program) against `rms_norm` (copies z, one row per program);
- `add_rms_norm` [T, 4096]: `rms_norm_rows` against `rms_norm`;
- the conv over the 8192 conv channels: `causal_conv1d_planes` (q / k / v contiguous) against the plain [T, C]
  output + three `.contiguous()` of its channel slices (what fla's input guard makes of them).
Each op is checked against its reference (max abs error) before timing.

    python benchmark/bench_prefill_small_ops.py                 # 8192 tokens, ~10 s on an H200
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def timed_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth_gbs() -> float:
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device='cuda')  # 1 GiB
    return 2 * x.numel() * 2 / timed_ms(lambda: x.clone(), 10) / 1e6


def report(name: str, fused, reference, num_bytes: int, iters: int, peak: float) -> None:
    a, b = fused(), reference()
    a, b = (a if isinstance(a, (tuple, list)) else (a,)), (b if isinstance(b, (tuple, list)) else (b,))
    err = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))
    ms_fused, ms_ref = timed_ms(fused, iters), timed_ms(reference, iters)
    gbs = num_bytes / ms_fused / 1e6
    print(f'{name:18s} fused {ms_fused * 1e3:8.1f} us  torch {ms_ref * 1e3:8.1f} us  x{ms_ref / ms_fused:5.2f}  '
          f'{gbs:7.0f} GB/s ({gbs / peak:4.0%} of copy)  max err {err:.2e}')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--tokens', type=int, default=8192)
    parser.add_argument('--iters', type=int, default=20)
    args = parser.parse_args()
    from lmdeploy.pytorch.kernels.cuda import activation, causal_conv1d, rms_norm, rms_norm_rows
    T, it, dt, dev = args.tokens, args.iters, torch.bfloat16, 'cuda'
    peak = copy_bandwidth_gbs()
    print(f'{torch.cuda.get_device_name()}: {T} tokens, copy bandwidth {peak:.0f} GB/s')
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dt)

    gate_up = randn(T, 2 * 12288)
    report('silu_and_mul', lambda: activation.silu_and_mul(gate_up),
           lambda: (lambda g, u: F.silu(g) * u)(*gate_up.chunk(2, -1)), 3 * T * 12288 * 2, it, peak)
    attn, q_gate = randn(T, 16, 256), randn(T, 16, 512)
    gate = q_gate.chunk(2, -1)[1]
    report('sigmoid_gate_mul', lambda: activation.sigmoid_gate_mul(attn, gate),
           lambda: attn * torch.sigmoid(gate), 3 * T * 4096 * 2, it, peak)
    o, qkvz, w = randn(T, 32, 128), randn(T, 8192 + 4096), randn(128)
    z = qkvz[:, 8192:].unflatten(-1, (32, 128))
    report('gated_rms_norm', lambda: rms_norm_rows.gated_rms_norm(o, z, w, 1e-6),
           lambda: rms_norm.gated_rms_norm(o, z, w, 1e-6), 3 * T * 4096 * 2, it, peak)
    x, res, w = randn(T, 4096), randn(T, 4096), randn(4096)
    report('add_rms_norm', lambda: rms_norm_rows.add_rms_norm(x, res, w, 1e-6, True),
           lambda: rms_norm.add_rms_norm(x, res, w, 1e-6, True), 4 * T * 4096 * 2, it, peak)
    conv_in, cw = randn(T, 8192 + 4096 + 4096)[:, :8192], randn(8192, 4)
    pool = torch.zeros(4, 8192, 3, device=dev, dtype=dt)
    ids, fresh = torch.tensor([1], device=dev), torch.tensor([True], device=dev)
    cu = torch.tensor([0, T], device=dev)
    splits = (2048, 2048, 4096)

    def planes():
        return causal_conv1d.causal_conv1d_planes(conv_in, cw, None, pool, ids, fresh, cu, splits, 'silu')

    def plain_then_copies():
        out = causal_conv1d.causal_conv1d(conv_in, cw, None, pool, ids, fresh, cu, 'silu')
        return [p.contiguous() for p in out.split(splits, -1)]
    report('conv1d q/k/v', planes, plain_then_copies, 2 * T * 8192 * 2, it, peak)


if __name__ == '__main__':
    main()
