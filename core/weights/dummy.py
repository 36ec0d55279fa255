"""Random ("dummy") weights, for benchmarking a model from its config.json alone.

The model is already materialised on the target device (built on meta, ``to_empty``); every
parameter is filled in place there, so no host tensor and no host-to-device copy is involved
and even an 8B model is ready in well under a second on a GPU.

Values follow the usual benchmark convention: uniform in [-1e-3, 1e-3], which keeps activations
small and finite through any depth, except norm weights, which are 1 (and norm biases 0) so
each normalised layer passes its input through at unit scale instead of shrinking it.
"""

from __future__ import annotations

import torch
from torch import nn

DUMMY_LOW = -1e-3
DUMMY_HIGH = 1e-3


def _is_norm(module: nn.Module) -> bool:
    # RMSNorm, LayerNorm and plugin norms alike; matching on the name keeps plugins free of
    # any registration just for dummy weights.
    return "norm" in type(module).__name__.lower()


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Overwrite every parameter of ``model`` in place, on the device it lives on.

    Deterministic for a given ``seed`` and device; parameters shared by several modules (tied
    embeddings) are filled once.
    """
    norm_params: set[int] = set()
    for module in model.modules():
        if _is_norm(module):
            for name, param in module.named_parameters(recurse=False):
                param.fill_(1.0 if name == "weight" else 0.0)
                norm_params.add(id(param))
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if id(param) in norm_params:
            continue
        if not param.is_floating_point():
            param.zero_()  # quantised or index tensors: zeros are valid, random bits may not be
            continue
        generator = generators.get(param.device)
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
            generators[param.device] = generator
        if param.element_size() < 2:
            # 8-bit float types have no uniform_ kernel: draw in fp16 on the device, then cast.
            values = torch.empty(param.shape, dtype=torch.float16, device=param.device)
            param.copy_(values.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=generator))
        else:
            param.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=generator)
