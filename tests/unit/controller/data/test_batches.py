"""What the step loop takes from data.py: shards, the wire dtype, the prefetcher. Sources, the
token cache and the dataset have their own test modules."""
import numpy as np
import pytest

from multipod.controller.data.batches import DataError, shard


def test_shard_splits_evenly():
    batch = np.arange(24, dtype=np.int32).reshape(6, 4)
    parts = shard(batch, 2)
    assert [p.shape for p in parts] == [(3, 4), (3, 4)]
    assert np.array_equal(np.concatenate(parts), batch)
    with pytest.raises(DataError):
        shard(batch, 4)


def test_tokens_travel_as_the_narrowest_dtype_that_holds_the_vocabulary():
    from multipod.controller.data.batches import Prefetcher, narrow, token_dtype
    from multipod.protos import codec
    assert token_dtype(256) == np.uint8 and token_dtype(200) == np.uint8
    assert token_dtype(257) == (np.uint16 if "uint16" in codec.DTYPES else np.int32)
    assert token_dtype(1 << 17) == np.int32
    tokens = np.array([[0, 255], [7, 1]], np.int32)
    assert narrow(tokens).dtype == np.uint8 and (narrow(tokens) == tokens).all()
    with pytest.raises(DataError):
        narrow(np.array([[256]], np.int32), np.uint8)

    class Batches:
        def batch(self, index):
            return np.full((4, 9), index, np.int32)

        def loss_mask(self, index):
            return None
    prefetch = Prefetcher(Batches(), 2, 0, 1, dtype=np.uint8)
    try:
        step, shards = prefetch.next(10)
    finally:
        prefetch.close()
    assert shards.masks == [b"", b""] and shards.global_tokens == 4 * 8
    decoded = [codec.decode(s) for s in shards.tokens]
    assert step == 0 and [d.dtype for d in decoded] == [np.uint8] * 2 and [d.shape for d in decoded] == [(2, 9)] * 2
