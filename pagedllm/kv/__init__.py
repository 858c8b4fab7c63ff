"""The memory manager: physical blocks, block tables, prefix cache. No torch here."""
from .block_pool import Block, BlockPool, NoFreeBlocksError
from .block_table import BlockTable
from .hashing import hash_block
from .manager import POLICIES, KVCacheManager, KVStats

__all__ = ["Block", "BlockPool", "BlockTable", "KVCacheManager", "KVStats", "NoFreeBlocksError",
           "POLICIES", "hash_block"]
