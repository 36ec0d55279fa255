"""Device kernels behind plain-torch seams.

Each public op lives beside its torch version (the oracle, and the path on every device
Triton does not serve); the Triton kernels sit in ``triton_*`` modules that are imported
only when a CUDA tensor reaches the op, so importing Weir never needs Triton.
"""
