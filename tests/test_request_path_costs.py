"""The request path's per-token work done in C, checked against the plain Python it
replaced (docs/PERFORMANCE.md, "The served path's own cost of a long prompt"): the prefix
cache's radix walk (``common_len``: ``lookup``, ``shared_len``, ``_insert``), the KV
ledger's eviction gain, the completions prompt's token-id validation and the scan for
ignored request fields."""
from __future__ import annotations

import random
from typing import Union

import pytest
from pydantic import ConfigDict, TypeAdapter, ValidationError

from ppspec.router.kv_ledger import Letting, PageLedger
from ppspec.router.prefix_cache import PrefixCache, common_len
from ppspec.router.protocol import ChatCompletionRequest, CompletionRequest, ignored_fields


# ------------------------------------------------------------------ the radix tree
def loop_common_len(tokens, i, key):
    j = 0
    while j < len(key) and i + j < len(tokens) and key[j] == tokens[i + j]:
        j += 1
    return j


def loop_shared_len(cache: PrefixCache, tokens) -> int:
    """``shared_len`` as written before, one token at a time."""
    node, i = cache.root, 0
    while i < len(tokens):
        child = node.children.get(tokens[i])
        if child is None:
            break
        j = loop_common_len(tokens, i, child.key)
        i += j
        if j < len(child.key):
            break
        node = child
    return i


def edges(node, prefix=()):
    """Every node's full token path and its slot, and every edge's key, depth first."""
    out = []
    for first, child in sorted(node.children.items()):
        assert child.key[0] == first and child.parent is node
        path = prefix + child.key
        out.append((path, child.slot))
        out += edges(child, path)
    return out


def test_common_len_is_the_loop_everywhere():
    rnd = random.Random(0)
    key = tuple(rnd.randrange(4) for _ in range(300))
    for _ in range(2000):
        n = rnd.randrange(0, 320)
        tokens = list(key[:n]) if rnd.random() < 0.5 else [rnd.randrange(4) for _ in range(n)]
        if tokens and rnd.random() < 0.5:
            tokens[rnd.randrange(len(tokens))] = 9  # one mismatch anywhere
        i = rnd.randrange(0, len(tokens) + 1)
        k = key[: rnd.randrange(1, 301)]
        assert common_len(tokens, i, k) == loop_common_len(tokens, i, k)


def test_the_tree_and_its_lookups_are_those_of_the_token_loop():
    """Random prompts over a 3-token alphabet (many shared prefixes and edge splits) filed
    and looked up: the tree's shape, every lookup and shared_len equal what the one-token-
    at-a-time walk gives, and lookup finds the deepest filed prefix by brute force."""
    rnd = random.Random(1)
    cache = PrefixCache(400)
    filed: dict[tuple, int] = {}
    for _ in range(300):
        base = list(rnd.choice(list(filed))) if filed and rnd.random() < 0.7 else []
        key = (base[: rnd.randrange(0, len(base) + 1)] + [rnd.randrange(3) for _ in range(rnd.randrange(1, 40))])
        if len(key) < 2 or tuple(key) in filed:  # a snapshot holds at least one token
            continue
        slot = cache.reserve(len(key) - 1, "r")
        cache.commit(slot, key)
        filed[tuple(key)] = slot
        query = key[: rnd.randrange(1, len(key) + 1)] + [rnd.randrange(3) for _ in range(rnd.randrange(0, 20))]
        assert cache.shared_len(query) == loop_shared_len(cache, query)
        best = max(((s, len(k) - 1) for k, s in filed.items() if len(k) <= len(query) and tuple(query[: len(k)]) == k),
                   key=lambda x: x[1], default=(-1, 0))
        assert cache.lookup(query) == best
    # every filed key is a node holding its slot; every other node branches
    nodes = dict(edges(cache.root))
    assert {k: s for k, s in nodes.items() if s >= 0} == filed
    assert all(s >= 0 or sum(1 for k in nodes if len(k) > len(p) and k[: len(p)] == p) >= 2 for p, s in nodes.items())


# ------------------------------------------------------------------ the KV ledger's eviction gain
def test_gain_counts_the_pages_only_the_holder_keeps():
    rnd = random.Random(2)
    ledger = PageLedger(page_size=16)
    holders = [("row", i) for i in range(6)] + [("slot", i) for i in range(10)]
    ledger.grow(holders[0], 16 * 40)
    ledger.grow(holders[1], 16 * 7)
    for h in holders[2:]:
        src = rnd.choice([x for x in holders if ledger.pages.get(x)])
        ledger.take(h, src, 16 * rnd.randrange(1, len(ledger.pages[src]) + 1)) if h[0] == "slot" else \
            ledger.share(h, src, 16 * rnd.randrange(0, len(ledger.pages[src]) + 1))
        ledger.grow(h, len(ledger.pages[h]) * 16 + 16 * rnd.randrange(0, 3))
    for trial in range(50):
        letting = Letting(ledger, rnd.sample(holders, rnd.randrange(0, 8)))
        for h in holders:
            want = sum(1 for p in ledger.pages.get(h, ()) if letting.count[p] + 1 == ledger.refs[p]) * 16
            assert letting.gain(h) == want
        assert letting.gain(("slot", 99)) == 0  # holds nothing
        group = rnd.sample(holders, rnd.randrange(1, 8))
        gain = letting.together(group)
        for h in group:  # a page frees when every holder not let go yet is in the group
            want = sum(1 for p in ledger.pages.get(h, ())
                       if letting.count[p] + sum(p in ledger.pages.get(o, ()) for o in group) == ledger.refs[p]) * 16
            assert gain(h) == want


# ------------------------------------------------------------------ the completions request
UNION = TypeAdapter(Union[str, list[str], list[int], list[list[int]]], config=ConfigDict(strict=True))


@pytest.mark.parametrize("prompt", [
    [5, 6, 7], list(range(9000)), [0], [5, True, 7], [True, 5], [5, 6.0], [5, "a"], [5, None, 7], [5, [6]],
    [-3, 2], ["a", "b"], [[1, 2], [3]], "text", ["a", 5], [1 << 70],
])
def test_a_prompt_validates_as_the_union_alone_does(prompt):
    """The token-id fast path gives the value and the errors the union gives: the same
    list, or a 400 naming the same fields and kinds."""
    try:
        want = UNION.validate_python(prompt)
    except ValidationError as e:
        want_errors = [(err["type"], err["loc"]) for err in e.errors()]
        with pytest.raises(ValidationError) as got:
            CompletionRequest.model_validate({"prompt": prompt})
        assert [(err["type"], err["loc"][1:]) for err in got.value.errors()] == want_errors
        assert all(err["loc"][0] == "prompt" for err in got.value.errors())
    else:
        body = CompletionRequest.model_validate({"prompt": prompt})
        assert body.prompt == want and type(body.prompt[0] if isinstance(want, list) else want) \
            is type(want[0] if isinstance(want, list) else want)


def test_ignored_fields_name_what_a_field_walk_of_every_value_does():
    body = ChatCompletionRequest.model_validate({
        "model": "m", "extra_top": 1, "stop_token_ids": [1, 2], "stream": True,
        "messages": [{"role": "user", "content": "hi", "foo": 1},
                     {"role": "user", "content": [{"type": "text", "text": "x", "bar": 2}]}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "baz": 3}},
        "stream_options": {"include_usage": True, "qux": 4}})
    assert sorted(ignored_fields(body)) == sorted(walk_all(body))
    assert sorted(ignored_fields(body)) == ["extra_top", "messages.0.foo", "messages.1.content.0.bar",
                                           "response_format.json_schema.baz", "stream_options.qux"]
    long = CompletionRequest.model_validate({"prompt": list(range(5000)), "other": True})
    assert ignored_fields(long) == walk_all(long) == ["other"]


def walk_all(model, prefix=""):
    """The walk ``ignored_fields`` did before: every field's value, every item of a list."""
    from ppspec.router.protocol import _Request

    names = [prefix + str(k) for k in (model.model_extra or {})]
    for key in type(model).model_fields:
        value = getattr(model, key)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, _Request):
                names += walk_all(item, f"{prefix}{key}." + ("" if i is None else f"{i}."))
    return names
