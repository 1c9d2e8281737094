"""A tiny Qwen3-VL checkpoint built locally: the real classes at toy sizes, for offline tests and fallback.

    python -m qvl.tiny DIR [--thinking]
"""
import argparse
import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

# Qwen's special tokens, in Qwen's order; the tiny vocabulary puts them right after the 256 byte tokens.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]

# Qwen3-VL-Instruct's chat template, without the tool-calling branches the demo never uses.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or 'image' in content -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif content['type'] == 'text' -%}{{- content['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen3-VL-Thinking's, likewise: a past answer keeps only what follows its reasoning's </think>, and the prompt ends
# inside the next one's reasoning, so that the model writes its reasoning, </think>, then the answer.
THINKING_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' or 'image' in part -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- set content = render(message['content']) -%}"
    "{%- if message['role'] == 'assistant' and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
)


def _tokenizer(thinking: bool = False) -> PreTrainedTokenizerFast:
    # Byte-level BPE with no merges: every UTF-8 string round-trips, and the vocabulary stays at 256 + specials.
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    if thinking:  # tokens of their own, as Qwen's, that decoding keeps (they are not special)
        tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=THINKING_TEMPLATE if thinking else CHAT_TEMPLATE, model_max_length=4096,
    )


def build(out_dir: str | Path, seed: int = 0, thinking: bool = False) -> Path:
    """Write a complete tiny checkpoint (model, tokenizer, processor config) to out_dir and return it; thinking: a
    Thinking model's (Qwen3-VL-2B-Thinking's template and <think> tokens), the same model otherwise."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(thinking)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=5000000, mrope_section=[2, 3, 3], mrope_interleaved=True),
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            num_position_embeddings=64, deepstack_visual_indexes=[0], patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2,
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": 64 * 32 * 32, "longest_edge": 16384 * 32 * 32},
    ).save_pretrained(out)
    (out / "qvl_tiny.json").write_text(json.dumps({"seed": seed, "thinking": thinking}))
    return out


def main():
    parser = argparse.ArgumentParser(prog="python -m qvl.tiny", description="Write the tiny offline Qwen3-VL (random "
                                     "weights, real classes) to a folder, for `python app.py --model DIR`.")
    parser.add_argument("dir", help="the folder to write")
    parser.add_argument("--thinking", action="store_true", help="a Thinking model's template and tokens: its answers "
                        "come after a reasoning, as Qwen3-VL-2B-Thinking's do")
    args = parser.parse_args()
    print(build(args.dir, thinking=args.thinking))
