"""Token embedding and the LM head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weir.layers.linear import Linear


class VocabEmbedding(nn.Module):
    """``weight [vocab_size, hidden_size]``; a lookup, no init cost."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [num_tokens, hidden]


class LMHead(Linear):
    """Hidden states -> logits. ``tie_to`` shares the embedding's weight (one tensor, not a copy)."""

    def __init__(self, hidden_size: int, vocab_size: int, tie_to: VocabEmbedding | None = None):
        super().__init__(hidden_size, vocab_size, bias=False)
        if tie_to is not None:
            self.weight = tie_to.weight
