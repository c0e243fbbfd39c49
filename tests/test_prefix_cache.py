"""graphrt.hf.prefix_cache: the radix tree over token ids alone (insert, match, split, LRU eviction, locks),
the semantics of SGLang's RadixCache tests in our own words."""

from __future__ import annotations

import random

import pytest

from graphrt.hf.prefix_cache import PrefixCache, common_length


def test_common_length():
    assert common_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_length([1, 2, 3], [1, 5, 3]) == 1
    assert common_length([], [1]) == 0
    assert common_length([7], [8]) == 0


def test_insert_then_match_returns_the_slots_of_the_longest_cached_prefix():
    cache = PrefixCache()
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    assert cache.match([1, 2, 3, 4, 5])[0] == [10, 11, 12, 13]
    assert cache.match([1, 2, 9])[0] == [10, 11]
    assert cache.match([5, 1])[0] == []
    assert cache.cached_tokens == cache.evictable_tokens == 4


def test_insert_says_how_much_was_cached_and_keeps_only_the_new_slots():
    cache = PrefixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    assert cache.insert([1, 2, 3, 4, 5], [20, 21, 22, 23, 24]) == 3  # 20..22 stay the caller's
    assert cache.match([1, 2, 3, 4, 5])[0] == [10, 11, 12, 23, 24]
    assert cache.insert([1, 2], [30, 31]) == 2
    assert cache.cached_tokens == 5
    with pytest.raises(ValueError, match="slots: expected one slot per token"):
        cache.insert([1, 2], [1])


def test_a_match_inside_an_edge_splits_it_and_both_branches_stay_reachable():
    cache = PrefixCache()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    slots, node = cache.match([1, 2, 7])
    assert slots == [10, 11] and node.tokens == [1, 2]  # the node covers exactly the match
    assert [child.tokens for child in node.children.values()] == [[3, 4]]
    cache.insert([1, 2, 7, 8], [10, 11, 20, 21])
    assert cache.match([1, 2, 3, 4])[0] == [10, 11, 12, 13]
    assert cache.match([1, 2, 7, 8])[0] == [10, 11, 20, 21]
    assert cache.cached_tokens == 6


def test_eviction_frees_the_least_recently_used_leaves_first():
    cache = PrefixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 2, 4], [10, 11, 14])  # shares [1, 2]: leaves [3] and [4]
    cache.insert([5, 6], [15, 16])
    cache.match([1, 2, 3])  # [3] and its ancestors used last; [4] and [5, 6] before
    assert sorted(cache.evict(1)) == [14]  # the oldest leaf
    assert sorted(cache.evict(2)) == [15, 16]
    assert cache.match([1, 2, 3])[0] == [10, 11, 12]
    assert cache.cached_tokens == cache.evictable_tokens == 3


def test_a_parent_left_without_children_is_evicted_in_its_turn():
    cache = PrefixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 2, 4], [10, 11, 14])
    assert sorted(cache.evict(10)) == [10, 11, 12, 14]  # all of it, fewer than asked
    assert cache.cached_tokens == cache.evictable_tokens == 0
    assert cache.match([1, 2, 3])[0] == []


def test_locked_nodes_and_their_ancestors_are_never_evicted():
    cache = PrefixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 2, 4], [10, 11, 14])
    _, node = cache.match([1, 2, 3])
    cache.lock(node)
    assert cache.evictable_tokens == 1  # only [4]
    assert cache.evict(100) == [14]
    assert cache.match([1, 2, 3])[0] == [10, 11, 12]
    with pytest.raises(RuntimeError, match="running requests read"):
        cache.clear()
    cache.unlock(node)
    assert cache.evictable_tokens == 3
    assert sorted(cache.clear()) == [10, 11, 12]
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(node)


def test_a_split_of_a_locked_node_keeps_the_lock_on_both_parts():
    cache = PrefixCache()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    _, whole = cache.match([1, 2, 3, 4])
    cache.lock(whole)
    _, head = cache.match([1, 2, 9])  # splits the locked edge
    assert head.locks == 1 and whole.parent is head
    assert cache.evict(100) == []
    cache.unlock(whole)  # releases both parts
    assert head.locks == 0 and cache.evictable_tokens == 4


def test_random_operations_keep_the_sizes_true_and_matches_consistent():
    """Against a plain dict of every inserted sequence: every cached prefix matches its own slots, and the
    counted sizes equal the tree's."""
    rng = random.Random(0)
    cache, slot_of = PrefixCache(), {}
    locked = []
    next_slot = 100
    for _ in range(300):
        action = rng.random()
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
        if action < 0.5:
            slots = []
            for length in range(1, len(tokens) + 1):
                key = tuple(tokens[:length])
                if key not in slot_of:
                    slot_of[key] = next_slot
                    next_slot += 1
                slots.append(slot_of[key])
            cache.insert(tokens, slots)
        elif action < 0.7:
            _, node = cache.match(tokens)
            if node is not cache.root:
                cache.lock(node)
                locked.append(node)
        elif action < 0.85 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randrange(1, 4))
        nodes = cache._nodes()
        assert cache.cached_tokens == sum(len(node.tokens) for node in nodes)
        assert cache.evictable_tokens == sum(len(node.tokens) for node in nodes if node.locks == 0)
        assert all(node.locks <= node.parent.locks or node.parent is cache.root for node in nodes)
        slots, _ = cache.match(tokens)
        assert slots == [slot_of[tuple(tokens[:length])] for length in range(1, len(slots) + 1)]
    for node in locked:
        cache.unlock(node)
    assert cache.evictable_tokens == cache.cached_tokens
