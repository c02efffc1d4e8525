"""The publish stage's split of a large shard over forked processes."""

from __future__ import annotations

import pytest

from supplier_sync_dagster.core.sync.stages import LAST_CHUNK_HOTELS, split_for_processes


@pytest.mark.parametrize("hotels", [4001, 5000, 8373, 20000])
def test_split_for_processes_gives_each_process_equal_chunks_and_a_short_last(
    hotels: int,
) -> None:
    cands = list(range(hotels))
    head, last = split_for_processes(cands, 2000, 2)  # type: ignore[arg-type]
    assert [x for part in head for x in part] + list(last) == cands  # each hotel once, in order
    assert 0 < len(last) <= LAST_CHUNK_HOTELS
    assert len(head) % 2 == 0
    sizes = [len(p) for p in head]
    assert max(sizes) - min(sizes) <= 1 or sizes[-1] < sizes[0]
    assert all(1000 <= n <= 3000 for n in sizes[:-1])
    # Each of the two processes publishes the same number of hotels, give or take a chunk's
    # rounding.
    assert abs(sum(sizes[0::2]) - sum(sizes[1::2])) <= max(sizes) // 2
