"""The router's prefix cache: a radix tree over token ids, mapping cached prefixes to the
snapshot slots every stage holds (``stage_server.snapshots``).

A hybrid model's recurrent state cannot be cut back to a prefix, so a hit needs a
snapshot of the state after exactly that prefix. Snapshots are taken at prefill chunk
boundaries (a hit lands mid-prompt at chunk granularity) and when a request finishes
(the next turn of a conversation finds its prompt and reply). A slot holds the state
after ``n`` tokens and is filed in the tree under ``n + 1`` tokens: the MTP head's KV at
position ``n - 1`` was computed with token ``n``, so a request may use it only if that
token matches too; and a hit always leaves at least one token to prefill, whose logits
the request samples from.

Slots are stable ids handed to every stage. Each is in one of these states:

- free: in :attr:`PrefixCache.free`;
- taking: sent with a step or release that writes it (:meth:`reserve`), filed by
  :meth:`commit` once every stage did (the step's result, the release's reply);
- cached: in the tree; ``pins`` counts micro-batches that restore from it (never evicted
  while pinned: its restore may still be on its way through the stages);
- dropping: evicted; free again once every stage dropped it (:meth:`dropped`).

Eviction, one rule (:meth:`_order`), for a new snapshot's slot and for KV alike: first
the snapshots never restored from that a deeper snapshot on the same path supersedes (a
chunk's inside a prompt once the prompt's end is filed, a prompt's end once the finished
row's is: a request that reaches them reaches the deeper one too, unless it leaves the
path in between), then least recently used. A new snapshot that its own request will
supersede (``superseded``: a chunk's inside or at the end of its prompt, not at a branch
point) evicts only the former (:meth:`evict_one`), and takes no free slot that another
kind (a finished row's, a branch point's) evicted for; that kind evicts the first in the
order, but while a slot evicted for it is on its way only a superseded one (finished rows
ending together do not evict each other's snapshots for one another). A slot evicted for
a new snapshot is free only once every stage dropped it: the next snapshot of its kind
takes it.

KV accounting: a snapshot holds the KV pages of its tokens on every stage (shared with
rows and other snapshots), from :meth:`reserve` to :meth:`dropped`. The scheduler's KV
budget counts each page once, whoever holds it (``router.kv_ledger``), and evicts only
snapshots whose drop gives pages back.
"""
from __future__ import annotations

import itertools
from collections.abc import Collection


def common_len(tokens, i: int, key: tuple[int, ...]) -> int:
    """How many leading tokens of ``key`` equal ``tokens[i:]``'s (at most the shorter of the
    two): compared as tuple slices in C, then a binary search for the first mismatch. A
    Python loop over the tokens cost ~65 ns a token (0.5 ms for an 8000-token prompt per
    lookup, per filed snapshot: docs/PERFORMANCE.md, "The served path's own cost of a long
    prompt")."""
    n = min(len(key), len(tokens) - i)
    seg = tuple(tokens[i: i + n])
    if seg == key[:n]:
        return n
    lo, hi = 0, n  # seg[:lo] == key[:lo], seg[:hi] != key[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if seg[lo:mid] == key[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("key", "children", "parent", "slot", "last_used", "hit")

    def __init__(self, key: tuple[int, ...], parent: "_Node | None"):
        self.key, self.parent = key, parent  # key: the token ids on the edge into this node
        self.children: dict[int, _Node] = {}
        self.slot = -1
        self.last_used = 0
        self.hit = False  # a micro-batch restored from its snapshot


def _order_of(node: _Node) -> tuple[int, int]:
    """:meth:`PrefixCache._order` of the snapshot at ``node``."""
    return (1 if node.hit or not node.children else 0), node.last_used


class _Charges:
    """The default eviction plan: a snapshot's drop gives back its whole charge."""

    def __init__(self, cache: "PrefixCache"):
        self.cache = cache

    def gain(self, slot: int) -> int:
        return self.cache.charge(slot)

    def together(self, slots: list[int]):
        return self.cache.charge

    def covers(self, holder: int, slot: int) -> bool:
        return False

    def add(self, slot: int) -> None:
        pass


class PrefixCache:
    """Radix tree and slot book-keeping of ``num_slots`` snapshot slots.

    Args:
        num_slots: slots every stage holds (the smallest stage's).
        page_size: tokens per KV page (a snapshot's KV charge is rounded up to pages).
    """

    def __init__(self, num_slots: int, page_size: int = 1):
        if num_slots < 1:
            raise ValueError(f"a prefix cache needs at least one snapshot slot, got {num_slots}")
        self.num_slots, self.page_size = num_slots, max(1, page_size)
        self.root = _Node((), None)
        self.free = list(range(num_slots - 1, -1, -1))
        self.lens: dict[int, int] = {}       # slot -> tokens of state it holds (every state but free)
        self.nodes: dict[int, _Node] = {}    # cached slot -> its node
        self.pins: dict[int, int] = {}       # cached slot -> micro-batches restoring from it
        self.taking: dict[int, str] = {}     # slot -> request id whose step / release writes it
        self.to_drop: list[int] = []         # evicted, drop not sent yet
        self.dropping: set[int] = set()      # evicted, drop sent
        self._clock = itertools.count(1)
        self.owed = 0  # slots evicted for snapshots not superseded, not taken by one yet
        # counters (tokens): prompts looked up, and the part of them found
        self.queried_tokens = self.hit_tokens = 0

    # ------------------------------------------------------------------ lookup
    def lookup(self, tokens: list[int]) -> tuple[int, int]:
        """The deepest cached snapshot for ``tokens``: ``(slot, n)``, the request may start
        from the state after ``n < len(tokens)`` tokens; ``(-1, 0)`` when none. Changes
        nothing (:meth:`use` pins the slot)."""
        node, i, best = self.root, 0, (-1, 0)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None or tuple(tokens[i: i + len(child.key)]) != child.key:
                break
            i += len(child.key)
            node = child
            if node.slot >= 0:
                best = (node.slot, i - 1)
        return best

    def shared_len(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` some cached sequence shares (edges count where they
        match, snapshot or not): where a new request branches off what others sent."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            j = common_len(tokens, i, child.key)
            i += j
            if j < len(child.key):
                break
            node = child
        return i

    def use(self, slot: int) -> None:
        """A micro-batch will restore from ``slot``: pinned until :meth:`done`."""
        self.pins[slot] = self.pins.get(slot, 0) + 1
        node = self.nodes[slot]
        node.last_used, node.hit = next(self._clock), True

    def done(self, slot: int) -> None:
        """The restore from ``slot`` ran on every stage (or never will)."""
        n = self.pins.get(slot, 0) - 1
        if n > 0:
            self.pins[slot] = n
        else:
            self.pins.pop(slot, None)

    def count(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    # ------------------------------------------------------------------ taking and filing
    def charge(self, slot: int) -> int:
        """KV tokens (whole pages) the snapshot in ``slot`` holds on every stage."""
        return -(-self.lens[slot] // self.page_size) * self.page_size

    def reserve(self, length: int, request_id: str, superseded: bool = False) -> int:
        """A free slot for a snapshot of ``length`` tokens of ``request_id``'s row, or -1
        (``superseded``: none of those evicted for the other kind, :meth:`evict_one`)."""
        if len(self.free) <= (self.owed if superseded else 0) or length < 1:
            return -1
        if not superseded:
            self.owed = max(0, self.owed - 1)
        slot = self.free.pop()
        self.lens[slot], self.taking[slot] = length, request_id
        return slot

    def commit(self, slot: int, key: list[int]) -> None:
        """Every stage holds ``slot``: file it under ``key`` (its ``length + 1`` tokens).
        A prefix cached already keeps its slot; the new one is dropped."""
        self.taking.pop(slot, None)
        if len(key) != self.lens[slot] + 1:
            raise ValueError(f"slot {slot} holds {self.lens[slot]} tokens, filed under {len(key)}")
        node = self._insert(key)
        if node.slot >= 0:
            self.to_drop.append(slot)
            return
        node.slot, node.hit = slot, False
        node.last_used = next(self._clock)
        self.nodes[slot] = node

    def abandon(self, request_id: str) -> None:
        """Slots ``request_id``'s failed steps were writing: state unknown, dropped."""
        for slot, rid in list(self.taking.items()):
            if rid == request_id:
                del self.taking[slot]
                self.to_drop.append(slot)

    def _insert(self, key: list[int]) -> _Node:
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                new = _Node(tuple(key[i:]), node)
                node.children[key[i]] = new
                return new
            k = child.key
            j = common_len(key, i, k)
            if j < len(k):  # split the edge after its first j tokens
                mid = _Node(k[:j], node)
                node.children[key[i]] = mid
                child.key, child.parent = k[j:], mid
                mid.children[k[j]] = child
                child = mid
            node, i = child, i + j
        return node

    # ------------------------------------------------------------------ eviction
    def _order(self, slot: int) -> tuple[int, int]:
        """Where ``slot`` comes in the eviction order (lowest first): ``(0, ·)`` for a
        snapshot never restored from with a deeper one below it on its path (every node
        but the root holds a snapshot or has children, so ``children`` means one below:
        the requests that reach it reach that one as well, but for one that leaves the path
        in between), ``(1, ·)`` for the rest; then least recently used (filed or restored
        from)."""
        return _order_of(self.nodes[slot])

    def evict(self, tokens: int, keep: Collection[int] = (), plan=None) -> int:
        """Evict unpinned snapshots (not those in ``keep``) in :meth:`_order` until dropping them
        gives back ``tokens`` of KV (or none is left), passing over those whose drop would
        give back nothing more (their pages are held by a running row, or by a snapshot
        kept). ``plan``: ``gain(slot)``, the KV tokens dropping ``slot`` too would give back,
        ``together(slots)``, a ``gain`` of each of ``slots`` were they all dropped together, and
        ``add(slot)`` (``router.kv_ledger.Letting`` over slots; default: each slot's
        :meth:`charge`). When no one drop gives anything back but some together do
        (snapshots holding the same pages: a prompt's end and its short reply's end in one
        page), the first of those in that order goes first. Returns what the evicted ones
        give back once every stage dropped them."""
        if tokens <= 0:
            return 0  # (the caller's drops under way cover it: no sort of every cached slot)
        plan = plan or _Charges(self)
        evicted, got = [], 0
        pins = self.pins
        # _order's key from the node at hand (not looked up again by slot for each)
        left = [s for _, s in sorted((_order_of(n), s) for s, n in self.nodes.items()
                                     if s not in pins and s not in keep)]
        progress = True
        while got < tokens and progress:  # again after a pass: a drop may free another's pages
            progress, passed = False, []
            for slot in left:
                if got >= tokens or self._covered(slot, plan, evicted):
                    passed.append(slot)
                    continue
                more = plan.gain(slot)
                if more > 0:
                    plan.add(slot)
                    evicted.append(slot)
                    got, progress = got + more, True
                else:
                    passed.append(slot)
            left = passed
            if not progress and got < tokens:
                gain = plan.together(left)  # once a pass: every candidate's gain with all of them
                slot = next((s for s in left if gain(s) > 0), -1)
                if slot >= 0:
                    plan.add(slot)
                    evicted.append(slot)
                    left.remove(slot)
                    progress = True
        for slot in evicted:
            self._remove(slot)
        return got

    def _covered(self, slot: int, plan, evicted: list[int]) -> bool:
        """Whether ``slot``'s drop gives nothing back because a deeper snapshot kept in the
        tree holds every page it holds (``plan.covers``): a prompt's end once its finished
        row's snapshot is filed, a chunk's inside a prompt once the prompt's end is. Known
        without counting its pages (:meth:`evict` met a few hundred of these at every
        eviction of a closed loop of first turns, each ``plan.gain`` a walk over its pages)."""
        node = self.nodes[slot]
        if _order_of(node)[0]:
            return False  # not superseded
        below = node
        while True:  # the first snapshot down the first branch (every leaf holds one)
            below = next(iter(below.children.values()))
            if below.slot >= 0:
                break
        return below.slot not in evicted and plan.covers(below.slot, slot)

    def evictable(self, keep: Collection[int] = ()) -> list[int]:
        """Cached slots no micro-batch restores from (and not in ``keep``)."""
        return [s for s in self.nodes if s not in self.pins and s not in keep]

    def evict_one(self, superseded: bool = False) -> bool:
        """Evict the first unpinned snapshot in :meth:`_order`: a slot for a new one, which
        found none (the module's docstring). Only a superseded one, never restored from,
        for a new snapshot that is ``superseded`` itself (its own request's later snapshot
        extends it) or while a slot evicted for the other kind is on its way. False when
        none is evicted."""
        slots = [s for s in self.nodes if s not in self.pins]
        slot = min(slots, key=self._order, default=-1)
        if slot < 0 or (self._order(slot)[0] > 0 and (superseded or self.owed > 0)):
            return False
        self._remove(slot)
        self.owed += not superseded
        return True

    def flush(self) -> None:
        """Evict every unpinned snapshot."""
        for slot in [s for s in self.nodes if s not in self.pins]:
            self._remove(slot)
        self.owed = 0

    def _remove(self, slot: int) -> None:
        node = self.nodes.pop(slot)
        node.slot = -1
        while node is not self.root and node.slot < 0 and not node.children:
            del node.parent.children[node.key[0]]
            node = node.parent
        self.to_drop.append(slot)

    def take_drops(self) -> list[int]:
        """Evicted slots to drop on every stage (then :meth:`dropped`)."""
        slots, self.to_drop = self.to_drop, []
        self.dropping.update(slots)
        return slots

    def dropped(self, slots: list[int]) -> int:
        """Every stage dropped ``slots``: free again. Returns their KV charge."""
        tokens = 0
        for s in slots:
            self.dropping.discard(s)
            tokens += self.charge(s)
            del self.lens[s]
            self.free.append(s)
        return tokens

    def clear(self) -> int:
        """Forget every slot (the stages dropped them all: a recovery). Returns the KV charge."""
        tokens = sum(self.charge(s) for s in self.lens)
        counts = self.queried_tokens, self.hit_tokens
        self.__init__(self.num_slots, self.page_size)
        self.queried_tokens, self.hit_tokens = counts
        return tokens

    # ------------------------------------------------------------------ state
    @property
    def num_cached(self) -> int:
        return len(self.nodes)

    @property
    def num_used(self) -> int:
        """Slots not free (cached, being taken or being dropped)."""
        return self.num_slots - len(self.free)
