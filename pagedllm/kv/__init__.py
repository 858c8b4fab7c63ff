"""The memory manager: physical blocks, block tables per layer group, prefix cache. No torch here."""
from .block_pool import Block, BlockPool, NoFreeBlocksError, PoolFigures
from .block_table import BlockTable
from .connector import ConnectorWorker, KVConnector, OffloadConnector, TierFigures
from .groups import KVGroup, KVLayout, kv_layout
from .hashing import hash_block
from .manager import POLICIES, KVCacheManager
from .pool_shape import PoolShape
from .prefix_hit import PrefixHit
from .stats import GroupFigures, KVStats

__all__ = ["Block", "BlockPool", "BlockTable", "ConnectorWorker", "GroupFigures", "KVCacheManager", "KVConnector",
           "KVGroup", "KVLayout", "KVStats", "NoFreeBlocksError", "OffloadConnector", "POLICIES", "PoolFigures",
           "PoolShape", "PrefixHit", "TierFigures", "hash_block", "kv_layout"]
