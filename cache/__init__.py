"""Two-stream paged KV cache: page bookkeeping and the attention backends that read the pages."""

from .contiguous import ContiguousTwoStreamCache, SlotMove, VisibleRange
from .dense_attention import ContiguousKV, DenseAttention, SplitCudnnAttention, merge_partial_attention
from .paged_attention import KVStep, PagedKV, SDPAPagedAttention
from .pages import CacheCapacityError, PagePool, VisiblePages
from .streams import DeviceValues, run_beside
from .token_cache import TokenCache
from .two_stream import CacheLayout, TwoStreamCache

__all__ = [
    "CacheCapacityError",
    "CacheLayout",
    "ContiguousKV",
    "ContiguousTwoStreamCache",
    "DeviceValues",
    "DenseAttention",
    "KVStep",
    "PagePool",
    "PagedKV",
    "SDPAPagedAttention",
    "SlotMove",
    "SplitCudnnAttention",
    "TokenCache",
    "TwoStreamCache",
    "VisiblePages",
    "VisibleRange",
    "merge_partial_attention",
    "run_beside",
]
