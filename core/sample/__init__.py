"""Sampling: per-step metadata, the torch reference ops and the sampler."""

from weir.sample.metadata import SamplingMetadata, build_sampling_metadata
from weir.sample.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "build_sampling_metadata"]
