"""Where does a hybrid prefill through the CUDA-graph static buffers go wrong? (open bug, see docs/architecture.md)

Two engines run the same requests in lock step with the same schedule, so they allocate the same KV blocks and
state rows: `ref` runs every forward eagerly on the batch's own tensors; `static` runs every prefill that a prefill
graph would take eagerly *through the padded static buffers* (no capture, so capture itself is ruled out) and
everything else eagerly too. After every step the script compares the two state pools row by row (each recurrent
layer's conv and recurrent parts) and the KV pages of every live sequence, and prints the first difference: step,
batch layout, sequence, layer, part.

    python3 scripts/diagnose_prefill_graph.py [qwen3_5|qwen3_next]     # on the GPU
    TRITON_INTERPRET=1 python3 scripts/diagnose_prefill_graph.py qwen3_5 --cpu   # the same with the cuda backend's
                                                                       # Triton kernels interpreted on the CPU
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from lmdeploy.demo_model import save_tiny_model
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.backends import selector
from lmdeploy.pytorch.engine.cuda_graph import PREFILL_TOKEN_BUCKETS, CUDAGraphRunner
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams


class StaticPrefills:
    """Stands in for the agent's graph runner: prefill-graph batches run eagerly through the static buffers."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.runner = CUDAGraphRunner(engine.model, engine.agent._context, 8, 512, engine.device,
                                      max_prefill_tokens=PREFILL_TOKEN_BUCKETS[-1])
        self.last_key = None

    def key_of(self, inputs):
        key = self.runner.key_of(inputs)
        return key if key is not None and not key.decode else None

    def run(self, inputs, key):
        self.last_key = (key, inputs.q_lens_list, inputs.state_ids.tolist())
        self.runner._fill(inputs, key)
        return self.engine.model(self.engine.agent._context(self.runner.static.view(key)))[:inputs.input_ids.numel()]


def compare(step: int, ref: Engine, static: Engine, layout) -> bool:
    """Print the first difference between the two engines' caches; True when they agree."""
    cfg = ref.model_config
    slots = sorted({seq.state_slot for seq in ref.scheduler.running if seq.state_slot is not None})
    for layer, (views_r, views_s) in enumerate(zip(ref.cache_engine.state_caches, static.cache_engine.state_caches)):
        for part in views_r:
            for slot in slots:
                err = (views_r[part][slot].float() - views_s[part][slot].float()).abs().max().item()
                if err > 1e-4:
                    print(f'step {step}: state row {slot}, recurrent layer {layer} ({cfg.recurrent_layer_ids[layer]}),'
                          f' {part}: max diff {err:.3g}; static batch {layout}')
                    return False
    for seq in ref.scheduler.running:
        for layer, ((kr, vr), (ks, vs)) in enumerate(zip(ref.cache_engine.kv_caches, static.cache_engine.kv_caches)):
            pages = torch.tensor(ref.inputs_maker._page_table(seq), device=kr.device)
            n = seq.num_computed
            kbs = kr.size(1)
            k_r = kr[pages].flatten(0, 1)[:n]
            k_s = ks[pages].flatten(0, 1)[:n]
            v_r = vr[pages].flatten(0, 1)[:n]
            v_s = vs[pages].flatten(0, 1)[:n]
            err = max((k_r - k_s).abs().max().item(), (v_r - v_s).abs().max().item()) if n else 0.0
            if err > 1e-4:
                print(f'step {step}: KV of sequence {seq.seq_id} (slot {seq.state_slot}), attention layer {layer}: '
                      f'max diff {err:.3g} (kernel block size {kbs}); static batch {layout}')
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('arch', nargs='?', default='qwen3_5')
    parser.add_argument('--cpu', action='store_true', help='cuda backend on the CPU (set TRITON_INTERPRET=1)')
    args = parser.parse_args()
    device = 'cpu' if args.cpu else 'cuda'
    if args.cpu:
        selector._BACKEND_MODULES['cpu'] = selector._BACKEND_MODULES['cuda']
    path = save_tiny_model(tempfile.mkdtemp(), arch=args.arch)
    common = dict(device_type=device, dtype='float32', block_size=16, kernel_block_size=8, num_gpu_blocks=256,
                  max_prefill_token_num=64, eager_mode=True)
    ref, static = Engine(path, PytorchEngineConfig(**common)), Engine(path, PytorchEngineConfig(**common))
    hook = StaticPrefills(static)
    static.agent.graph_runner = hook
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (1, 7, 70, 130)]
    for engine in (ref, static):
        for p in prompts:
            engine.add_request(p, SamplingParams(max_new_tokens=4))
    step = 0
    while ref.has_work or static.has_work:
        hook.last_key = None
        ref.step()
        static.step()
        step += 1
        if not compare(step, ref, static, hook.last_key):
            return
        print(f'step {step}: caches agree (static prefill: {hook.last_key})')
    print('no difference')


if __name__ == '__main__':
    main()
