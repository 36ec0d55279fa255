"""The draft heads fed the target's hidden states (``weir.spec_decode.eagle``): what the
proposer calls on them, and the base of heads that use the target's embedding and LM head.

A head is an ``nn.Module`` with ``forward(input_ids, positions, hidden, ctx, step) -> (the
logits' input, the next pass's hidden)`` (``step`` 0 is the pass over a step's tokens, fed
``target_hidden`` of the target's; later passes feed the head's own hidden back),
``attention_layers()`` (its paged layers, riding in the target's cache groups), and the methods
of ``TargetSharedHead``: ``bind_target`` / ``watch_target`` once the target is loaded,
``target_hidden``, ``compute_logits`` and ``draft_tokens`` (target vocabulary ids).
"""

from __future__ import annotations

import torch
from torch import nn


class TargetSharedHead(nn.Module):
    """A head whose embedding and LM head are the target's (MTP blocks; EAGLE heads whose
    checkpoint has none of their own, ``embedding`` / ``output_head`` overridden where it has)."""

    def __init__(self):
        super().__init__()
        self._target: tuple = ()  # (embed_tokens, lm_head) of the target, not parameters of this head

    def bind_target(self, target: nn.Module) -> None:
        self._target = (target.model.embed_tokens, target.lm_head)

    def watch_target(self, target: nn.Module) -> None:
        """Nothing beyond the target's final hidden states is needed."""

    def target_hidden(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return last_hidden  # [num_tokens, hidden], post-norm

    def embedding(self) -> nn.Module:
        return self._target[0]

    def output_head(self) -> nn.Module:
        return self._target[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output_head()(hidden)  # [num_rows, vocab]

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden).argmax(dim=-1)  # [num_rows]
