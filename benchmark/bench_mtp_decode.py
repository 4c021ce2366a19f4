"""Model-level cost of MTP speculative decoding: a plain decode step against one speculative step (a verify forward
of K + 1 tokens per row with a state cut after every draft position, the accepted state's row copy, and K draft
steps of the MTP head), at batch 1 and 16, on a real-depth Qwen3.5 shape with dummy weights.

This measures the forwards the speculative engine path will run, not the engine: the engine does not draft yet
(`speculative_config` refuses with "not supported yet"). With random weights the head's acceptance means nothing,
so the speed is reported under forced acceptance: a step that accepts a - 1 drafts emits a tokens (a = 1 .. K + 1),
so decode tokens/s = batch * a / (speculative step time), against batch / (plain step time). Forwards run eagerly
(no CUDA graphs) in both modes; times are medians over `--iters` steps, synchronised on the device.

    python benchmark/bench_mtp_decode.py [--layers 24] [--draft-tokens 3] [--batches 1 16] [--context 1024]
    python benchmark/bench_mtp_decode.py --smoke     # tiny shape on the CPU (what CI runs)

Prints a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from lmdeploy.pytorch.config import CacheConfig
from lmdeploy.pytorch.engine.cache_engine import CacheEngine
from lmdeploy.pytorch.model_inputs import ModelInputs, StateCuts, StepContext
from lmdeploy.pytorch.models.loader import build_model

# Qwen3.5-0.8B's dimensions (docs: wave-2 facts), one full-attention layer in four
REAL_SHAPE = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                  linear_value_head_dim=128, vocab_size=248320)
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   vocab_size=512)


def write_config(path: str, layers: int, shape: dict) -> str:
    from transformers import Qwen3_5TextConfig
    types = ['full_attention' if (i + 1) % 4 == 0 else 'linear_attention' for i in range(layers)]
    config = Qwen3_5TextConfig(num_hidden_layers=layers, layer_types=types, mtp_num_hidden_layers=1,
                               max_position_embeddings=32768, **shape)
    config.architectures = ['Qwen3_5ForCausalLM']
    config.save_pretrained(path)
    return path


class Batch:
    """B sequences of `context` cached tokens; row b owns pages [b * P, (b + 1) * P), state row 1 + b and, for
    cuts, rows 1 + B + b * K ...; `inputs(n)` feeds n tokens per row at the end of the context."""

    kbs = 64

    def __init__(self, batch: int, context: int, k: int, pages_per_seq: int, device: torch.device):
        self.batch, self.context, self.k, self.pages, self.device = batch, context, k, pages_per_seq, device

    def inputs(self, n: int, start: int, cuts: bool = False, fresh: bool = False) -> ModelInputs:
        B, dev = self.batch, self.device
        positions = torch.arange(start, start + n).repeat(B)
        rows = torch.arange(B).repeat_interleave(n)
        tables = torch.arange(B * self.pages).view(B, self.pages)
        slots = tables[rows, positions // self.kbs] * self.kbs + positions % self.kbs
        state_ids = list(range(1, B + 1))
        state_cuts = None
        if cuts and self.k:
            state_cuts = StateCuts(rows=[b for b in range(B) for _ in range(self.k)],
                                   offsets=[o for _ in range(B) for o in range(1, self.k + 1)],
                                   slots=[1 + B + b * self.k + i for b in range(B) for i in range(self.k)],
                                   q_lens=[n] * B, state_ids=state_ids, is_fresh=[fresh] * B)
        return ModelInputs(
            input_ids=torch.randint(0, 100, (B * n,)), position_ids=positions, q_lens=torch.full((B,), n),
            kv_lens=torch.full((B,), start + n), cu_seqlens_q=torch.arange(B + 1) * n, block_tables=tables,
            slot_mapping=slots, logits_indices=torch.arange(B * n), state_ids=torch.tensor(state_ids),
            is_fresh=torch.full((B,), fresh), q_lens_list=[n] * B, kv_lens_list=[start + n] * B, max_seqlen_q=n,
            max_seqlen_k=start + n, state_cuts=state_cuts).to(dev)


def median_s(fn, iters: int, device: torch.device) -> float:
    times = []
    for _ in range(iters + 2):
        if device.type == 'cuda':
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == 'cuda':
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])  # the first two warm up


@torch.no_grad()
def bench_batch(model, config, device, batch: int, context: int, k: int, iters: int) -> dict:
    pages = -(-(context + k + 2) // Batch.kbs)
    cache = CacheEngine(config, CacheConfig(block_size=Batch.kbs, kernel_block_size=Batch.kbs,
                                            num_blocks=batch * pages, num_state_slots=1 + batch * (1 + k)), device)
    b = Batch(batch, context, k, pages, device)

    def ctx(inputs: ModelInputs) -> StepContext:
        return StepContext(inputs=inputs, kv_caches=cache.kv_caches, state_caches=cache.state_caches,
                           kernel_block_size=Batch.kbs)

    prefill = b.inputs(context, 0, fresh=True)
    _, hidden = model.forward_with_hidden(ctx(prefill))
    model.draft_hidden(hidden, ctx(prefill))  # the head's KV over the prompt
    decode = b.inputs(1, context)
    verify = b.inputs(k + 1, context, cuts=True)
    draft = b.inputs(1, context + k + 1)
    last_rows = torch.arange(batch, device=device) * (k + 1) + k
    copy_plan = torch.stack([torch.arange(1 + batch, 1 + batch + batch * k, k), torch.arange(1, 1 + batch)]).to(device)

    def plain_step():
        model.compute_logits(model(ctx(decode)))

    def spec_step():
        normed, pre_norm = model.forward_with_hidden(ctx(verify))
        model.compute_logits(normed).argmax(-1)
        cache.copy_state_slots(copy_plan)  # the accepted position's state into the runtime row
        h = pre_norm[last_rows]
        for step in range(k):
            h_draft = model.draft_hidden(h, ctx(draft), step)
            model.compute_logits(h_draft).argmax(-1)
            h = h_draft

    plain_s = median_s(plain_step, iters, device)
    spec_s = median_s(spec_step, iters, device)
    plain_tps = batch / plain_s
    forced = {a: batch * a / spec_s for a in range(1, k + 2)}
    return dict(batch=batch, plain_step_ms=plain_s * 1e3, spec_step_ms=spec_s * 1e3, plain_tokens_per_s=plain_tps,
                spec_tokens_per_s_at_accept_len={str(a): v for a, v in forced.items()},
                break_even_accept_len=spec_s / plain_s)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--layers', type=int, default=24)
    parser.add_argument('--draft-tokens', type=int, default=3)
    parser.add_argument('--batches', type=int, nargs='+', default=[1, 16])
    parser.add_argument('--context', type=int, default=1024)
    parser.add_argument('--iters', type=int, default=20)
    parser.add_argument('--smoke', action='store_true', help='tiny shape on the CPU, float32')
    args = parser.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device('cpu' if smoke else 'cuda')
    dtype = 'float32' if smoke else 'bfloat16'
    layers, context, iters = (4, 48, 2) if smoke else (args.layers, args.context, args.iters)
    with tempfile.TemporaryDirectory() as path:
        write_config(path, layers, SMOKE_SHAPE if smoke else REAL_SHAPE)
        model, config = build_model(path, device, dtype, device.type, load_format='dummy', mtp=True)
    rows = [bench_batch(model, config, device, batch, context, args.draft_tokens, iters) for batch in args.batches]
    k = args.draft_tokens
    print(f'{"batch":>5} {"plain ms":>9} {"spec ms":>8} {"plain tok/s":>11} '
          + ' '.join(f'{"a=" + str(a):>9}' for a in range(1, k + 2)) + f' {"break-even a":>12}')
    for r in rows:
        print(f'{r["batch"]:>5} {r["plain_step_ms"]:>9.2f} {r["spec_step_ms"]:>8.2f} {r["plain_tokens_per_s"]:>11.1f} '
              + ' '.join(f'{v:>9.1f}' for v in r['spec_tokens_per_s_at_accept_len'].values())
              + f' {r["break_even_accept_len"]:>12.2f}')
    result = dict(layers=layers, context=context, draft_tokens=k, device=device.type, dtype=dtype, rows=rows)
    print(json.dumps(result))
    return result


if __name__ == '__main__':
    main()
