"""Unit tests of ray_ppo.coordinator.routing: which trainer ranks each maker sends to."""

from __future__ import annotations

import pytest

from ray_ppo.coordinator.routing import get_receivers_per_sender, receivers


@pytest.mark.parametrize("num_senders, num_receivers, expected", [
    (2, 1, [[0], [0]]),
    (1, 2, [[0, 1]]),
    (2, 2, [[0], [1]]),
    (3, 2, [[0], [1], [0]]),
    (2, 4, [[0, 2], [1, 3]]),
    (3, 5, [[0, 3], [1, 4], [2]]),
])
def test_modulo_topology(num_senders, num_receivers, expected):
    got = [get_receivers_per_sender(i, num_senders, num_receivers) for i in range(num_senders)]
    assert got == expected


@pytest.mark.parametrize("num_senders", range(1, 7))
@pytest.mark.parametrize("num_receivers", range(1, 7))
def test_every_receiver_is_fed(num_senders, num_receivers):
    lists = [get_receivers_per_sender(i, num_senders, num_receivers) for i in range(num_senders)]
    assert set().union(*lists) == set(range(num_receivers))
    assert all(lists)  # every sender sends somewhere
    if num_senders >= num_receivers:
        assert all(len(r) == 1 for r in lists)
    else:  # each receiver has exactly one sender
        assert sorted(r for rs in lists for r in rs) == list(range(num_receivers))


@pytest.mark.parametrize("sender, senders, receivers_", [(2, 2, 1), (-1, 2, 1), (0, 1, 0)])
def test_out_of_range(sender, senders, receivers_):
    with pytest.raises(ValueError, match="out of range"):
        get_receivers_per_sender(sender, senders, receivers_)


def test_round_robin_sends_to_every_rank():
    assert receivers("round_robin", 1, 3, 4) == [0, 1, 2, 3]
    assert receivers("round_robin", 0, 1, 1) == [0]


def test_modulo_uses_the_modulo_rule():
    assert receivers("modulo", 1, 2, 4) == [1, 3]
    assert receivers("modulo", 2, 3, 2) == [0]


def test_unknown_routing():
    with pytest.raises(ValueError, match="unknown topology.routing 'random'; choose round_robin or modulo"):
        receivers("random", 0, 1, 1)
