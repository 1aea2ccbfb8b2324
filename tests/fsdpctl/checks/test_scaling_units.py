"""Scale-test arithmetic and the smoke test's per-rank figures."""

from __future__ import annotations

import pytest

from fsdpctl.checks.scaling import efficiency, node_counts, strong_global_batch
from fsdpctl.checks.training import per_rank_figures


@pytest.mark.parametrize(("n", "counts"), [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]),
                                           (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8])])
def test_node_counts_double_and_end_at_n(n, counts):
    assert node_counts(n) == counts


def test_efficiency_is_throughput_over_linear():
    assert efficiency({1: 100.0, 2: 180.0, 4: 300.0}) == {1: 1.0, 2: 0.9, 4: 0.75}
    with pytest.raises(ValueError, match="1-node"):
        efficiency({2: 100.0})


@pytest.mark.parametrize(("counts", "nproc"), [
    ([1, 2], 1), ([1, 2, 3], 1), ([1, 2, 4], 8), ([1, 2, 4, 6], 2)])
def test_strong_global_batch_divides_every_world_size(counts, nproc):
    batch = strong_global_batch(counts, nproc)
    assert all(batch % (k * nproc) == 0 for k in counts)
    assert batch // (max(counts) * nproc) >= 2


def test_per_rank_figures_take_each_ranks_peak():
    lines = [{"step": 1, "tokens_per_s": 10.0, "mem_bytes_per_rank": [5, 9]},
             {"step": 2, "tokens_per_s": 400.0, "mem_bytes_per_rank": [7, 8]},
             {"step": 3, "tokens_per_s": 600.0, "mem_bytes_per_rank": [6, 8]}]
    assert per_rank_figures(lines) == [{"rank": 0, "max_mem_bytes": 7}, {"rank": 1, "max_mem_bytes": 9}]
    assert per_rank_figures([{"step": 1, "tokens_per_s": 1.0}]) == []
