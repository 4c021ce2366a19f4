"""Host cost of one chunked gated-delta-rule call through fla, next to its device time.

In-prefill checkpoints split a long prefill's gated delta rule into rounds (one kernel call each). On the H200 a
cold 16K-token prompt of the Qwen3-Next-shaped model then left the device idle ~20 ms longer, with fla's autograd
function at ~1.4 ms of host time per call against ~0.5 ms of device time for a 4K-token round
(scripts/profile_cold_prefill.py). This script times, per call (host: enqueue time without synchronising; device:
CUDA events), fla's public entry point, the engine's kernel wrapper, and a bare Triton launch for scale, then
prints a cProfile of the fla calls (where the host time goes).

    python3 scripts/profile_fla_host.py [--tokens 4096] [--out DIR]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

HK, HV, D = 16, 32, 128  # Qwen3-Next's gated DeltaNet: 16 key heads, 32 value heads of 128


@triton.jit
def _noop_kernel(x_ptr):
    tl.store(x_ptr, 1.0)


def host_and_device_ms(fn, reps: int) -> tuple[float, float]:
    """Median host enqueue time per call (no synchronisation between calls) and device time per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e3)
    end.record()
    torch.cuda.synchronize()
    return statistics.median(host), start.elapsed_time(end) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--tokens', type=int, default=4096)
    p.add_argument('--reps', type=int, default=30)
    p.add_argument('--out', default=None)
    args = p.parse_args()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    from lmdeploy.pytorch.kernels.cuda import gated_delta_rule as gdr
    out = open(os.path.join(args.out, 'profile_fla_host.txt'), 'w') if args.out else sys.stdout
    torch.manual_seed(0)
    dev, t = 'cuda', args.tokens
    q, k = (torch.randn(t, HK, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(t, HV, D, device=dev, dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(t, HV, device=dev) + 2)
    beta = torch.rand(t, HV, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor([0, t], device=dev)
    indices = gdr.chunk_indices_host([t]).to(dev)
    init = torch.zeros(1, HV, D, D, device=dev)
    pool = torch.zeros(4, HV, D, D, device=dev)
    ids, fresh = torch.tensor([1], device=dev), torch.tensor([False], device=dev)
    flag = torch.zeros(1, device=dev)

    def raw():
        return fla_chunk(q[None], k[None], v[None], g=g[None], beta=beta[None], scale=D ** -0.5,
                         initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         cu_seqlens=cu, chunk_indices=indices)

    cases = [
        ('bare Triton launch', lambda: _noop_kernel[(1,)](flag)),
        ('fla chunk_gated_delta_rule', raw),
        ('fla, under torch.inference_mode', lambda: torch.inference_mode()(raw)()),
        ('engine wrapper (pool in/out)', lambda: gdr.chunk_gated_delta_rule(
            q, k, v, g, beta, cu, pool, ids, fresh, chunk_indices=indices)),
    ]
    print(f'{t} tokens, {HK} key / {HV} value heads of {D}, bf16; per call:', file=out)
    for name, fn in cases:
        host, device = host_and_device_ms(fn, args.reps)
        print(f'  {name:34s} host {host:7.3f} ms   device {device:7.3f} ms', file=out, flush=True)

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(args.reps):
        raw()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats('tottime').print_stats(30)
    print(f'cProfile of {args.reps} fla calls, by own time:', file=out)
    print(buf.getvalue(), file=out)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats('cumulative').print_stats(40)
    print(f'cProfile of {args.reps} fla calls, by cumulative time:', file=out)
    print(buf.getvalue(), file=out, flush=True)


if __name__ == '__main__':
    main()
