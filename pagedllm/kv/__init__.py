"""The memory manager: physical blocks, block tables, prefix cache. No torch here."""
from .block_pool import Block, BlockPool, NoFreeBlocksError
from .block_table import BlockTable
from .hashing import hash_block
from .manager import POLICIES, KVCacheManager, KVStats
from .pool_shape import PoolShape

__all__ = ["Block", "BlockPool", "BlockTable", "KVCacheManager", "KVStats", "NoFreeBlocksError",
           "POLICIES", "PoolShape", "hash_block"]
