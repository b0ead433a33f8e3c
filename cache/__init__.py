"""The two-stream KV cache: bookkeeping of two layouts (paged, dense), their storage, the attention
backends that read them (one table: backends.py), and the camera head's token cache."""

from . import backends, fp8
from .backends import BackendSpec
from .dense import DenseTwoStreamCache, SlotMove, VisibleRange
from .dense_attention import DenseAttention, DenseKV, SplitCudnnAttention, merge_partial_attention
from .kv_cache import AttentionBackend, CacheStep, DenseKVCache, KVCache, PagedKVCache
from .layout import CacheCapacityError, CacheLayout
from .paged import SPECIAL_PAGES_AT_START, PagedTwoStreamCache
from .paged_attention import PagedKV, SDPAPagedAttention
from .pages import POOL_GROWTH_PAGES, PagePool, VisiblePages
from .streams import DeviceValues, run_beside
from .token_cache import TokenCache

__all__ = [
    "POOL_GROWTH_PAGES",
    "SPECIAL_PAGES_AT_START",
    "AttentionBackend",
    "BackendSpec",
    "CacheCapacityError",
    "CacheLayout",
    "CacheStep",
    "DenseAttention",
    "DenseKV",
    "DenseKVCache",
    "DenseTwoStreamCache",
    "DeviceValues",
    "KVCache",
    "PagePool",
    "PagedKV",
    "PagedKVCache",
    "PagedTwoStreamCache",
    "SDPAPagedAttention",
    "SlotMove",
    "SplitCudnnAttention",
    "TokenCache",
    "VisiblePages",
    "VisibleRange",
    "backends",
    "fp8",
    "merge_partial_attention",
    "run_beside",
]
