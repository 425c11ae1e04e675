"""The paged KV block manager: no leaks, no wrong sharing, and a prefix cache that pays off."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from graft.engine.block_manager import BlockManager
from graft.engine.sequence import Sequence

BS = 64


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence(prompt_token_ids=list(tokens))


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Allocate and 'compute' the whole uncached prompt, as one prefill step would."""
    bm.allocate(seq, len(seq) - bm.num_cached_prefix_tokens(seq))
    seq.num_computed_tokens = len(seq)
    bm.register_full_blocks(seq)


PREFIX = list(range(1000, 1000 + 3 * BS))


def test_requests_sharing_a_three_block_prefix_share_exactly_those_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = seq_of(PREFIX + [1] * 50)
    prefill(bm, first)
    second = seq_of(PREFIX + [2] * 30)
    assert bm.num_cached_prefix_tokens(second) == 192
    bm.allocate(second, len(second) - 192)
    assert second.num_cached_tokens == 192
    assert second.num_computed_tokens == 192
    assert second.block_table[:3] == first.block_table[:3]
    assert second.block_table[3] not in first.block_table
    assert [bm.ref_count(b) for b in first.block_table] == [2, 2, 2, 1]
    bm.check_invariants()


def test_a_freed_cached_block_is_reused_by_a_later_identical_prefix():
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = seq_of(PREFIX + [7])
    prefill(bm, first)
    shared = first.block_table[:3]
    bm.free(first)
    assert bm.num_free_blocks == 8
    later = seq_of(PREFIX + [9, 9])
    bm.allocate(later, 2)
    assert later.block_table[:3] == shared
    assert later.num_cached_tokens == 192
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_the_last_prompt_token_is_always_computed_so_there_are_logits_to_sample():
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = seq_of(PREFIX)
    prefill(bm, first)
    again = seq_of(PREFIX)
    assert bm.num_cached_prefix_tokens(again) == 128
    bm.allocate(again, 64)
    assert again.block_table[:2] == first.block_table[:2]
    assert bm.ref_count(again.block_table[2]) == 1  # it will write the last block: never shared
    bm.check_invariants()


def test_cached_free_blocks_are_recycled_last_and_oldest_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    old = seq_of(PREFIX + [1])
    prefill(bm, old)
    kept = old.block_table[:3]
    bm.free(old)
    filler = seq_of([5] * (2 * BS))  # the two never-hashed blocks go first
    bm.allocate(filler, 2 * BS)
    assert not set(filler.block_table) & set(kept)
    assert bm.num_cached_prefix_tokens(seq_of(PREFIX + [1])) == 192
    bm.free(filler)  # its blocks were never registered: they stay plain free
    grow = seq_of([6] * (3 * BS))
    bm.allocate(grow, 3 * BS)
    # 3 plain blocks again (the filler's two and the one that held old's partial tail)
    assert bm.num_cached_prefix_tokens(seq_of(PREFIX + [1])) == 192
    more = seq_of([8] * BS)
    bm.allocate(more, BS)
    # the oldest cached block goes now: the prefix tail was freed first, so the prefix head survives
    assert bm.num_cached_prefix_tokens(seq_of(PREFIX + [1])) == 128
    bm.check_invariants()


def test_usage_and_fragmentation_follow_the_partial_last_blocks():
    bm = BlockManager(num_blocks=10, block_size=BS)
    assert bm.usage == 0.0 and bm.fragmentation == 0.0
    seq = seq_of(list(range(BS + 1)))
    bm.allocate(seq, BS + 1)
    assert bm.usage == pytest.approx(0.2)
    assert bm.fragmentation == pytest.approx((BS - 1) / (2 * BS))
    bm.free(seq)
    assert bm.usage == 0.0 and bm.fragmentation == 0.0


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    first = seq_of(PREFIX + [1])
    prefill(bm, first)
    second = seq_of(PREFIX + [1])
    assert bm.num_cached_prefix_tokens(second) == 0
    bm.allocate(second, len(second))
    assert not set(first.block_table) & set(second.block_table)
    bm.check_invariants()


def test_allocation_beyond_the_free_blocks_is_refused_with_a_clear_error():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = seq_of([3] * (2 * BS + 1))
    assert not bm.can_allocate(seq, 2 * BS + 1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(seq, 2 * BS + 1)
    with pytest.raises(ValueError):
        bm.allocate(seq_of([1, 2]), 3)  # more tokens than the sequence has
    assert bm.num_free_blocks == 2
    bm.check_invariants()


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError):
        BlockManager(0, BS)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


# property-based: random allocate / compute / append / free / preempt sequences

SMALL_BS = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 10, []]


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a BlockManager like a scheduler would, over a fake physical KV cache.

    A slot's K/V depend on its token and every token before it, so the fake cache stores that
    whole prefix: a sequence reading a slot written for another prefix is caught.
    """

    @initialize(num_blocks=st.integers(4, 24), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, SMALL_BS, enable_prefix_caching=caching)
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix its K/V encode
        self.live: list[Sequence] = []

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(1, 3), max_size=12))
    def arrive(self, prefix: list[int], tail: list[int]) -> None:
        if prefix or tail:
            self.live.append(seq_of(prefix + tail))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data) -> None:
        """One prefill chunk or decode step for a sequence, if its blocks fit."""
        seq = data.draw(st.sampled_from(self.live))
        start = seq.num_computed_tokens + self.bm.num_cached_prefix_tokens(seq)
        if start == len(seq):
            return
        n = data.draw(st.integers(1, len(seq) - start))
        if not self.bm.can_allocate(seq, n):
            return
        bm_before = list(seq.block_table)
        self.bm.allocate(seq, n)
        assert seq.block_table[:len(bm_before)] == bm_before
        assert seq.num_computed_tokens == start
        self._check_reads(seq)
        tokens = seq.token_ids
        for pos in range(start, start + n):
            block = seq.block_table[pos // SMALL_BS]
            assert self.bm.ref_count(block) == 1, "a sequence writes into a shared block"
            self.kv[(block, pos % SMALL_BS)] = tuple(tokens[:pos + 1])
        seq.num_computed_tokens += n
        self.bm.register_full_blocks(seq)
        if seq.num_computed_tokens == len(seq):
            seq.output_token_ids.append(data.draw(st.integers(1, 3)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq)
        self.live.remove(seq)
        assert seq.block_table == []

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq)
        seq.num_computed_tokens = 0

    def _check_reads(self, seq: Sequence) -> None:
        """Every computed position of the sequence's table holds K/V of that sequence's own prefix."""
        tokens = seq.token_ids
        for pos in range(seq.num_computed_tokens):
            block = seq.block_table[pos // SMALL_BS]
            assert self.kv.get((block, pos % SMALL_BS)) == tuple(tokens[:pos + 1]), f"wrong K/V at {pos}"

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        for seq in self.live:
            self._check_reads(seq)
        assert 0.0 <= self.bm.usage <= 1.0
        assert 0.0 <= self.bm.fragmentation < 1.0

    def teardown(self) -> None:
        for seq in self.live:
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked"


BlockManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_no_block_is_leaked_or_shared_wrongly = BlockManagerMachine.TestCase
