"""Prefill attention on the device: the engine's Triton kernel (`paged_prefill_attention`, over the paged pool)
against torch SDPA (flash and cuDNN backends) and flash-attn (where importable) over contiguous K/V, in TFLOP/s
beside the device's bf16 matmul rate (`torch.mm` 8192^3).

Cases (GQA `--heads` : `--kv-heads`, bf16, pages of `--page-size` tokens in shuffled order, as the pool hands them):
- `cold T`: a T-token prompt as the engine runs it, in forwards of `--chunk` tokens (chunk i attends to the i
  chunks before it and causally to itself); the time is the sum over the chunks. T = chunk is one square causal
  forward. For SDPA / flash-attn the K/V of every chunk's context are gathered from the pool first: the gather is
  timed separately (`gather ms`), since the engine would pay it.
- `suffix`: `--suffix` new tokens after a non-aligned cached prefix of `--prefix` tokens (the graph bucket 128 as
  the token count); Triton with its split rule, a tile per query head and with grouped query heads packed into
  their KV head's tiles (`pack_gqa`, the default), and the unsplit launch (`S=1`).
FLOPs = 4 * Hq * D * (keys each query attends to, summed). Every Triton config of `--sweep` (BLOCK_M, BLOCK_N,
num_warps, num_stages) runs the cold cases; the best per head_dim is printed last, to paste into
`prefill_attention_config`. Outputs are checked against SDPA (max abs error) once per case.

    python benchmark/bench_prefill_attention.py                       # 8K and 32K, D 256 and 128
    python benchmark/bench_prefill_attention.py --seq-lens 8192 --head-dims 256 --no-sweep
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from real_depth_floors import measure_device  # noqa: E402

from lmdeploy.pytorch.kernels.cuda.gathered_prefill_attention import gathered_prefill_attention  # noqa: E402
from lmdeploy.pytorch.kernels.cuda.paged_prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    prefill_attention_config,
)

SWEEP = {  # padded head_dim -> (BLOCK_M, BLOCK_N, num_warps, num_stages), besides the default config
    128: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3)],
    256: [(64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 3)],
}
DEVICE = 'cuda'  # 'cpu' with --smoke (TRITON_INTERPRET=1, tiny shapes: checks the script's logic only)


def timed(fn, reps: int) -> float:
    """Median milliseconds of `reps` runs after one warm-up (CUDA events; the wall clock on the CPU)."""
    fn()
    times = []
    for _ in range(reps):
        if DEVICE == 'cpu':
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


class Pool:
    """A paged K/V pool holding one sequence of `kv_len` tokens in shuffled pages, and its query rows."""

    def __init__(self, kv_len: int, args, head_dim: int):
        dev = DEVICE
        gen = torch.Generator(device=dev).manual_seed(kv_len + head_dim)
        kbs = args.page_size
        dtype = torch.float16 if dev == 'cpu' else torch.bfloat16  # (the interpreter's bf16 dot is broken)
        num_pages = -(-kv_len // kbs)
        pool = torch.randn(num_pages, 2, kbs, args.kv_heads, head_dim, generator=gen, device=dev, dtype=dtype)
        self.k_cache, self.v_cache = pool[:, 0], pool[:, 1]
        self.table = torch.randperm(num_pages, generator=gen, device=dev)
        self.q = torch.randn(kv_len, args.heads, head_dim, generator=gen, device=dev, dtype=dtype)
        self.head_dim, self.scale = head_dim, head_dim ** -0.5
        self.lens: dict = {}

    def gather(self, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        pages = self.table[:-(-kv_len // self.k_cache.size(1))]
        return (self.k_cache[pages].flatten(0, 1)[:kv_len], self.v_cache[pages].flatten(0, 1)[:kv_len])

    def triton(self, q_rows: slice, kv_len: int, **kwargs) -> torch.Tensor:
        q = self.q[q_rows]
        q_len = q.size(0)
        if (q_len, kv_len) not in self.lens:  # device tensors made once: no host copy inside a timed call
            self.lens[q_len, kv_len] = [torch.tensor(x, device=q.device) for x in ([0, q_len], [q_len], [kv_len])]
        cu, q_lens, kv_lens = self.lens[q_len, kv_len]
        return paged_prefill_attention(q, self.k_cache, self.v_cache, self.table[None], cu, q_lens, kv_lens, q_len,
                                       self.scale, **kwargs)


def sdpa(backend_name: str):
    """SDPA restricted to one backend (an error, not a silent fallback, where it cannot run): causal, bottom-right
    aligned (query i at position kv_len - q_len + i); q [Tq, Hq, D], k / v [Tk, Hkv, D]. GQA by `enable_gqa`, or
    (a backend without it) K / V expanded per query head first, outside the timed call's kernel but inside it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    backend = getattr(SDPBackend, backend_name)
    state = {'expand': False}

    def call(q, k, v, scale):
        q_, k_, v_ = (x.transpose(0, 1)[None] for x in (q, k, v))
        if state['expand']:
            group = q.size(1) // k.size(1)
            k_, v_ = k_.repeat_interleave(group, 1), v_.repeat_interleave(group, 1)
        kwargs = {'is_causal': True} if q.size(0) == k.size(0) else {
            'attn_mask': causal_lower_right(q.size(0), k.size(0))}
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q_, k_, v_, scale=scale, enable_gqa=not state['expand'],
                                                  **kwargs)[0].transpose(0, 1)

    def run(q, k, v, scale):
        try:
            return call(q, k, v, scale)
        except RuntimeError:
            if state['expand']:
                raise
            state['expand'] = True  # no GQA in this backend: expanded K / V from now on
            return call(q, k, v, scale)
    run.state = state
    return run


sdpa_flash = sdpa('FLASH_ATTENTION')
BACKENDS = (('sdpa flash', sdpa_flash), ('sdpa cudnn', sdpa('CUDNN_ATTENTION')))


def guarded(label: str, name: str, fn) -> None:
    try:
        fn()
    except Exception as exc:  # a backend that cannot run this shape: say so and go on
        print(f'{label:18s} {name:28s} failed: {type(exc).__name__}: {str(exc)[:200]}', flush=True)


def flash_attn_fn():
    with contextlib.suppress(ImportError):
        from flash_attn import flash_attn_func
        return lambda q, k, v, scale: flash_attn_func(q[None], k[None], v[None], softmax_scale=scale,
                                                      causal=True)[0]
    return None


def attended(history: int, q_len: int) -> int:
    return q_len * history + q_len * (q_len + 1) // 2


def chunks(total: int, chunk: int) -> list[tuple[int, int]]:
    """(history, q_len) of the engine's forwards of a `total`-token prompt."""
    return [(h, min(chunk, total - h)) for h in range(0, total, chunk)]


def cold_case(pool: Pool, total: int, args, cfgs, results: dict) -> None:
    parts = chunks(total, args.chunk)
    flops = sum(4 * args.heads * pool.head_dim * attended(h, n) for h, n in parts)
    label = f'cold {total} D{pool.head_dim}'

    def run_triton(cfg=None):
        for h, n in parts:
            pool.triton(slice(h, h + n), h + n, config=cfg)

    def run_ref(fn):
        for h, n in parts:
            k, v = pool.gather(h + n)
            fn(pool.q[h:h + n], k, v, pool.scale)

    h, n = parts[-1]
    k, v = pool.gather(h + n)
    ref = pool.triton(slice(h, h + n), h + n, num_splits=1).float()
    with contextlib.suppress(Exception):  # errors against SDPA where it runs, else against the default config
        ref = sdpa_flash(pool.q[h:h + n], k, v, pool.scale).float()
    del k, v
    for cfg in cfgs:
        name = 'triton ' + cfg_name(cfg)
        try:
            err = (pool.triton(slice(h, h + n), h + n, config=cfg).float() - ref).abs().max().item()
            ms = timed(lambda cfg=cfg: run_triton(cfg), args.reps)
        except Exception as exc:  # out of shared memory / registers for this tile: report and go on
            print(f'{label:18s} {name:28s} failed: {type(exc).__name__}: {str(exc)[:80]}', flush=True)
            continue
        report(label, name, ms, flops, args, f'max err {err:.1e}')
        if cfg is not None:
            results.setdefault(pool.head_dim, {}).setdefault(tuple(cfg.values()), []).append(flops / ms)
    gather_ms = timed(lambda: [pool.gather(hh + nn) for hh, nn in parts], args.reps)
    print(f'{label:18s} {"gather K/V (pool->contig)":28s} {gather_ms:9.2f} ms', flush=True)
    for name, fn in BACKENDS:
        guarded(label, name, lambda name=name, fn=fn: report(label, name, timed(lambda: run_ref(fn), args.reps), flops,
                                                             args, '(+ gather' + (', expanded K/V)' if fn.state[
                                                                 'expand'] else ')')))

    def run_gathered():
        for hh, nn in parts:
            gathered_prefill_attention(pool.q[hh:hh + nn], pool.k_cache, pool.v_cache, pool.table[None], [nn],
                                       [hh + nn], pool.scale)
    guarded(label, 'gathered (LMDEPLOY_PREFILL_ATTN)', lambda: report(
        label, 'gathered (engine opt-in)', timed(run_gathered, args.reps), flops, args, '(gather included)'))
    fa = flash_attn_fn()
    if fa is not None:
        guarded(label, 'flash-attn', lambda: report(label, 'flash-attn', timed(lambda: run_ref(fa), args.reps), flops,
                                                    args, '(+ gather)'))


def suffix_case(pool: Pool, args) -> None:
    prefix, suffix = args.prefix, args.suffix
    flops = 4 * args.heads * pool.head_dim * attended(prefix, suffix)
    label = f'suffix {suffix}@{prefix} D{pool.head_dim}'
    rows = slice(prefix, prefix + suffix)
    k, v = pool.gather(prefix + suffix)
    ref = pool.triton(rows, prefix + suffix, num_splits=1).float()
    with contextlib.suppress(Exception):
        ref = sdpa_flash(pool.q[rows], k, v, pool.scale).float()
    variants = [('triton split rule, unpacked', {'pack_gqa': False}), ('triton split rule, packed', {'pack_gqa': True}),
                ('triton S=1', {'num_splits': 1})]
    if not args.no_sweep:  # split launches: tile configs x split counts (the rule's count first)
        block_d = max(16, 1 << (pool.head_dim - 1).bit_length())
        cfgs = [None] + [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_D=block_d, num_warps=w, num_stages=st)
                         for m, n, w, st in SWEEP.get(block_d, [])]
        variants += [(f'triton {cfg_name(cfg)} S={splits or "rule"}', dict(
            config=cfg, **({'num_splits': splits} if splits else {})))
            for cfg in cfgs for splits in (0, 8, 16, 64) if cfg is not None or splits]
    for name, kwargs in variants:
        try:
            err = (pool.triton(rows, prefix + suffix, **kwargs).float() - ref).abs().max().item()
            call = functools.partial(pool.triton, rows, prefix + suffix, **kwargs)
            ms = timed(call, args.reps)
        except Exception as exc:  # out of shared memory / registers for this tile: report and go on
            print(f'{label:18s} {name:28s} failed: {type(exc).__name__}: {str(exc)[:80]}', flush=True)
            continue
        report(label, name, ms, flops, args, f'max err {err:.1e}{kernel_split(call)}')
    for name, fn in BACKENDS:
        guarded(label, name, lambda name=name, fn=fn: report(
            label, name + ' (no gather)', timed(lambda: fn(pool.q[rows], k, v, pool.scale), args.reps), flops, args,
            '(expanded K/V)' if fn.state['expand'] else ''))


def cfg_name(cfg: dict | None) -> str:
    return 'default' if cfg is None else 'M{BLOCK_M} N{BLOCK_N} w{num_warps} s{num_stages}'.format(**cfg)


def kernel_split(fn, reps: int = 5) -> str:
    """'; per kernel: name us, ...': device time per call of each kernel `fn` launches (torch.profiler; '' on the
    CPU)."""
    if DEVICE == 'cpu':
        return ''
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = {}
    for evt in prof.key_averages():
        if evt.device_type.name == 'CUDA' or getattr(evt, 'self_device_time_total', 0):
            per[evt.key] = getattr(evt, 'self_device_time_total', 0) / reps
    return '; ' + ', '.join(f'{key[:24]} {us:.0f} us' for key, us in sorted(per.items(), key=lambda kv: -kv[1])
                            if us > 0)


def report(label: str, name: str, ms: float, flops: float, args, note: str) -> None:
    tflops = flops / ms / 1e9
    print(f'{label:18s} {name:28s} {ms:9.2f} ms {tflops:7.1f} TFLOP/s ({100 * tflops / args.mm_tflops:4.1f}% of mm) '
          f'{note}', flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--seq-lens', type=int, nargs='+', default=[8192, 32768])
    parser.add_argument('--head-dims', type=int, nargs='+', default=[256, 128])
    parser.add_argument('--heads', type=int, default=16)
    parser.add_argument('--kv-heads', type=int, default=4)
    parser.add_argument('--page-size', type=int, default=64)
    parser.add_argument('--chunk', type=int, default=8192, help='the engine max_prefill_token_num')
    parser.add_argument('--prefix', type=int, default=32_700)
    parser.add_argument('--suffix', type=int, default=100)
    parser.add_argument('--reps', type=int, default=3)
    parser.add_argument('--no-sweep', action='store_true')
    parser.add_argument('--smoke', action='store_true', help='CPU, TRITON_INTERPRET=1, tiny shapes')
    parser.add_argument('--suffix-only', action='store_true', help='the suffix case alone (no cold prompts)')
    args = parser.parse_args()
    if args.smoke:
        global DEVICE
        assert os.environ.get('TRITON_INTERPRET') == '1', 'run --smoke with TRITON_INTERPRET=1'
        DEVICE = 'cpu'
        args.seq_lens, args.head_dims, args.chunk, args.prefix, args.suffix = [96, 160], [16], 64, 300, 10
        args.heads, args.kv_heads, args.page_size, args.reps = 4, 2, 4, 1
        SWEEP[16] = [(32, 32, 4, 1)]
    rates = measure_device(torch.device(DEVICE), torch.bfloat16, copy_mib=256 if DEVICE == 'cuda' else 4,
                           mm_size=8192 if DEVICE == 'cuda' else 256, iters=5)
    args.mm_tflops = rates.matmul_flops_per_s / 1e12
    name = torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'
    print(f'device {name}, commit {os.environ.get("LMDEPLOY_COMMIT", "?")}, torch '
          f'{torch.__version__}; bf16 matmul {args.mm_tflops:.0f} TFLOP/s, copy {rates.copy_bytes_per_s / 1e9:.0f} '
          f'GB/s; flash-attn {"importable" if flash_attn_fn() else "not importable"}', flush=True)
    results: dict = {}
    for head_dim in args.head_dims:
        pool = Pool(max(max(args.seq_lens) * (not args.suffix_only), args.prefix + args.suffix), args, head_dim)
        suffix_case(pool, args)
        if args.suffix_only:
            continue
        cfgs = [None]
        if not args.no_sweep:
            block_d = max(16, 1 << (head_dim - 1).bit_length())
            default = prefill_attention_config(head_dim, torch.bfloat16)
            cfgs += [default] + [c for c in (dict(BLOCK_M=m, BLOCK_N=n, BLOCK_D=block_d, num_warps=w, num_stages=s)
                                             for m, n, w, s in SWEEP.get(block_d, [])) if c != default]
            cfgs = cfgs[1:]
        for total in args.seq_lens:
            cold_case(pool, total, args, cfgs, results)
        del pool
        torch.cuda.empty_cache()
    for head_dim, by_cfg in results.items():
        best = max(by_cfg.items(), key=lambda item: min(item[1]))
        print(f'best D{head_dim} (by the worst case): BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages = {best[0]} '
              f'({min(best[1]) / 1e9:.1f} TFLOP/s); default {prefill_attention_config(head_dim, torch.bfloat16)}')


if __name__ == '__main__':
    main()
