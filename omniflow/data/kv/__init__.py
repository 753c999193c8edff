"""The Global Params Pool: paged, tiered KV storage with shared metadata (docs/contract.md §7).

Four layers, bottom up: the physical paging layer (``_layout``, ``_tiers``), the slot engine
(``_sketch``, ``_slots``: a pure core), the metadata coordination (``_meta``, ``_redis``,
``_hosted``, ``_notice``) and the data-flow loop: ``ParamsPool`` (``_pool``) is the shell
(``_shell``: state and lifecycle) and owns its parts ``_moves``, ``_fetch``, ``_match`` and
``_subscribe``; ``_pull`` carries pages between processes.
"""

from omniflow._exceptions import PoolExhaustedError
from omniflow.data.kv._layout import Match, PageLayout, chain_hashes
from omniflow.data.kv._meta import MemoryMetadata, Metadata
from omniflow.data.kv._pool import ParamsPool
from omniflow.data.kv._slots import SlotCore

__all__ = [
    "Match",
    "MemoryMetadata",
    "Metadata",
    "PageLayout",
    "ParamsPool",
    "PoolExhaustedError",
    "SlotCore",
    "chain_hashes",
]
