"""TTFT of image prompts: a cold prompt with images, then the same images with a new question (a prefix-cache hit at
the last image's end, no vision encoding), then a different text before the same images (no prefix hit; the
vision-encoder cache serves the images), on a random-weight Qwen3.5-VL checkpoint built here (no download).

Default geometry: text 1024 hidden x 8 layers (3 gated-delta : 1 attention), vision 1152 hidden x 8 blocks (the
released tower is 27 blocks of the same width), two 448 x 448 images (196 merged tokens each), bf16 on CUDA.

    python benchmark/bench_vl_ttft.py [--device cuda] [--images 2] [--size 448] [--repeats 5] [--small]

`--small` shrinks everything for a CPU smoke run. Prints one line per case (median TTFT over the repeats, cached
tokens, prompt tokens, vision-tower calls) and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch


def build_checkpoint(path: str, small: bool) -> str:
    import transformers as tf

    from lmdeploy.demo_model import _special_token_ids, _vision_token_ids, build_tokenizer, save_demo_image_processor
    tokenizer = build_tokenizer('qwen3_5_vl')
    text = dict(vocab_size=len(tokenizer), hidden_size=128 if small else 1024, intermediate_size=256 if small else 3072,
                num_hidden_layers=4 if small else 8, num_attention_heads=4 if small else 8, num_key_value_heads=2,
                head_dim=32 if small else 256, linear_conv_kernel_dim=4, linear_key_head_dim=32 if small else 128,
                linear_value_head_dim=32 if small else 128, linear_num_key_heads=2 if small else 16,
                linear_num_value_heads=4 if small else 16, max_position_embeddings=32768,
                layer_types=['linear_attention'] * 3 + ['full_attention'] if small else
                (['linear_attention'] * 3 + ['full_attention']) * 2, **_special_token_ids(tokenizer))
    rotary_half = int(text['head_dim'] * 0.25) // 2
    base, rem = divmod(rotary_half, 3)
    text['rope_parameters'] = {'rope_type': 'default', 'rope_theta': 1e7, 'partial_rotary_factor': 0.25,
                               'mrope_section': [base + int(i < rem) for i in range(3)], 'mrope_interleaved': True}
    vision = dict(depth=2 if small else 8, hidden_size=64 if small else 1152, intermediate_size=128 if small else 4304,
                  num_heads=2 if small else 16, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                  num_position_embeddings=2304, out_hidden_size=text['hidden_size'])
    config = tf.Qwen3_5Config(text_config=text, vision_config=vision, **_vision_token_ids(tokenizer))
    torch.manual_seed(0)
    model = tf.Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    model.generation_config = tf.GenerationConfig(**_special_token_ids(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    save_demo_image_processor(path, min_pixels=64 * 64, max_pixels=1024 * 1024)
    return path


def make_image(seed: int, size: int):
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def ttft_ms(engine, ids, spans) -> tuple[float, int]:
    """Milliseconds from submission to the first token (device synchronised), and the cached prompt tokens."""
    from lmdeploy.pytorch.messages import SamplingParams
    seen: list[tuple[float, int]] = []
    if engine.device.type == 'cuda':
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.add_request(ids, SamplingParams(max_new_tokens=1), mm_spans=spans,
                       callback=lambda out: seen.append((time.perf_counter(), out.num_cached)))
    while engine.has_work:
        engine.step()
    if engine.device.type == 'cuda':
        torch.cuda.synchronize()
    return (seen[0][0] - start) * 1e3, seen[-1][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--images', type=int, default=2)
    parser.add_argument('--size', type=int, default=448)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--small', action='store_true', help='tiny model and images (CPU smoke run)')
    args = parser.parse_args()
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    from lmdeploy.serve.tokenizer import Tokenizer
    from lmdeploy.serve.vision.processor import ImageProcessor

    path = build_checkpoint(tempfile.mkdtemp(prefix='bench-vl-'), args.small)
    dtype = 'bfloat16' if args.device == 'cuda' else 'float32'
    engine = Engine(path, PytorchEngineConfig(device_type=args.device, dtype=dtype, enable_prefix_caching=True,
                                              prefix_cache_state_budget=64, num_gpu_blocks=2048, block_size=64,
                                              max_batch_size=8, session_len=16384))
    calls = []
    encode = engine.model.encode_images
    engine.model.encode_images = lambda pixels, grids: (calls.append(len(grids)), encode(pixels, grids))[1]
    tokenizer, processor = Tokenizer(path), ImageProcessor(path, engine.model_config.image_token_id)
    size = 64 if args.small else args.size

    def prompt(seed: int, lead: str, question: str):
        images = [make_image(seed * 100 + i, size) for i in range(args.images)]
        parts = [{'type': 'text', 'text': lead}] + [{'type': 'image', 'image': im} for im in images] + [
            {'type': 'text', 'text': question}]
        ids = tokenizer.encode(tokenizer.apply_chat_template([{'role': 'user', 'content': parts}]),
                               add_special_tokens=False)
        return processor.expand(ids, images)

    ttft_ms(engine, *prompt(999, 'Warm-up.', 'Go.'))  # kernels compiled, pools touched
    cases = {'cold': [], 'same_images_new_question': [], 'new_text_same_images': []}
    for r in range(args.repeats):
        cases['cold'].append((*ttft_ms(engine, *prompt(r, 'Look at these pictures.', 'What do you see?')),
                              len(calls)))
        cases['same_images_new_question'].append(
            (*ttft_ms(engine, *prompt(r, 'Look at these pictures.', 'Which one is brighter, and why?')), len(calls)))
        cases['new_text_same_images'].append(
            (*ttft_ms(engine, *prompt(r, 'A different opening sentence first.', 'What do you see?')), len(calls)))
    ids, spans = prompt(0, 'Look at these pictures.', 'What do you see?')
    result = {'device': args.device, 'images': args.images, 'image_tokens': sum(s.end - s.start for s in spans),
              'prompt_tokens': len(ids), 'last_image_end': spans[-1].end, 'vision_cache': engine.stats}
    for name, rows in cases.items():
        result[name] = {'ttft_ms_median': statistics.median(t for t, _, _ in rows),
                        'cached_tokens': [c for _, c, _ in rows]}
        print(f'{name:28s} TTFT median {result[name]["ttft_ms_median"]:8.2f} ms   cached {rows[-1][1]:5d} / '
              f'{len(ids)} prompt tokens')
    print(f'vision tower calls: {len(calls)} (cold prompts only: the new-question hits skip it, the new-text '
          f'prompts hit the encoder cache)')
    result['vision_tower_calls'] = len(calls)
    result['vision_cache'] = {k: v for k, v in engine.stats.items() if k.startswith('vision_cache')}
    print(json.dumps(result))


if __name__ == '__main__':
    main()
