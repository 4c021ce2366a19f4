"""Tiny random-weight Hugging Face checkpoints for tests and demos.

Everything is built offline: the tokenizer is a byte-level BPE trained on a small built-in corpus and the models are
randomly initialised with transformers, so no download is ever needed.
"""

from __future__ import annotations

import functools
import os
import shutil
import string
import tempfile
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SUPPORTED_ARCHS = ('qwen3', 'qwen3_5', 'qwen3_next', 'qwen3_5_vl')
DEMO_MODEL_VERSION = 'v1'
# Archs whose demo checkpoint changed since (v2: the VL demo has vision tokens and a preprocessor_config.json).
_ARCH_DEMO_VERSIONS = {'qwen3_5_vl': 'v2'}
TOKENIZER_VOCAB_SIZE = 1024
ENDOFTEXT = '<|endoftext|>'
IM_START = '<|im_start|>'
IM_END = '<|im_end|>'
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Vision-language checkpoints add Qwen's vision tokens after the text specials (names as in the released vocabulary).
VISION_START = '<|vision_start|>'
VISION_END = '<|vision_end|>'
IMAGE_PAD = '<|image_pad|>'
VIDEO_PAD = '<|video_pad|>'
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
# Tiny image budget (pixels) of the demo VL processor: 2 x 2 to 4 x 4 merged tokens of 32 x 32 pixels.
DEMO_MIN_PIXELS = 64 * 64
DEMO_MAX_PIXELS = 128 * 128

CHATML_TEMPLATE = (
    '{%- for message in messages %}'
    '{%- if message["content"] is string %}{%- set content = message["content"] %}'
    '{%- else %}{%- set content = namespace(text="") %}'
    '{%- for part in message["content"] %}{%- if part["type"] == "text" %}'
    '{%- set content.text = content.text + part["text"] %}{%- endif %}{%- endfor %}'
    '{%- set content = content.text %}{%- endif %}'
    '{{- "<|im_start|>" + message["role"] + "\\n" + content + "<|im_end|>\\n" }}'
    '{%- endfor %}'
    '{%- if add_generation_prompt %}{{- "<|im_start|>assistant\\n" }}{%- endif %}'
)
# ChatML with Qwen-VL image parts: each `image` / `image_url` part becomes vision start, one image pad, vision end.
CHATML_VL_TEMPLATE = (
    '{%- for message in messages %}'
    '{{- "<|im_start|>" + message["role"] + "\\n" }}'
    '{%- if message["content"] is string %}{{- message["content"] }}'
    '{%- else %}{%- for part in message["content"] %}'
    '{%- if part["type"] == "text" %}{{- part["text"] }}'
    '{%- elif part["type"] in ("image", "image_url") %}{{- "<|vision_start|><|image_pad|><|vision_end|>" }}'
    '{%- endif %}{%- endfor %}{%- endif %}'
    '{{- "<|im_end|>\\n" }}'
    '{%- endfor %}'
    '{%- if add_generation_prompt %}{{- "<|im_start|>assistant\\n" }}{%- endif %}'
)

# Same pre-tokenization as the Qwen2/Qwen3 tokenizer; Qwen3.5 additionally groups combining marks with letters.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN3_5_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

TOKENIZER_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village near the mountains, there lived an old clockmaker named Elias. Every morning
he opened his shop at seven o'clock, wound the great clock above the door, and waited for visitors. Children would
press their faces against the window to watch the tiny gears turning, and their parents would smile and say that
nobody in the whole country could fix a watch as well as he could.
The weather today is cloudy with a chance of rain in the afternoon. Temperatures will reach a high of 18 degrees
Celsius, falling to 9 degrees overnight. Winds from the north-west at 20 kilometres per hour. Tomorrow should be
sunny and warmer, so it is a good day for a walk in the park or a picnic by the river.
To make a simple tomato soup, you will need: two onions, three cloves of garlic, one kilogram of ripe tomatoes,
a litre of vegetable stock, olive oil, salt and pepper. First, chop the onions and garlic and fry them gently in the
oil until soft. Then add the tomatoes and the stock, bring everything to the boil, and let it simmer for twenty
minutes. Finally, blend the soup until smooth and season it to taste. Serve hot with fresh bread.
Astronomers study stars, planets, comets, and galaxies. The Sun is a medium-sized star about 150 million kilometres
from the Earth. Light from the Sun takes a little more than eight minutes to reach us. The Moon orbits the Earth
roughly once every twenty-seven days, and its gravity causes the tides in the oceans. Jupiter is the largest planet
in our solar system; Saturn is famous for its beautiful rings; Mars is often called the red planet.
In computer science, an algorithm is a finite sequence of well-defined instructions. Sorting algorithms such as
quicksort, merge sort, and heap sort arrange data in order. A hash table stores key-value pairs and supports fast
lookups. Programs are written in languages like Python, C, Rust, Go, and JavaScript, and they run on processors
that execute billions of simple operations per second. Good software is tested, documented, and easy to read.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(f"fib({i}) = {fibonacci(i)}")
"What time is it?" asked the traveller. "It's half past four," replied the guard. "The next train leaves at five."
"Thank you very much. Could you tell me where the ticket office is?" "Of course: walk straight ahead, then turn left
after the cafe. You can't miss it." The traveller nodded, picked up her suitcase, and hurried down the platform.
History teaches us that great empires rise and fall. The ancient Romans built roads, bridges, and aqueducts that
still stand today. The printing press, invented in the fifteenth century, allowed books to be produced quickly and
cheaply, which helped spread knowledge across Europe. The industrial revolution changed how people worked and
lived, moving millions from farms to factories and cities.
Numbers and dates: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 256, 1024, 2048, 3.14159, 2.71828, 1/2, 3/4, 50%.
On 12 March 2021 the meeting started at 09:30 and ended at 11:45. The invoice total was $1,234.56 (including tax).
Email: hello@example.com, website: https://www.example.org/path?query=value&page=2#section.
Questions to think about: Why is the sky blue? How do birds know where to fly in winter? What makes music sound
happy or sad? Can machines learn to understand language? Scientists, artists, and philosophers have asked such
questions for centuries, and every answer seems to lead to new questions.
A healthy lifestyle includes regular exercise, a balanced diet, enough sleep, and time spent with friends and
family. Drinking water, eating fruit and vegetables, and walking every day are simple habits that make a big
difference. Reading books, learning new skills, and helping others can also improve our happiness and well-being.
The library was quiet except for the soft rustle of pages. Shelves of old books stretched from the floor to the
ceiling, and the air smelled of paper, leather, and dust. A student sat at a wooden table near the window, writing
notes in a small notebook, while the librarian sorted returned books onto a trolley.
User: Hello! Can you help me write a short poem about the sea?
Assistant: Of course. Here is a short poem:
The sea is wide, the sea is deep,
It sings the sailors off to sleep;
With silver waves and golden light,
It dances through the day and night.
User: That is lovely, thank you!
Assistant: You're welcome. Let me know if you would like another one.
Mathematics is the language of patterns. Addition, subtraction, multiplication, and division are the basic
operations. An equation such as x + 3 = 7 has the solution x = 4. The area of a circle is pi times the radius
squared, and the sum of the angles in a triangle is always 180 degrees. Prime numbers like 2, 3, 5, 7, 11, and 13
can only be divided by one and themselves.
The garden was full of colour in the spring: red tulips, yellow daffodils, purple lilacs, and white cherry
blossoms. Bees buzzed from flower to flower, collecting nectar, while a blackbird sang from the top of the apple
tree. In the summer the vegetables grew tall, and in the autumn the leaves turned orange and brown before falling.
Travel tips: pack light, keep copies of important documents, learn a few words of the local language, try the local
food, and always carry a bottle of water. Trains are often faster than planes for short distances, and buses are
usually the cheapest option. Remember to check opening hours before visiting museums and galleries.
{"name": "example", "version": "1.0.0", "items": [1, 2, 3], "enabled": true, "ratio": 0.5, "tags": ["a", "b"]}
SELECT id, name, price FROM products WHERE price < 20 ORDER BY name;
<html><head><title>Demo</title></head><body><p>Hello, world!</p></body></html>
Football, tennis, basketball, cricket, swimming, and cycling are popular sports around the world. Athletes train
for years to compete in the Olympic Games, which take place every four years. Teamwork, discipline, patience, and
practice are important in sport, just as they are in school, at work, and in everyday life.
"""
TOKENIZER_CORPUS += ' '.join(string.printable) + '\n'

_HYBRID_ARCHS = ('qwen3_5', 'qwen3_next', 'qwen3_5_vl')
_QWEN3_5_ARCHS = ('qwen3_5', 'qwen3_5_vl')

_BASE_TEXT_KWARGS: dict[str, Any] = {
    'hidden_size': 64,
    'intermediate_size': 128,
    'num_attention_heads': 4,
    'num_key_value_heads': 2,
    'head_dim': 16,
    'max_position_embeddings': 4096,
    'initializer_range': 0.1,
    'tie_word_embeddings': False,
}
_LINEAR_ATTN_KWARGS: dict[str, Any] = {
    'linear_conv_kernel_dim': 4,
    'linear_key_head_dim': 16,
    'linear_value_head_dim': 16,
    'linear_num_key_heads': 2,
    'linear_num_value_heads': 4,
}
_ARCH_TEXT_KWARGS: dict[str, dict[str, Any]] = {
    'qwen3': {'num_hidden_layers': 2},
    'qwen3_5': {'num_hidden_layers': 4, **_LINEAR_ATTN_KWARGS},
    'qwen3_5_vl': {'num_hidden_layers': 4, **_LINEAR_ATTN_KWARGS},
    'qwen3_next': {
        'num_hidden_layers': 4,
        **_LINEAR_ATTN_KWARGS,
        'num_experts': 4,
        'num_experts_per_tok': 2,
        'moe_intermediate_size': 32,
        'shared_expert_intermediate_size': 32,
        'decoder_sparse_step': 1,
        'mlp_only_layers': [],
        'norm_topk_prob': True,
    },
}
_VISION_KWARGS: dict[str, Any] = {
    'depth': 2,
    'hidden_size': 32,
    'intermediate_size': 64,
    'num_heads': 2,
    'patch_size': 16,
    'temporal_patch_size': 2,
    'spatial_merge_size': 2,
    'num_position_embeddings': 64,
    'initializer_range': 0.1,
}
# demo checkpoints are a bit bigger than the test ones but still fast on CPU
_DEMO_BASE = {'hidden_size': 128, 'intermediate_size': 256, 'head_dim': 32}
_DEMO_LINEAR = {'linear_key_head_dim': 32, 'linear_value_head_dim': 32}
_DEMO_OVERRIDES: dict[str, dict[str, Any]] = {
    'qwen3': _DEMO_BASE,
    'qwen3_5': {**_DEMO_BASE, **_DEMO_LINEAR},
    'qwen3_5_vl': {**_DEMO_BASE, **_DEMO_LINEAR},
    'qwen3_next': {**_DEMO_BASE, **_DEMO_LINEAR, 'moe_intermediate_size': 64, 'shared_expert_intermediate_size': 64},
}
_PERTURB_NAME_KEYS = ('norm', 'A_log', 'dt_bias', 'conv1d')
_PERTURB_SCALE = 0.05


# ----------------------------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------------------------
def _pretokenize_regex(arch: str) -> str:
    return QWEN3_5_PRETOKENIZE_REGEX if arch in _QWEN3_5_ARCHS else QWEN2_PRETOKENIZE_REGEX


@functools.lru_cache(maxsize=4)
def _train_tokenizer_json(regex: str, vocab_size: int) -> str:
    """Train a byte-level BPE on the built-in corpus; returns the tokenizer serialized as json."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior='isolated', invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(TOKENIZER_CORPUS.splitlines(keepends=True), trainer=trainer)
    # special tokens go after the BPE vocab, like the Qwen tokenizers
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok.to_str()


def build_tokenizer(arch: str = 'qwen3', vocab_size: int = TOKENIZER_VOCAB_SIZE):
    """Build the demo ChatML tokenizer (a fresh ``PreTrainedTokenizerFast``; the BPE training is cached)."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_train_tokenizer_json(_pretokenize_regex(arch), vocab_size))
    is_vl = arch == 'qwen3_5_vl'
    if is_vl:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        extra_special_tokens=list(SPECIAL_TOKENS + (VISION_TOKENS if is_vl else ())),
        chat_template=CHATML_VL_TEMPLATE if is_vl else CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=_BASE_TEXT_KWARGS['max_position_embeddings'],
    )


# ----------------------------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------------------------
def _hybrid_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    return ['linear_attention' if (i + 1) % interval else 'full_attention' for i in range(num_layers)]


def _mrope_section(rotary_half_dim: int) -> list[int]:
    """Split ``rotary_dim // 2`` into (t, h, w) sections the way Qwen does ([11, 11, 10] for 32)."""
    base, rem = divmod(rotary_half_dim, 3)
    return [base + int(i < rem) for i in range(3)]


def _rope_parameters(arch: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    rope: dict[str, Any] = {'rope_type': 'default', 'rope_theta': 10000.0}
    if arch == 'qwen3':
        return rope
    rope['partial_rotary_factor'] = 0.25
    if arch in _QWEN3_5_ARCHS:
        rotary_dim = int(kwargs['head_dim'] * rope['partial_rotary_factor'])
        rope['mrope_section'] = _mrope_section(rotary_dim // 2)
        rope['mrope_interleaved'] = True
    return rope


def _text_kwargs(arch: str, vocab_size: int, token_ids: dict[str, int],
                 overrides: dict[str, Any] | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(vocab_size=vocab_size, **_BASE_TEXT_KWARGS, **_ARCH_TEXT_KWARGS[arch], **token_ids)
    kwargs.update(overrides or {})
    if arch in _HYBRID_ARCHS and 'layer_types' not in kwargs:
        interval = kwargs.pop('full_attention_interval', 4)
        kwargs['layer_types'] = _hybrid_layer_types(kwargs['num_hidden_layers'], interval)
    kwargs.setdefault('rope_parameters', _rope_parameters(arch, kwargs))
    if kwargs['vocab_size'] < vocab_size:
        raise ValueError(f'vocab_size={kwargs["vocab_size"]} is smaller than the tokenizer ({vocab_size}).')
    return kwargs


def _vision_token_ids(tokenizer) -> dict[str, int]:
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    return {'vision_start_token_id': start, 'vision_end_token_id': end, 'image_token_id': image,
            'video_token_id': video}


def save_demo_image_processor(path: str, min_pixels: int = DEMO_MIN_PIXELS, max_pixels: int = DEMO_MAX_PIXELS
                              ) -> None:
    """`preprocessor_config.json` of the demo VL checkpoints (Qwen2-VL image processor, Qwen3.5's patch sizes)."""
    import json
    config = {'image_processor_type': 'Qwen2VLImageProcessor', 'patch_size': _VISION_KWARGS['patch_size'],
              'temporal_patch_size': _VISION_KWARGS['temporal_patch_size'],
              'merge_size': _VISION_KWARGS['spatial_merge_size'],
              'size': {'shortest_edge': min_pixels, 'longest_edge': max_pixels},
              'image_mean': [0.5, 0.5, 0.5], 'image_std': [0.5, 0.5, 0.5]}
    with open(os.path.join(path, 'preprocessor_config.json'), 'w') as f:
        json.dump(config, f, indent=2)


def _build_model(arch: str, text_kwargs: dict[str, Any], vision_ids: dict[str, int] | None = None
                 ) -> torch.nn.Module:
    import transformers as tf

    if arch == 'qwen3':
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**text_kwargs))
    if arch == 'qwen3_5':
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text_kwargs))
    if arch == 'qwen3_next':
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**text_kwargs))
    if arch == 'qwen3_5_vl':
        vision = dict(_VISION_KWARGS, out_hidden_size=text_kwargs['hidden_size'])
        config = tf.Qwen3_5Config(text_config=text_kwargs, vision_config=vision,
                                  tie_word_embeddings=text_kwargs['tie_word_embeddings'], **(vision_ids or {}))
        return tf.Qwen3_5ForConditionalGeneration(config)
    raise ValueError(f'Unsupported arch {arch!r}; expected one of {SUPPORTED_ARCHS}.')


def _perturb_(model: torch.nn.Module, scale: float = _PERTURB_SCALE) -> None:
    """Add noise to 1-D / norm / linear-attention parameters so identity-like init can't hide bugs."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 or any(key in name for key in _PERTURB_NAME_KEYS):
                param.add_(scale * torch.randn_like(param))


def _special_token_ids(tokenizer) -> dict[str, int]:
    endoftext, im_end = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    return {'bos_token_id': endoftext, 'eos_token_id': im_end, 'pad_token_id': endoftext}


def _set_generation_config(model: torch.nn.Module, token_ids: dict[str, int]) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(**token_ids)


# ----------------------------------------------------------------------------------------------------------------
# public api
# ----------------------------------------------------------------------------------------------------------------
def save_tiny_model(path: str,
                    arch: str = 'qwen3',
                    config_overrides: dict | None = None,
                    seed: int = 0,
                    perturb: bool = True,
                    dtype: str = 'float32',
                    weights: bool = True) -> str:
    """Build a tiny random-weight HF checkpoint (model + tokenizer) of ``arch`` into ``path``; returns ``path``.
    ``weights=False``: config, generation config and tokenizer only (the model is built on the meta device), for
    ``load_format='dummy'`` at shapes too large to draw and save on the host."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f'Unsupported arch {arch!r}; expected one of {SUPPORTED_ARCHS}.')
    if dtype not in ('float32', 'bfloat16', 'float16'):
        raise ValueError(f'Unsupported dtype {dtype!r}.')
    tokenizer = build_tokenizer(arch)
    token_ids = _special_token_ids(tokenizer)
    text_kwargs = _text_kwargs(arch, len(tokenizer), token_ids, config_overrides)
    torch.manual_seed(seed)
    with torch.device('cpu' if weights else 'meta'):
        model = _build_model(arch, text_kwargs, _vision_token_ids(tokenizer) if arch == 'qwen3_5_vl' else None)
    if perturb and weights:
        _perturb_(model)
    _set_generation_config(model, token_ids)
    model = model.to(getattr(torch, dtype)).eval()
    os.makedirs(path, exist_ok=True)
    if weights:
        model.save_pretrained(path)
    else:
        model.config.dtype = getattr(torch, dtype)
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(path)
        model.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if arch == 'qwen3_5_vl':
        save_demo_image_processor(path)
    return path


def _cache_dir() -> str:
    return os.environ.get('LMDEPLOY_CACHE_DIR') or os.path.join(os.path.expanduser('~'), '.cache', 'lmdeploy')


def get_demo_model_path(arch: str = 'qwen3') -> str:
    """Return the folder of the cached demo checkpoint of ``arch``, building it atomically on first use."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f'Unsupported arch {arch!r}; expected one of {SUPPORTED_ARCHS}.')
    parent = _cache_dir()
    target = os.path.join(parent, f'demo-{arch}-{_ARCH_DEMO_VERSIONS.get(arch, DEMO_MODEL_VERSION)}')
    if os.path.isfile(os.path.join(target, 'config.json')):
        return target
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f'.demo-{arch}-', dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be readable
    try:
        save_tiny_model(tmp, arch=arch, config_overrides=_DEMO_OVERRIDES[arch])
        os.rename(tmp, target)
    except OSError:
        # another process won the race: use its folder
        if not os.path.isfile(os.path.join(target, 'config.json')):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
