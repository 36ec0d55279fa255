"""Paged KV cache bookkeeping on the host: the block pool and the per-request manager."""

from weir.kv_cache.block_pool import BlockPool
from weir.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager"]
