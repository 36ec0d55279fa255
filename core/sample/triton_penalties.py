"""Triton penalties of the sampler: repetition, frequency and presence in one pass.

``ops.apply_penalties`` is the oracle. Each batch row reads its penalties, output-token counts
and prompt-token mask at its sampler row (``idx_mapping[row]``), so no ``[B, V]`` copy of the
penalty state is gathered per step. Division is IEEE (``div_rn``) and fused multiply-adds are
off, so each value rounds as the torch op's separate multiply and subtract do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weir.sample.metadata import SamplingMetadata

PENALTY_BLOCK = 1024


@triton.jit
def _penalties_kernel(
    logits_ptr, logits_stride,  # [B, V], any float dtype
    out_ptr, out_stride,  # [B, V] fp32 (out)
    idx_mapping_ptr,  # [B] int64: the sampler row of each batch row
    counts_ptr, counts_stride,  # [rows, V] int32
    prompt_mask_ptr, prompt_mask_stride,  # [rows, V] bool, read when HAS_PROMPT_MASK
    repetition_ptr, frequency_ptr, presence_ptr,  # [R] fp32 each, read at the sampler row
    vocab_size,
    HAS_PROMPT_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    in_vocab = tokens < vocab_size
    req = tl.load(idx_mapping_ptr + row)
    logits = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + tokens, mask=in_vocab).to(tl.float32)
    counts = tl.load(counts_ptr + req * counts_stride + tokens, mask=in_vocab, other=0)  # [BLOCK] int32
    output_seen = counts > 0
    seen = output_seen
    if HAS_PROMPT_MASK:
        prompt_seen = tl.load(prompt_mask_ptr + req * prompt_mask_stride + tokens, mask=in_vocab, other=0)
        seen = seen | (prompt_seen != 0)
    repetition = tl.load(repetition_ptr + req)
    penalised = tl.where(logits > 0, tl.math.div_rn(logits, repetition), logits * repetition)
    logits = tl.where(seen, penalised, logits)
    logits = logits - tl.load(frequency_ptr + req) * counts.to(tl.float32)
    logits = logits - tl.load(presence_ptr + req) * output_seen.to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + tokens, logits, mask=in_vocab)


def apply_penalties_triton(logits: torch.Tensor, metadata: SamplingMetadata,
                           block: int = PENALTY_BLOCK) -> torch.Tensor:
    """``ops.apply_penalties`` of each batch row: new ``[B, V]`` fp32 logits (``logits``, of any
    float dtype with last stride 1, is left as it is)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    counts, prompt_mask = metadata.output_token_counts, metadata.prompt_token_mask
    out = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out
    has_prompt_mask = prompt_mask is not None
    prompt_mask = prompt_mask if has_prompt_mask else counts
    _penalties_kernel[(num_rows, triton.cdiv(vocab_size, block))](
        logits, logits.stride(0), out, out.stride(0), metadata.idx_mapping,
        counts, counts.stride(0), prompt_mask, prompt_mask.stride(0),
        metadata.repetition_penalty, metadata.frequency_penalty, metadata.presence_penalty,
        vocab_size, HAS_PROMPT_MASK=has_prompt_mask, BLOCK=block, enable_fp_fusion=False,
    )
    return out
