"""Tiny Qwen3 checkpoints rigged to emit a fixed script, for testing what the server makes of a model's output.

How the weights force the script: every attention `o_proj` and MLP `down_proj` is zero, so each layer adds nothing
to the residual stream and the final hidden state is the (normalised) embedding of the *current* token alone. Each
script piece is one added token whose embedding is a one-hot vector in its own hidden dimension, and `lm_head`
maps that dimension to the next piece with a logit margin of ~80: the next token is a function of the current one,
so greedy and sampled decoding (any temperature up to 2) both emit the script. The last token of the chat
template's generation prompt ("trigger") leads to the first piece; the last piece leads to `<|im_end|>` (or back to
the first piece when `loop=True`, so the model never stops on its own).
"""
from __future__ import annotations

import os

import torch
import transformers as tf
from tokenizers import AddedToken

from lmdeploy.demo_model import ENDOFTEXT, IM_END, build_tokenizer

_MARGIN = 10.0


def _trigger_ids(tokenizer, generation_prompts: list[str]) -> list[int]:
    return sorted({tokenizer.encode(text, add_special_tokens=False)[-1] for text in generation_prompts})


def save_scripted_model(path: str, script: list[str], chat_template: str, generation_prompts: list[str],
                        loop: bool = False) -> str:
    """Save a checkpoint that, after any prompt ending like one of `generation_prompts`, emits `script`."""
    if len(set(script)) != len(script):
        raise ValueError('script pieces must be distinct (the next token is a function of the current one)')
    tokenizer = build_tokenizer('qwen3')
    tokenizer.add_tokens([AddedToken(piece, normalized=False, special=False) for piece in script])
    tokenizer.chat_template = chat_template
    piece_ids = [tokenizer.convert_tokens_to_ids(piece) for piece in script]
    triggers = _trigger_ids(tokenizer, generation_prompts)
    if set(triggers) & set(piece_ids):
        raise ValueError('a generation prompt ends in a script piece')
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    transitions = [(t, piece_ids[0]) for t in triggers] + list(zip(piece_ids, piece_ids[1:]))
    transitions.append((piece_ids[-1], piece_ids[0] if loop else eos))
    hidden = 64
    if len(transitions) > hidden:
        raise ValueError(f'at most {hidden} transitions')
    vocab = -(-len(tokenizer) // 64) * 64
    bos = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = tf.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                            tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos, pad_token_id=bos)
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(('o_proj.weight', 'down_proj.weight')):
                param.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        model.model.norm.weight.fill_(1.0)
        for dim, (src, dst) in enumerate(transitions):
            embed[src] = 0.0
            embed[src, dim] = 1.0
            head[dst, dim] = _MARGIN
    model.generation_config = tf.GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=bos)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
