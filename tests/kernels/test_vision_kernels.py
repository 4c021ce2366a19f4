"""The vision tower's varlen attention kernel (`kernels/cuda/varlen_attention.py`) against the torch reference, and
the vision-language model on CUDA against the CPU path.

* `test_cpu_*` run the Triton kernel on CPU tensors under the Triton interpreter, inside the subprocess started by
  `test_varlen_attention_interpreted` (TRITON_INTERPRET must be set before Triton is imported).
* `@pytest.mark.gpu` tests run the kernel, the vision tower and M-RoPE prompts on CUDA.
"""
from __future__ import annotations

import os

import pytest
import torch
from interpreted import run_cpu_tests_interpreted
from numeric import assert_close

from lmdeploy.pytorch.kernels.default.varlen_attention import varlen_attention as ref_varlen

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
interpreted = pytest.mark.skipif(not INTERPRET, reason='runs inside test_varlen_attention_interpreted')
# (lengths, heads, head dim): odd lengths, one-row units, a head dim that is not a power of two (Qwen3.5's is 72)
SHAPES = [([5, 1, 9], 2, 16), ([3, 17], 1, 24), ([70, 33], 2, 72)]


def _case(lengths, heads, dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(n, heads, dim, generator=gen).to(dtype) for _ in range(3))
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return [t.to(device) for t in (q, k, v)], cu


def _check(lengths, heads, dim, dtype, device, atol):
    from lmdeploy.pytorch.kernels.cuda.varlen_attention import varlen_attention
    (q, k, v), cu = _case(lengths, heads, dim, dtype, device)
    scale = dim ** -0.5
    out = varlen_attention(q, k, v, torch.tensor(cu, dtype=torch.int32, device=device), max(lengths), scale)
    expected = ref_varlen(q.float().cpu(), k.float().cpu(), v.float().cpu(), cu, scale)
    assert_close(out, expected, atol=atol, rtol=atol, what=f'varlen attention {lengths} H{heads} D{dim}')


@interpreted
@pytest.mark.parametrize('lengths,heads,dim', SHAPES[:2], ids=['L5-1-9-H2-D16', 'L3-17-H1-D24'])
def test_cpu_varlen_attention_matches_reference(lengths, heads, dim):
    _check(lengths, heads, dim, torch.float32, 'cpu', 1e-5)


@pytest.mark.skipif(INTERPRET, reason='already running under the interpreter')
def test_varlen_attention_interpreted():
    run_cpu_tests_interpreted(__file__)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype,atol', [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('lengths,heads,dim', SHAPES + [([1024, 64, 4096], 16, 72)],
                         ids=['L5-1-9', 'L3-17', 'L70-33-D72', 'L1024-64-4096-H16-D72'])
def test_gpu_varlen_attention_matches_reference(lengths, heads, dim, dtype, atol):
    _check(lengths, heads, dim, dtype, 'cuda', atol)


# ---- the model on CUDA against the CPU path ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize('dtype,atol', [('float32', 1e-4), ('bfloat16', 5e-2)])
def test_gpu_vision_tower_and_mrope_prompt_match_the_cpu_path(tiny_model_factory, dtype, atol):
    from vl_helpers import draw_image, user_message

    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    from lmdeploy.pytorch.messages import SamplingParams
    from lmdeploy.serve.tokenizer import Tokenizer
    from lmdeploy.serve.vision.processor import ImageProcessor

    path = tiny_model_factory('qwen3_5_vl')
    engines = {dev: Engine(path, PytorchEngineConfig(device_type=dev, dtype=dtype if dev == 'cuda' else 'float32',
                                                     block_size=16, num_gpu_blocks=64, max_batch_size=4,
                                                     eager_mode=False))
               for dev in ('cpu', 'cuda')}
    tokenizer = Tokenizer(path)
    processor = ImageProcessor(path, engines['cpu'].model_config.image_token_id)
    images = [draw_image(11, (128, 96)), draw_image(12, (64, 128))]
    text = tokenizer.apply_chat_template(user_message('A', images[0], 'and B', images[1], 'differ how?'))
    ids, spans = processor.expand(tokenizer.encode(text, add_special_tokens=False), images)
    pixels = torch.cat([s.data.pixel_values for s in spans])
    grids = [s.data.grid_thw for s in spans]
    with torch.no_grad():
        cpu_embeds = engines['cpu'].model.encode_images(pixels, grids)
        gpu_embeds = engines['cuda'].model.encode_images(pixels.cuda(), grids)
    assert_close(gpu_embeds, cpu_embeds, atol=atol, rtol=atol, what=f'vision tower {dtype}')
    logits = {}
    for dev, engine in engines.items():
        seq_id = engine.add_request(ids, SamplingParams(max_new_tokens=4), collect_logits=True, mm_spans=spans)
        engine.run_until_idle()
        logits[dev] = engine.pop_collected_logits(seq_id)
    # The prompt's rows: the text after the images sits at offset positions (a wrong offset moves its rotary).
    assert_close(logits['cuda'][:len(ids)], logits['cpu'][:len(ids)], atol=atol * 10, rtol=atol * 10,
                 what=f'prompt logits {dtype}')
