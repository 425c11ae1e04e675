"""Paged KV cache bookkeeping: free list, reference counts, block tables and the prefix cache.

A block holds `block_size` consecutive tokens of one sequence. Full blocks are named by a hash
chained over every token before them, so two requests with the same prefix can share the same
physical blocks. Only full blocks that a sequence will never write into again are shared, so no
copy-on-write is needed. A freed block keeps its hash and can still be found by a later request
until the block is recycled for something else; cached free blocks are recycled last, oldest first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from graft.engine.sequence import Sequence


def block_hash(prev: bytes, tokens: list[int]) -> bytes:
    """Hash of a full block given the hash of the block before it (b"" for the first)."""
    # a cryptographic digest: a collision would silently serve another prompt's keys and values
    return hashlib.blake2b(prev + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    """Allocates KV blocks to sequences; `seq.block_table` is the sequence's list of block ids."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._free: list[int] = list(reversed(range(num_blocks)))  # free, no hash: recycled first
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free, hashed: least recent first
        self._cache: dict[bytes, int] = {}                          # hash -> block holding it
        self._seqs: dict[int, Sequence] = {}                        # sequences holding a table
        self._num_hashed: dict[int, int] = {}                       # seq_id -> leading blocks hashed

    # state
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of blocks referenced by some sequence."""
        return self.num_used_blocks / self.num_blocks

    @property
    def fragmentation(self) -> float:
        """Share of the used blocks' token slots that hold no token (the tails of last blocks)."""
        used = self.num_used_blocks
        if not used:
            return 0.0
        # shared blocks are always full, so the waste of each table's tail is counted once
        waste = 0
        for seq in self._seqs.values():
            slots = len(seq.block_table) * self.block_size
            waste += slots - min(len(seq), slots)
        return waste / (used * self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # queries
    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens the first `allocate` of `seq` would take from the prefix cache (0 once allocated)."""
        if seq.seq_id in self._seqs:
            return 0
        return len(self._match(seq)) * self.block_size

    def num_allocatable_tokens(self, seq: Sequence) -> int:
        """How many new tokens (beyond any cached prefix) `allocate(seq, n)` could take right now."""
        if seq.seq_id in self._seqs:
            room = len(seq.block_table) * self.block_size - seq.num_computed_tokens
            return room + self.num_free_blocks * self.block_size
        hits = self._match(seq)
        revived = sum(1 for b in hits if self._ref[b] == 0)
        return (self.num_free_blocks - revived) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `allocate(seq, num_new_tokens)` would succeed."""
        return num_new_tokens <= self.num_allocatable_tokens(seq)

    # changes
    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` to cover `seq.num_computed_tokens + num_new_tokens` tokens.

        On the first call for a sequence, its leading full blocks found in the prefix cache are
        shared and `seq.num_computed_tokens` / `seq.num_cached_tokens` jump past them first, so
        `num_new_tokens` counts the tokens the model will actually compute.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        end = self.num_cached_prefix_tokens(seq) + seq.num_computed_tokens + num_new_tokens
        if end > len(seq):
            raise ValueError(f"sequence {seq.seq_id} has {len(seq)} tokens; cannot allocate up to {end}")
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError(f"out of KV blocks: sequence {seq.seq_id} needs room for "
                               f"{num_new_tokens} tokens, {self.num_free_blocks} blocks free")
        if seq.seq_id not in self._seqs:
            self._admit(seq)
        needed = -(-end // self.block_size)
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_free())

    def register_full_blocks(self, seq: Sequence) -> None:
        """Make the blocks that `seq.num_computed_tokens` has filled findable by later requests."""
        if not self.enable_prefix_caching or seq.seq_id not in self._seqs:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        done = self._num_hashed[seq.seq_id]
        if full <= done:
            return
        tokens = seq.token_ids
        table = seq.block_table
        for i in range(done, full):
            prev = self._hash[table[i - 1]] if i else b""
            h = block_hash(prev, tokens[i * bs:(i + 1) * bs])
            self._hash[table[i]] = h
            self._cache.setdefault(h, table[i])  # an identical block computed twice: the first one serves
        self._num_hashed[seq.seq_id] = full

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (safe for a sequence holding none)."""
        if self._seqs.pop(seq.seq_id, None) is None:
            return
        self._num_hashed.pop(seq.seq_id, None)
        # tail first: under LRU recycling a prefix outlives its continuations
        for b in reversed(seq.block_table):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._release(b)
        seq.block_table = []

    # internals
    def _match(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the leading full blocks of `seq`, never covering its last token."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        tokens = seq.token_ids
        hits: list[int] = []
        prev = b""
        for i in range((len(tokens) - 1) // bs):
            prev = block_hash(prev, tokens[i * bs:(i + 1) * bs])
            b = self._cache.get(prev)
            if b is None:
                break
            hits.append(b)
        return hits

    def _admit(self, seq: Sequence) -> None:
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} has a block table or computed tokens "
                             "but was never allocated here")
        hits = self._match(seq)
        for b in hits:
            if self._ref[b] == 0:
                del self._cached_free[b]
            self._ref[b] += 1
        seq.block_table = list(hits)
        cached = len(hits) * self.block_size
        seq.num_computed_tokens = cached
        seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
        self._seqs[seq.seq_id] = seq
        self._num_hashed[seq.seq_id] = len(hits)

    def _take_free(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._cached_free.popitem(last=False)
            h = self._hash[b]
            if self._cache.get(h) == b:
                del self._cache[h]
            self._hash[b] = None
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        h = self._hash[b]
        if h is not None and self._cache.setdefault(h, b) == b:
            self._cached_free[b] = None
        else:
            self._hash[b] = None
            self._free.append(b)

    # checks
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by the tests)."""
        counts = [0] * self.num_blocks
        for seq in self._seqs.values():
            table = seq.block_table
            assert len(set(table)) == len(table), f"seq {seq.seq_id}: a block twice in its table {table}"
            assert len(table) * self.block_size >= seq.num_computed_tokens, \
                f"seq {seq.seq_id}: its table is shorter than its computed tokens"
            for b in table:
                counts[b] += 1
        free = self._free + list(self._cached_free)
        assert len(set(free)) == len(free), "a block twice in the free lists"
        free_set = set(free)
        for b in range(self.num_blocks):
            assert counts[b] == self._ref[b], f"block {b}: ref {self._ref[b]} but {counts[b]} tables hold it"
            assert (self._ref[b] == 0) == (b in free_set), \
                f"block {b}: ref {self._ref[b]}, in the free lists: {b in free_set}"
        for b in self._free:
            assert self._hash[b] is None, f"plain free block {b} has a hash"
        for b in self._cached_free:
            assert self._cache.get(self._hash[b]) == b, f"cached free block {b} is not findable"
        for h, b in self._cache.items():
            assert self._hash[b] == h, f"cache entry points at block {b} holding another hash"
