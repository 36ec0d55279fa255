"""Device buffers shared by the runner and the sampler: staged writes and host-to-device copies.

A neutral package below both, so neither imports the other for its buffers.
"""

from weir.buffers.staged_write import StagedWriteTensor, host_to_device, int64_arrays_to_device, scatter_flat

__all__ = ["StagedWriteTensor", "host_to_device", "int64_arrays_to_device", "scatter_flat"]
