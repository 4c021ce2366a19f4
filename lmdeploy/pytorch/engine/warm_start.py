"""Start-up warm-up of the eager forward: every Triton specialization and autotuning an eager forward can hit is paid
at start-up, on all-padding inputs, so that no request pays for compilation.

Owns: the warm-up shapes and their padding inputs. Used once by `ModelAgent.capture_cuda_graphs` (CUDA, before
the graphs are captured); never touches scheduler state.

Triton compiles one binary per specialization of a kernel's integer arguments (equal to 1, divisible by 16, or
neither) and fla autotunes a kernel at its first call per key. An eager forward feeds `T` tokens of `B` sequences,
`1 <= B <= T <= max_tokens`, and the integer arguments of its kernels are `T`, `B` and multiples of them; so the
shapes cover `T` and `B` in each class (`warm_up_shapes`): decode batches (`T == B`: 1, 3, 16 sequences), one
sequence of a multiple-of-16 and of an odd length (long ones, and short ones below the token counts where kernels
change tiles), several sequences (prefill + decodes) of both, and the largest
forward (`max_tokens`, which also sizes the caching allocator for it). Each forward's logits are then sampled
greedily and with temperature / top-k / top-p (`warm_up_sampling`: loads the sampler's kernels), from logits with
NaN / inf replaced (padding rows may read garbage KV; a NaN probability would fail a draw on the device). Last,
one KV block copy (block 0 onto itself) compiles the prefix cache's copy kernel.

Padding writes nothing a sequence owns (the contract of the graph warm-up in `engine/cuda_graph.py`): no KV
(`slot_mapping = -1`), only the dummy state row 0 (every sequence fresh, so it is never read), block tables of
zeros (attention reads page 0, an existing page, within a table as wide as the longest sequence).
"""
from __future__ import annotations

import torch

from ..model_inputs import ModelInputs, SamplingInputs

# Below every token-count tile threshold of the kernels (`warm_up_shapes`).
SHORT_PREFILL = 256


def _not_16(n: int) -> int:
    """The largest count <= n that is neither 1 nor a multiple of 16 (n itself when it already is), at least 2."""
    n = max(2, n)
    return n - 1 if n % 16 == 0 else n


def warm_up_shapes(max_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Per warm-up forward, the new tokens of each sequence (see the module docstring), distinct, in a fixed order."""
    if max_tokens <= 0 or max_batch_size <= 0:
        return []
    shapes = [[1]]
    few = min(3, max_batch_size, max_tokens)
    many = min(16, max_batch_size, max_tokens)
    shapes += [[1] * few, [1] * many]                                   # decode batches
    top = max(1, max_tokens // 16 * 16)
    odd = _not_16(min(max_tokens, 1000))
    shapes += [[min(top, max_tokens)], [min(odd, max_tokens)], [max_tokens]]   # one sequence
    # and a short one of each class: kernels that pick tiles by the token count (the conv's 8 x 128 tiles from 512
    # tokens up, `kernels/cuda/causal_conv1d.token_tiles`) compile their short prompts' binaries too
    short = max(1, min(top, SHORT_PREFILL))
    shapes += [[short], [_not_16(short)]]
    for total in (top, odd):                                            # a prefill beside decodes
        for seqs in (few, many):
            if seqs > 1 and total > seqs:
                shapes.append([total - seqs + 1] + [1] * (seqs - 1))
    unique = []
    for shape in shapes:
        if shape not in unique and sum(shape) <= max_tokens:
            unique.append(shape)
    return unique


def _width_of_class(needed: int, cls: str) -> int:
    """A block-table width >= `needed` pages in specialization class `cls` (`one`: only when one page suffices)."""
    if cls == 'x16':
        return -(-needed // 16) * 16
    if cls == 'other':
        return needed if needed % 16 and needed != 1 else needed + 1
    return needed


def warm_up_plan(max_tokens: int, max_batch_size: int, kernel_block_size: int) -> list[tuple[list[int], int]]:
    """(new tokens per sequence, block-table width) per warm-up forward. The attention kernels take the table's
    row stride (its width: the most pages of a batch's sequences) as an integer argument, so its classes (1, x16,
    other) are covered on the decode path (`T == B`) and on the prefill path, on top of `warm_up_shapes`. The
    prefill attention launches one of two kernels by the token count (split-KV for few tokens, see
    `paged_prefill_attention`), so both the smallest and the largest prefill see every class."""
    shapes = warm_up_shapes(max_tokens, max_batch_size)
    if max_tokens >= 2 and [2] not in shapes:
        shapes.append([2])   # a prefill whose table is one page wide
    plan, seen = [], {True: set(), False: set()}
    for q_lens in shapes:
        needed = -(-max(q_lens) // kernel_block_size)
        decode = sum(q_lens) == len(q_lens)
        cls = next((c for c in ('one', 'x16', 'other') if c not in seen[decode] and (c != 'one' or needed == 1)),
                   'x16')
        seen[decode].add(cls)
        plan.append((q_lens, _width_of_class(needed, cls)))
    decodes = [q for q in shapes if sum(q) == len(q)]
    prefills = [q for q in shapes if sum(q) != len(q)]
    ends = [min(decodes, key=sum)] if decodes else []
    if prefills:
        ends += [min(prefills, key=sum), max(prefills, key=sum)]
    for q_lens in ends:   # classes a path's end shape has not seen yet
        needed = -(-max(q_lens) // kernel_block_size)
        for cls in ('one', 'x16', 'other'):
            width = _width_of_class(needed, cls)
            if (cls != 'one' or needed == 1) and (q_lens, width) not in plan:
                plan.append((q_lens, width))
    return plan


def padding_inputs(q_lens: list[int], kernel_block_size: int, has_lora: bool = False,
                   table_width: int | None = None) -> ModelInputs:
    """Host `ModelInputs` of fresh all-padding sequences of `q_lens` tokens (see the module docstring), with block
    tables `table_width` pages wide (None: as many as the longest sequence needs)."""
    num_tokens, batch = sum(q_lens), len(q_lens)
    lens = torch.tensor(q_lens, dtype=torch.int64)
    cu = torch.zeros(batch + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    pages = max(-(-max(q_lens) // kernel_block_size), table_width or 0)
    return ModelInputs(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        position_ids=torch.cat([torch.arange(n, dtype=torch.int64) for n in q_lens]),
        q_lens=lens, kv_lens=lens.clone(), cu_seqlens_q=cu, block_tables=torch.zeros(batch, pages, dtype=torch.int64),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64), logits_indices=cu[1:] - 1,
        state_ids=torch.zeros(batch, dtype=torch.int64), is_fresh=torch.ones(batch, dtype=torch.bool),
        q_lens_list=list(q_lens), kv_lens_list=list(q_lens), max_seqlen_q=max(q_lens), max_seqlen_k=max(q_lens),
        lora_ids=torch.zeros(batch, dtype=torch.int64) if has_lora else None)


def warm_up_sampling(batch: int, greedy: bool, device: torch.device) -> SamplingInputs:
    """Host sampling inputs for `batch` rows: greedy, or temperature 0.7 with top-k 20 and top-p 0.9 drawing from
    a generator of its own (the global RNG a request may rely on is left as it was)."""
    def full(value: float, dtype=torch.float32) -> torch.Tensor:
        return torch.full((batch,), value, dtype=dtype)
    generator = None if greedy else torch.Generator(device=device).manual_seed(0)
    return SamplingInputs(
        temperature=full(0.0 if greedy else 0.7), top_k=full(0 if greedy else 20, torch.int64),
        top_p=full(1.0 if greedy else 0.9), repetition_penalty=full(1.0), penalty_ids=[None] * batch,
        banned_ids=[None] * batch, generators=[generator] * batch, all_greedy=greedy)
