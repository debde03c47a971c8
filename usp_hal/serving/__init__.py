"""Serving long contexts on the sequence-parallel mesh: the KV cache sharded over it, prefill
through the USP call, decode merged exactly by lse (:mod:`usp_hal.serving.kv_cache`), and its
block table, pure bookkeeping (:mod:`usp_hal.serving.blocktable`)."""
from .kv_cache import SERVING_WHAT, ShardedKVCache, decode_bytes, merge_partials

__all__ = ["ShardedKVCache", "merge_partials", "decode_bytes", "SERVING_WHAT"]
