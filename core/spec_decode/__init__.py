"""Speculative decoding: drafts proposed on the device, verified by the target in one forward."""
