"""Paged KV cache bookkeeping on the host: block pools, one per cache group, and the per-request manager."""

from weir.kv_cache.block_pool import BlockPool
from weir.kv_cache.manager import GroupConfig, KVCacheManager

__all__ = ["BlockPool", "GroupConfig", "KVCacheManager"]
