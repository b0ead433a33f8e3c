"""The two-stream KV cache: bookkeeping of two layouts (paged, dense), their storage, the attention
backends that read them (one table: backends.py), and the camera head's token cache."""

from . import backends, fp8
from .backends import BackendSpec
from .dense import DenseTwoStreamCache, SlotMove, VisibleRange
from .dense_attention import DenseAttention, DenseKV, SplitCudnnAttention, merge_partial_attention
from .kv_cache import AttentionBackend, CacheStep, DenseKVCache, KVCache, PagedKVCache
from .layout import CacheCapacityError, CacheLayout
from .paged import PagedTwoStreamCache
from .paged_attention import PagedKV, SDPAPagedAttention
from .pages import PagePool, VisiblePages
from .streams import DeviceValues, run_beside
from .token_cache import TokenCache

__all__ = [
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
