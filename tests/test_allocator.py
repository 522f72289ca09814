import pytest

from dsv4kv.cache.allocator import AllocatorError, BlockAllocator


def state(alloc: BlockAllocator):
    return alloc.num_free, [alloc.refcount(b) for b in range(alloc.num_blocks)]


def test_exact_ids_and_fifo_reuse():
    alloc = BlockAllocator(5)
    assert alloc.allocate(2) == [0, 1]
    assert alloc.allocate(2) == [2, 3]
    alloc.free([1, 0])  # freed blocks go to the back, in the order given
    assert alloc.allocate(3) == [4, 1, 0]
    assert alloc.num_free == 0 and alloc.num_used == 5
    alloc.free([3])
    assert alloc.allocate(1) == [3]


def test_allocate_zero_and_too_many_changes_nothing():
    alloc = BlockAllocator(3)
    assert alloc.allocate(0) == []
    alloc.allocate(2)
    before = state(alloc)
    assert alloc.allocate(2) is None
    assert state(alloc) == before
    assert alloc.allocate(1) == [2]


def test_shared_block_returns_after_last_reference():
    alloc = BlockAllocator(2)
    (block,) = alloc.allocate(1)
    alloc.share([block])
    assert alloc.refcount(block) == 2
    alloc.free([block])
    assert alloc.refcount(block) == 1 and alloc.num_free == 1
    alloc.free([block])
    assert alloc.refcount(block) == 0 and alloc.num_free == 2


def test_double_free_raises_and_changes_nothing():
    alloc = BlockAllocator(4)
    a, b = alloc.allocate(2)
    before = state(alloc)
    with pytest.raises(AllocatorError, match="double free"):
        alloc.free([b, a, a])  # a is referenced once: the call must fail before freeing b
    assert state(alloc) == before
    alloc.free([a])
    with pytest.raises(AllocatorError, match="double free"):
        alloc.free([a])


@pytest.mark.parametrize("bad", [-1, 4, 2.0, "1", None], ids=lambda v: f"id={v!r}")
def test_unknown_block_ids_raise(bad):
    alloc = BlockAllocator(4)
    alloc.allocate(4)
    with pytest.raises(AllocatorError, match="outside"):
        alloc.free([bad])
    with pytest.raises(AllocatorError, match="outside"):
        alloc.share([bad])


def test_share_free_block_raises():
    alloc = BlockAllocator(2)
    with pytest.raises(AllocatorError, match="is free"):
        alloc.share([1])


@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(bad)
    with pytest.raises(ValueError):
        BlockAllocator(2).allocate(-1)


def test_take_pulls_free_blocks_out_of_the_queue():
    alloc = BlockAllocator(5)
    alloc.allocate(5)
    alloc.free([3, 1, 4])
    alloc.take([1])
    assert alloc.refcount(1) == 1 and alloc.free_order() == [3, 4]
    before = state(alloc)
    with pytest.raises(AllocatorError, match="take: block 0 is in use"):
        alloc.take([3, 0])  # validated first: 3 stays free
    with pytest.raises(AllocatorError, match="appears twice"):
        alloc.take([3, 3])
    assert state(alloc) == before


def test_free_to_front_and_to_front():
    alloc = BlockAllocator(6)
    alloc.allocate(6)
    alloc.free([0, 1])  # back, in order
    alloc.free([2, 3], front=True)  # front, the last given first out
    assert alloc.free_order() == [3, 2, 0, 1]
    alloc.to_front([1])
    assert alloc.free_order() == [1, 3, 2, 0]
    assert alloc.allocate(2) == [1, 3]
    with pytest.raises(AllocatorError, match="to_front: block 4 is in use"):
        alloc.to_front([4])
