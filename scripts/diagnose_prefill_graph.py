"""Do hybrid prefills through the CUDA-graph static buffers leave the caches an eager prefill leaves? (a diagnostic)

Written when hybrid graphs seemed to go wrong on the H200; the fault turned out to be in how the tests collected
logits (see `scripts/diagnose_graph_engine.py`). Kept to check the static-buffer padding contract.

Two engines run the same requests in lock step with the same schedule, so they allocate the same KV blocks and
state rows: `ref` runs every forward eagerly on the batch's own tensors; `static` runs every prefill that a prefill
graph would take eagerly *through the padded static buffers* (no capture, so capture itself is ruled out) and
everything else eagerly too. After every step the script compares the two state pools row by row (each recurrent
layer's conv and recurrent parts) and the KV pages of every live sequence, and prints the first difference: step,
batch layout, sequence, layer, part.

    python3 scripts/diagnose_prefill_graph.py [qwen3_5|qwen3_next] [--mode static-eager|decode-graphs|graphs]
        [--prefix-caching] [--shared 21 --stagger 3] [--dtype bfloat16]   # on the GPU
    TRITON_INTERPRET=1 python3 scripts/diagnose_prefill_graph.py qwen3_5 --cpu   # the same with the cuda backend's
                                                                       # Triton kernels interpreted on the CPU
    # bf16 through fla's recurrent kernel on the CPU (fla-core on PYTHONPATH, not installed in the dev venv):
    TRITON_INTERPRET=1 PYTHONPATH=/tmp/flasite:. python3 scripts/diagnose_prefill_graph.py qwen3_next --cpu \
        --dtype bfloat16 --recurrent-everywhere --shared 21 --stagger 3 [--prefix-caching]
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile

import torch

from lmdeploy.demo_model import save_tiny_model
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.backends import selector
from lmdeploy.pytorch.engine.cuda_graph import PREFILL_TOKEN_BUCKETS, CUDAGraphRunner
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams


class StaticPrefills:
    """Stands in for the agent's graph runner. Prefill-graph batches run through the padded static buffers: eagerly
    (`static-eager`, `decode-graphs`) or captured and replayed (`graphs`); decode batches run eagerly
    (`static-eager`) or through captured decode graphs (`decode-graphs`, `graphs`). One runner, so prefills and
    decodes share the static buffers as in the agent."""

    def __init__(self, engine: Engine, mode: str, max_batch_size: int):
        self.engine = engine
        self.mode = mode
        self.reset = False
        kbs = engine.cache_config.kernel_block_size
        self.runner = CUDAGraphRunner(engine.model, engine.agent._context, max_batch_size,
                                      -(-engine.session_len // kbs), engine.device,
                                      max_prefill_tokens=PREFILL_TOKEN_BUCKETS[-1])
        if mode not in ('static-eager', 'static-eager-all'):
            with torch.inference_mode(), engine.agent.streams.forward():
                self.runner.capture_all()
            torch.cuda.synchronize()
        self.last_key = None

    def key_of(self, inputs):
        key = self.runner.key_of(inputs)
        if key is not None and key.decode and self.mode == 'static-eager':
            return None
        if key is not None and not key.decode and self.mode == 'decode-only':
            return None
        return key

    def run(self, inputs, key):
        self.last_key = (key, inputs.q_lens_list, inputs.state_ids.tolist())
        if self.reset and key.decode:
            self._reset_static()
        if (key.decode and self.mode != 'static-eager-all') or self.mode == 'graphs':
            return self.runner.run(inputs, key)
        self.runner._fill(inputs, key)
        return self.engine.model(self.engine.agent._context(self.runner.static.view(key)))[:inputs.input_ids.numel()]

    def _reset_static(self):
        st = self.runner.static
        for t in (st.input_ids, st.position_ids, st.q_lens, st.kv_lens, st.cu_seqlens_q, st.state_ids,
                  st.block_tables):
            t.zero_()
        st.is_fresh.fill_(False)
        st.slot_mapping.fill_(-1)


def compare(step: int, ref: Engine, static: Engine, layout, tol: float = 1e-4) -> bool:
    """Print the first difference between the two engines' caches; True when they agree."""
    cfg = ref.model_config
    slots = sorted({seq.state_slot for seq in ref.scheduler.running if seq.state_slot is not None})
    for layer, (views_r, views_s) in enumerate(zip(ref.cache_engine.state_caches, static.cache_engine.state_caches)):
        for part in views_r:
            for slot in slots:
                err = (views_r[part][slot].float() - views_s[part][slot].float()).abs().max().item()
                if err > tol:
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
            if err > tol:
                print(f'step {step}: KV of sequence {seq.seq_id} (slot {seq.state_slot}), attention layer {layer}: '
                      f'max diff {err:.3g} (kernel block size {kbs}); static batch {layout}')
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('arch', nargs='?', default='qwen3_5')
    parser.add_argument('--cpu', action='store_true', help='cuda backend on the CPU (set TRITON_INTERPRET=1)')
    parser.add_argument('--dtype', default='float32', help='float32 (torch gated-delta kernels) or bfloat16 (fla)')
    parser.add_argument('--mode', default='static-eager',
                        choices=['static-eager', 'static-eager-all', 'decode-only', 'decode-graphs', 'graphs'],
                        help='static-eager: prefills eager through the static buffers, decodes eager; '
                             'static-eager-all: decodes too; decode-only: prefills eager on their own '
                             'tensors, decodes replay graphs (what hybrids shipped with); decode-graphs: '
                             'static-eager prefills, replayed decodes; graphs: both replayed')
    parser.add_argument('--fla-fp32', action='store_true', help='float32 gated delta rule on fla too (not torch)')
    parser.add_argument('--recurrent-everywhere', action='store_true',
                        help='both engines run the token-by-token gated delta rule in every forward (so the '
                             'reference needs no chunked kernel: fla\'s cannot run under TRITON_INTERPRET)')
    parser.add_argument('--reset-static', action='store_true', help='zero the static buffers before each decode')
    parser.add_argument('--prefix-caching', action='store_true')
    parser.add_argument('--shared', type=int, default=0, help='tokens of a prefix shared by every prompt')
    parser.add_argument('--stagger', type=int, default=0, help='steps between arrivals (0: all at once)')
    args = parser.parse_args()
    device = 'cpu' if args.cpu else 'cuda'
    if args.cpu:
        selector._BACKEND_MODULES['cpu'] = selector._BACKEND_MODULES['cuda']
    if args.fla_fp32:
        from lmdeploy.pytorch.backends import cuda as cuda_backend
        cuda_backend.BACKEND._builders[cuda_backend.OpType.GatedDeltaRule] = cuda_backend._build_fla_gated_delta_rule
    if args.recurrent_everywhere:
        from lmdeploy.pytorch.engine import inputs_maker
        make = inputs_maker.InputsMaker.make

        def make_recurrent(self, sched):
            inputs, sampled = make(self, sched)
            return dataclasses.replace(inputs, use_recurrent_kernel=True), sampled
        inputs_maker.InputsMaker.make = make_recurrent
    path = save_tiny_model(tempfile.mkdtemp(), arch=args.arch)
    common = dict(device_type=device, dtype=args.dtype, block_size=16, kernel_block_size=8, num_gpu_blocks=256,
                  max_batch_size=8, max_prefill_token_num=48, eager_mode=True,
                  enable_prefix_caching=args.prefix_caching)
    ref, static = Engine(path, PytorchEngineConfig(**common)), Engine(path, PytorchEngineConfig(**common))
    hook = StaticPrefills(static, args.mode, 8)
    hook.reset = args.reset_static
    static.agent.graph_runner = hook
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 1000, (args.shared,), generator=g).tolist()
    lengths = (1, 7, 70, 130) if not args.shared else (1, 5, 9, 14, 30, 2, 7)
    pending = [shared + torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]
    outs = {'ref': {}, 'static': {}}
    tol = 1e-4 if args.dtype == 'float32' else 2e-2
    tol = tol if args.mode == 'static-eager' else max(tol, 1e-3)
    step = arrived = 0
    while pending or ref.has_work or static.has_work:
        while pending and arrived * args.stagger <= step:
            prompt = pending.pop(0)
            arrived += 1
            for name, engine in (('ref', ref), ('static', static)):
                engine.add_request(prompt, SamplingParams(max_new_tokens=12), collect_logits=True,
                                   callback=lambda o, d=outs[name]: d.setdefault(o.seq_id, []).extend(o.new_token_ids))
        hook.last_key = None
        ref.step()
        static.step()
        step += 1
        if outs['ref'] != outs['static']:
            print(f'step {step}: sampled tokens differ: ref {outs["ref"]} static {outs["static"]}; {hook.last_key}')
            return
        if not compare(step, ref, static, hook.last_key, tol):
            return
        print(f'step {step}: caches agree (batch through the runner: {hook.last_key})')
    print(f'no difference ({hook.runner.num_replays} replays, {hook.runner.num_prefill_replays} of prefill graphs)')


if __name__ == '__main__':
    main()
