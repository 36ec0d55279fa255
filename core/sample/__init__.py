"""Sampling: the sampler and its per-row state, the per-step metadata and the torch reference ops.

The Triton kernels (``triton_sampler``, ``triton_sample_filters``, ``triton_penalties``) are
imported only when a CUDA tensor reaches the sampler, so importing Weir never needs Triton.
"""

from weir.sample.metadata import SamplingMetadata
from weir.sample.sampler import Sampler, SamplerOutput
from weir.sample.states import SamplingStates, as_int64_seed

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "SamplingStates", "as_int64_seed"]
