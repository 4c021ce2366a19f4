"""Does each op of a hybrid decode step replay exactly under a CUDA graph? (a diagnostic)

Written when hybrid decode graphs seemed to replay wrong logits on the H200; every piece and the whole model
replayed exactly (2026-11-30), and the fault was in how the tests collected logits (fixed; regression test
`tests/engine/test_device_streams.py::test_collected_logits_wait_for_the_forward_stream`). Kept to check new
recurrent ops. It captures each piece of one gated-DeltaNet
layer separately on a padded decode batch: raw ops the torch kernels use (batched matmul, gather / index_put on
the pool), the conv, the gated delta rule (torch and fla kernels), the gated norm, the whole token mixer, then the
whole model; then it refills the static inputs and the state rows with new random data, replays, and compares the
outputs and the state rows with an eager run from the same data.

    python3 scripts/diagnose_graph_ops.py [--arch qwen3_next] [--dtype float32]     # on the GPU
    python3 scripts/diagnose_graph_ops.py --cpu     # a dry run of the script itself (no capture: replay = eager)
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from lmdeploy.demo_model import save_tiny_model
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.model_inputs import ModelInputs, StepContext


class Piece:
    """One function of static tensors, captured once and replayed (or run eagerly for the comparison)."""

    def __init__(self, name: str, fn, use_graph: bool):
        self.name, self.fn, self.use_graph = name, fn, use_graph
        self.graph = None
        self.out = None

    def capture(self) -> None:
        self.fn()  # warm-up: compile every kernel for these shapes
        if not self.use_graph:
            return
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.fn()

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            return self.fn().clone()
        self.graph.replay()
        return self.out.clone()


def decode_inputs(batch: int, pad: int, slots: list[int], kv_lens: list[int], kbs: int, device) -> ModelInputs:
    """A decode batch of `batch` sequences on `slots` plus `pad` padding rows (dummy slot 0, kv_len 0, no KV)."""
    size = batch + pad
    kv = torch.tensor(kv_lens + [0] * pad)
    pages = max(-(-n // kbs) for n in kv_lens)
    tables = torch.arange(size * pages).view(size, pages) + 1
    slot_mapping = torch.tensor([tables[b, (n - 1) // kbs].item() * kbs + (n - 1) % kbs
                                 for b, n in enumerate(kv_lens)] + [-1] * pad)
    one = torch.ones(size, dtype=torch.int64)
    return ModelInputs(
        input_ids=torch.randint(0, 100, (size,)), position_ids=(kv - 1).clamp(min=0), q_lens=one, kv_lens=kv,
        cu_seqlens_q=torch.arange(size + 1), block_tables=tables, slot_mapping=slot_mapping,
        logits_indices=torch.arange(size), state_ids=torch.tensor(slots + [0] * pad),
        is_fresh=torch.zeros(size, dtype=torch.bool), q_lens_list=[1] * size, kv_lens_list=[pages] * size,
        max_seqlen_q=1, max_seqlen_k=size).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--arch', default='qwen3_next')
    parser.add_argument('--dtype', default='float32')
    parser.add_argument('--cpu', action='store_true')
    parser.add_argument('--trials', type=int, default=3)
    args = parser.parse_args()
    device = 'cpu' if args.cpu else 'cuda'
    torch.manual_seed(0)
    path = save_tiny_model(tempfile.mkdtemp(), arch=args.arch)
    engine = Engine(path, PytorchEngineConfig(device_type=device, dtype=args.dtype, block_size=16,
                                              kernel_block_size=8, num_gpu_blocks=64, eager_mode=True))
    model, cache = engine.model, engine.cache_engine
    kbs = cache.cache_config.kernel_block_size
    inputs = decode_inputs(3, 1, [2, 3, 5], [9, 20, 33], kbs, device)
    ctx = StepContext(inputs=inputs, kv_caches=cache.kv_caches, state_caches=cache.state_caches,
                      kernel_block_size=kbs)
    layer_id = next(i for i, layer in enumerate(model.model.layers) if hasattr(layer, 'linear_attn'))
    mixer = model.model.layers[layer_id].linear_attn
    states = cache.state_caches[mixer.state_index]
    hidden = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    size = inputs.input_ids.numel()
    # static activations of the pieces
    x = torch.randn(size, hidden, device=device, dtype=dtype)
    mixed = torch.randn(size, mixer.conv_dim, device=device, dtype=dtype)
    hk, hv, dk, dv = mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    q = torch.randn(size, hk, dk, device=device, dtype=dtype)
    k = torch.randn(size, hk, dk, device=device, dtype=dtype)
    v = torch.randn(size, hv, dv, device=device, dtype=dtype)
    g = -torch.rand(size, hv, device=device)
    beta = torch.rand(size, hv, device=device, dtype=dtype)
    o = torch.randn(size, hv, dv, device=device, dtype=dtype)
    z = torch.randn(size, hv, dv, device=device, dtype=dtype)
    activations = [x, mixed, q, k, v, g, beta, o, z]
    use_graph = not args.cpu
    # Raw ops of the torch gated-delta kernels (float32 runs them; bf16 runs fla): a batched matmul (cuBLAS), the
    # same product as a broadcast multiply + sum (no cuBLAS), the kernels' gather / index_put on a strided pool
    # view, the key-head expansion (repeat_interleave), and a plain linear (cuBLASLt, which the dense models'
    # graphs use without trouble) as a control.
    bh = size * hv
    mat_a = torch.randn(bh, 1, dk, device=device)
    mat_b = torch.randn(bh, dk, dv, device=device)
    slot_ids = inputs.state_ids
    upd = torch.randn(size, hv, dk, dv, device=device)
    lin_x = torch.randn(size, hidden, device=device, dtype=dtype)
    lin_w = torch.randn(hidden, hidden, device=device, dtype=dtype)
    activations += [mat_a, mat_b, upd, lin_x, lin_w]
    recurrent = states['recurrent']

    def gather_scatter():
        old = recurrent[slot_ids].float()
        recurrent[slot_ids] = (old * 0.5 + upd).to(recurrent.dtype)
        return old

    # fla's token-by-token kernel on the same float32 inputs (no tl.dot, so no TF32): if it replays right, float32
    # hybrids can run their decode graphs on it.
    fla_pieces = []
    if not args.cpu:
        try:
            from lmdeploy.pytorch.kernels.cuda.gated_delta_rule import recurrent_gated_delta_rule as fla_recurrent
            fla_pieces.append(Piece('fla_recurrent', lambda: fla_recurrent(
                q, k, v, g, beta, inputs.cu_seqlens_q, states['recurrent'], inputs.state_ids, inputs.is_fresh,
                max_seqlen=1), use_graph))
        except ImportError as exc:
            print('fla not importable, no fla piece:', exc)

    pieces = [
        Piece('bmm', lambda: mat_a @ mat_b, use_graph),
        Piece('mul_sum', lambda: (mat_a.transpose(1, 2) * mat_b).sum(1), use_graph),
        Piece('gather_scatter', gather_scatter, use_graph),
        Piece('linear', lambda: torch.nn.functional.linear(lin_x, lin_w), use_graph),
        Piece('repeat_interleave', lambda: q.float().repeat_interleave(hv // hk, dim=1), use_graph),
        Piece('conv1d', lambda: mixer.conv1d(mixed, states['conv'], inputs), use_graph),
        Piece('gated_delta_rule', lambda: mixer.gated_delta_rule(q, k, v, g, beta, states['recurrent'], inputs),
              use_graph),
        Piece('gated_norm', lambda: mixer.norm(o, z), use_graph),
        *fla_pieces,
        Piece('token_mixer', lambda: mixer(x, ctx), use_graph),
        Piece('model', lambda: model(ctx), use_graph),
    ]
    with torch.inference_mode():
        for piece in pieces:
            piece.capture()
        for trial in range(args.trials):
            for t in activations:
                t.copy_(torch.randn_like(t) if t is not g else -torch.rand_like(t))
            cache.state_pool.copy_(torch.randint_like(cache.state_pool, 0, 256))
            for view in (states['conv'], states['recurrent']):  # sane floats, not random bit patterns
                view.copy_(torch.randn_like(view) * 0.1)
            for layer_states in cache.state_caches:
                for view in layer_states.values():
                    view.copy_(torch.randn_like(view) * 0.1)
            if fla_pieces:  # fla vs the torch kernel, both eager, from the same state
                pool = cache.state_pool.clone()
                ref = mixer.gated_delta_rule(q, k, v, g, beta, states['recurrent'], inputs).float()
                torch_rows = states['recurrent'].clone()
                cache.state_pool.copy_(pool)
                got = fla_pieces[0].fn().float()
                out_diff = (got - ref).abs().max().item()
                state_diff = (states['recurrent'].float() - torch_rows.float()).abs().max().item()
                print(f'trial {trial} fla vs torch kernel (eager): output max diff {out_diff:.3g}, '
                      f'state max diff {state_diff:.3g}')
                cache.state_pool.copy_(pool)
            for piece in pieces:
                pool = cache.state_pool.clone()
                kv = cache.kv_pool.clone()
                got = piece.replay()
                pool_got = cache.state_pool.clone()
                cache.state_pool.copy_(pool)
                cache.kv_pool.copy_(kv)
                ref = piece.fn().clone()
                pool_ref = cache.state_pool.clone()
                cache.state_pool.copy_(pool)
                cache.kv_pool.copy_(kv)
                err = (got.float() - ref.float()).abs().max().item()
                rows = [r for r in range(1, pool.size(0)) if not torch.equal(pool_got[r], pool_ref[r])]
                verdict = 'OK' if err < 1e-3 and not rows else 'DIFFERS'
                print(f'trial {trial} {piece.name:16s} output max diff {err:.3g}; state rows that differ: {rows} '
                      f'-> {verdict}')


if __name__ == '__main__':
    main()
