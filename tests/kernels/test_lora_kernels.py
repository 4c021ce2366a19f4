"""The LoRA op: the default backend's per-token gather and the cuda backend's segmented Triton kernels (SGMV)
against the plain token-by-token definition (`kernels/default/lora.py: lora_reference`, float64).

Shapes are odd on purpose: empty and one-token sequences, base-model rows (slot 0) between adapter rows, a
merged linear with three slices of different widths, ranks that are not multiples of the kernel tiles. The Triton
kernels run on the GPU (`gpu`) and on the CPU under the Triton interpreter (`test_cpu_*`, only inside the
subprocess `test_triton_lora_interpreted` starts, since TRITON_INTERPRET must be set before Triton is imported).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from interpreted import run_cpu_tests_interpreted
from numeric import assert_close

from lmdeploy.pytorch.backends.base import OpType
from lmdeploy.pytorch.backends.selector import get_backend
from lmdeploy.pytorch.kernels.default.lora import lora_reference, lora_shrink_expand
from lmdeploy.pytorch.model_inputs import ModelInputs

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
interpreted = pytest.mark.skipif(not INTERPRET, reason='runs inside test_triton_lora_interpreted')


@dataclass(frozen=True)
class Case:
    seq_lens: tuple[int, ...]
    seq_slots: tuple[int, ...]
    slice_sizes: tuple[int, ...]
    in_features: int
    rank: int
    num_slots: int = 4

    def __str__(self) -> str:
        return f'T{sum(self.seq_lens)}-B{len(self.seq_lens)}-in{self.in_features}-s{self.slice_sizes}-r{self.rank}'


CASES = [
    Case((1, 5, 0, 17, 3), (2, 0, 1, 3, 1), (5, 7, 3), in_features=40, rank=3),
    Case((1, 1, 1, 1), (0, 1, 2, 1), (33,), in_features=24, rank=8),          # decode, plain linear
    Case((70, 2), (1, 2), (20, 12), in_features=96, rank=5, num_slots=3),   # tiles past one block of tokens
    Case((3, 4), (0, 0), (9,), in_features=16, rank=2),                       # base rows only: out untouched
    Case((2, 9), (1, 2), (17, 6), in_features=33, rank=20),                  # ranks past one rank tile
]


def make(case: Case, dtype=torch.float32, device='cpu', seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, n, out_features = sum(case.seq_lens), len(case.slice_sizes), sum(case.slice_sizes)
    x = torch.randn(num_tokens, case.in_features, generator=gen)
    out = torch.randn(num_tokens, out_features, generator=gen)
    lora_a = torch.randn(case.num_slots, n * case.rank, case.in_features, generator=gen) / case.in_features ** 0.5
    lora_b = torch.randn(case.num_slots, out_features, case.rank, generator=gen)
    lora_a[0], lora_b[0] = 0, 0  # slot 0 is the base model
    lora_a[1, :, :] *= (torch.arange(n * case.rank) % case.rank < case.rank - 1)[:, None]  # slot 1 has rank r - 1
    token_slots = torch.repeat_interleave(torch.tensor(case.seq_slots), torch.tensor(case.seq_lens))
    cu = torch.tensor([0, *torch.tensor(case.seq_lens).cumsum(0).tolist()], dtype=torch.int64)
    to = dict(device=device)
    return (x.to(dtype=dtype, **to), out.to(dtype=dtype, **to), lora_a.to(dtype=dtype, **to),
            lora_b.to(dtype=dtype, **to), token_slots.to(**to), torch.tensor(case.seq_slots, **to), cu.to(**to))


def expected(case: Case, x, out, lora_a, lora_b, token_slots) -> torch.Tensor:
    return lora_reference(x.cpu(), out.cpu(), lora_a.cpu(), lora_b.cpu(), list(case.slice_sizes), token_slots.cpu())


@pytest.mark.parametrize('case', CASES, ids=str)
def test_per_token_gather_matches_definition(case):
    x, out, a, b, token_slots, _, _ = make(case)
    ref = expected(case, x, out, a, b, token_slots)
    got = lora_shrink_expand(x, out.clone(), a, b, list(case.slice_sizes), token_slots)
    assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_default_backend_op_reads_sequence_slots_from_inputs():
    case = CASES[0]
    x, out, a, b, token_slots, seq_slots, cu = make(case)
    q_lens = torch.tensor(case.seq_lens)
    inputs = ModelInputs(input_ids=torch.zeros(len(x), dtype=torch.int64), position_ids=torch.zeros(len(x)),
                         q_lens=q_lens, kv_lens=q_lens, cu_seqlens_q=cu, block_tables=torch.zeros(5, 1),
                         slot_mapping=torch.zeros(len(x)), logits_indices=torch.zeros(0), state_ids=q_lens,
                         is_fresh=q_lens > 0, q_lens_list=list(case.seq_lens), lora_ids=seq_slots)
    op = get_backend('default').build(OpType.LoRA)
    got = op(x, out.clone(), a, b, list(case.slice_sizes), inputs)
    assert_close(got, expected(case, x, out, a, b, token_slots), atol=1e-5, rtol=1e-5)


def run_sgmv(case: Case, dtype, device):
    from lmdeploy.pytorch.kernels.cuda.lora import sgmv_lora
    x, out, a, b, token_slots, seq_slots, cu = make(case, dtype=dtype, device=device)
    ref = expected(case, x.float(), out.float(), a.float(), b.float(), token_slots)
    got = sgmv_lora(x, out.clone(), a, b, list(case.slice_sizes), seq_slots, cu, max(case.seq_lens))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    assert_close(got, ref, what=str(case), **tol)
    if not any(case.seq_slots):
        assert torch.equal(got, out)  # base rows are never written


@interpreted
@pytest.mark.parametrize('case', CASES, ids=str)
def test_cpu_sgmv_matches_definition(case):
    run_sgmv(case, torch.float32, 'cpu')


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('case', CASES + [Case((1,) * 64, tuple(i % 5 for i in range(64)), (4096, 1024, 1024),
                                               in_features=2048, rank=16, num_slots=5)], ids=str)
def test_sgmv_matches_definition_on_gpu(case, dtype):
    run_sgmv(case, dtype, 'cuda')


@pytest.mark.gpu
def test_sgmv_replays_in_a_cuda_graph():
    from lmdeploy.pytorch.kernels.cuda.lora import sgmv_lora
    case = CASES[1]
    x, out, a, b, token_slots, seq_slots, cu = make(case, device='cuda')
    static_out = out.clone()
    sgmv_lora(x, static_out, a, b, list(case.slice_sizes), seq_slots, cu, 1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sgmv_lora(x, static_out, a, b, list(case.slice_sizes), seq_slots, cu, 1)
    static_out.copy_(out)
    seq_slots.copy_(torch.tensor([3, 0, 1, 2], device='cuda'))  # new slots, same buffers
    graph.replay()
    token_slots = torch.tensor([3, 0, 1, 2])
    assert_close(static_out, expected(case, x, out, a, b, token_slots), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(INTERPRET, reason='already running under the interpreter')
def test_triton_lora_interpreted():
    """Run the `test_cpu_*` tests in a subprocess with TRITON_INTERPRET=1 (set before Triton is imported)."""
    run_cpu_tests_interpreted(__file__)
