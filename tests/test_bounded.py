"""``put_bounded``, the one bounded-cache rule, against a list model of a FIFO written here."""

import random

import pytest

from moekit._bounded import put_bounded


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("limit", [1, 3, 8])
def test_put_bounded_keeps_the_newest_inserted_keys(seed, limit):
    rng = random.Random(seed)
    cache: dict = {}
    order: list = []  # the model: keys in insertion order, a replaced key keeping its place
    values: dict = {}
    for step in range(300):
        key, value = rng.randrange(12), step
        if rng.random() < 0.15 and order:  # another owner (a weakref callback, a forget) removes one entry
            gone = rng.choice(order)
            del cache[gone]
            order.remove(gone)
            continue
        assert put_bounded(cache, key, value, limit) == value
        if key not in order:
            if len(order) >= limit:
                order.pop(0)
            order.append(key)
        values[key] = value
        assert list(cache) == order
        assert all(cache[k] == values[k] for k in order)
        assert len(cache) <= limit

