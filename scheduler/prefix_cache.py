"""PrefixCache: full KV pages kept after their requests finish, found again by the tokens they hold and the adapter
that computed them.

A page's key is a chain digest over its adapter namespace and every token from the prompt's start to the page's end
(`page_keys`), so a key names one exact prefix computed by one adapter at one strength: base requests have their own
namespace, an in-place reload mints a new adapter id, hence a new namespace, and a request strength (lora_scale) other
than 1 starts the chain apart from the adapter's own. A page holding (part of) an image's placeholder run is keyed by
the image's content hash as well: the same image after the same tokens shares pages, another image never does. Only
full pages whose keys and values the workers have written are cached; a request always computes at least its last
token itself, so it never writes into a shared page.

Every page is either free (the allocator's), private (one request's, not cached) or cached. A cached page counts the
requests using it; with none it is evictable, least recently used first, and goes back to the allocator only when
pages are needed.

Hybrid models (linear-attention layers beside attention) need more than KV to start from a cached prefix: the
layers' states at its end. Such a cache holds state snapshots (ids from a StateSlotAllocator), each attached to the
cached page that ends at the boundary where it was saved; a hit reaches only as deep as the deepest matched page with
one (the pages past it are not used), and the snapshot goes when its page is evicted or purged. When none is free, a
new one takes the snapshot of the least recently used evictable page that has one (the page stays cached).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from loraplex.scheduler.page_allocator import PageAllocator, PageError
from loraplex.scheduler.state_slots import StateSlotAllocator

BASE_NAMESPACE = -1  # the base model's requests (adapters use their lora_id, which is never negative)


def page_keys(namespace: int, token_ids: Sequence[int], page_size: int, num_pages: int,
              known: Sequence[bytes] = (), lora_scale: float = 1.0,
              images: Sequence[tuple[int, int, str]] = ()) -> list[bytes]:
    """Keys of the first num_pages full pages of token_ids; `known` are the first keys, already computed. A request
    strength (lora_scale) other than 1 is part of the chain's start: its pages are another adapter's. images: the
    prompt's (offset, num_tokens, content hash) runs of image placeholders, whose tokens are all one id: a page that
    holds part of a run is keyed by the image's content too, so two images never share pages (nor what follows)."""
    keys = list(known[:num_pages])
    previous = keys[-1] if keys else namespace.to_bytes(8, "little", signed=True)
    if not keys and lora_scale != 1.0:
        previous += struct.pack("<d", lora_scale)
    for i in range(len(keys), num_pages):
        start, end = i * page_size, (i + 1) * page_size
        page = token_ids[start:end]
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(b"".join(t.to_bytes(4, "little") for t in page))
        for offset, num_tokens, content_hash in images:
            if offset < end and offset + num_tokens > start:
                digest.update(content_hash.encode())
        previous = digest.digest()
        keys.append(previous)
    return keys


class PrefixCache:
    def __init__(self, pages: PageAllocator, page_size: int, enabled: bool = True,
                 snapshots: StateSlotAllocator | None = None):  # fmt: skip
        """snapshots: a hybrid model's state snapshots (a hit needs one at its end); None: KV is all a hit needs."""
        self.pages = pages
        self.page_size = page_size
        self.enabled = enabled
        self.snapshots = snapshots
        self._snapshot_of_page: dict[int, int] = {}
        self._page_of_key: dict[bytes, int] = {}
        self._key_of_page: dict[int, bytes] = {}
        self._namespace_of_page: dict[int, int] = {}
        self._num_users: dict[int, int] = {}  # cached page -> requests using it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages nobody uses, least recent first
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0

    # ---- pages for requests ------------------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Pages a request could get now: free ones and evictable cached ones."""
        return self.pages.num_free + len(self._evictable)

    @property
    def num_in_use(self) -> int:
        return self.pages.num_pages - self.num_available

    @property
    def num_cached(self) -> int:
        return len(self._key_of_page)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > self.num_available:
            raise PageError(f"cannot allocate {num_pages} pages: {self.num_available} available")
        while self.pages.num_free < num_pages:
            self._evict(next(iter(self._evictable)))
        return self.pages.allocate(num_pages)

    def release(self, page_ids: Iterable[int]) -> None:
        """A request lets go of its pages: cached ones stay cached (evictable once unused), private ones are freed."""
        private = []
        for page_id in page_ids:
            users = self._num_users.get(page_id)
            if users is None:
                private.append(page_id)
            elif users == 1:
                del self._num_users[page_id]
                self._evictable[page_id] = None
            else:
                self._num_users[page_id] = users - 1
        self.pages.free(private)

    # ---- lookup and insertion ------------------------------------------------------------------------------------

    def match(self, keys: Sequence[bytes], num_tokens: int) -> list[int]:
        """The cached pages that start a request whose full-page keys are `keys`, taken for it (at most up to its
        last token's page, which it must compute itself to sample; with snapshots, up to the deepest one that has
        a snapshot). Counted by `count_lookup` once the admission holds: a request that matches, cannot be admitted
        and releases is not a lookup twice."""
        found = self._cached_prefix(keys, num_tokens)
        matched = found[: self._num_usable(found)]
        for page_id in matched:
            self._use(page_id)
        return matched

    def num_matching(self, keys: Sequence[bytes], num_tokens: int) -> int:
        """How many of the keys' pages are cached from the first on, snapshot or not (at most up to the last
        token's page), changing nothing."""
        return len(self._cached_prefix(keys, num_tokens))

    def _cached_prefix(self, keys: Sequence[bytes], num_tokens: int) -> list[int]:
        if not self.enabled:
            return []
        found = []
        for key in keys[: (num_tokens - 1) // self.page_size]:
            page_id = self._page_of_key.get(key)
            if page_id is None:
                break
            found.append(page_id)
        return found

    def _num_usable(self, found: list[int]) -> int:
        """Of a cached prefix, the pages a hit may use: all, or with snapshots up to the deepest that has one."""
        if self.snapshots is None:
            return len(found)
        return next((n for n in range(len(found), 0, -1) if found[n - 1] in self._snapshot_of_page), 0)

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def peek(self, keys: Sequence[bytes], num_tokens: int) -> int:
        """How many pages match would return, changing nothing."""
        return self._num_usable(self._cached_prefix(keys, num_tokens))

    def insert(self, keys: Sequence[bytes], page_ids: Sequence[int], namespace: int) -> list[int]:
        """Offer a request's written full pages (keys[i] for page_ids[i]); returns its page table, where a page
        that another request cached first under the same key is swapped for the cached one (the private copy freed)."""
        if not self.enabled:
            return list(page_ids)
        table = list(page_ids)
        duplicates = []
        for i, (key, page_id) in enumerate(zip(keys, page_ids, strict=False)):
            cached = self._page_of_key.get(key)
            if cached == page_id:
                continue
            if page_id in self._key_of_page:
                raise PageError(f"page {page_id} is cached under another key")
            if cached is None:
                self._page_of_key[key] = page_id
                self._key_of_page[page_id] = key
                self._namespace_of_page[page_id] = namespace
                self._num_users[page_id] = 1
            else:
                self._use(cached)
                table[i] = cached
                duplicates.append(page_id)
        self.pages.free(duplicates)
        return table

    # ---- state snapshots (hybrid models) ------------------------------------------------------------------------

    def snapshot_of(self, page_id: int) -> int:
        """The snapshot saved at the end of a cached page (match's last page has one)."""
        return self._snapshot_of_page[page_id]

    def allocate_snapshot(self) -> int | None:
        """A snapshot for a pass to save into: a free one, else the least recently used evictable page's; None
        when every snapshot is being saved or belongs to a page in use."""
        if self.snapshots.can_allocate():
            return self.snapshots.allocate()
        page_id = next((p for p in self._evictable if p in self._snapshot_of_page), None)
        return None if page_id is None else self._snapshot_of_page.pop(page_id)

    def attach_snapshot(self, page_id: int, snapshot: int) -> None:
        """The pass that saved `snapshot` at the end of page_id returned: the page keeps it, unless the page is not
        cached or has one already (saved by another request at the same boundary), when it is freed."""
        if page_id in self._key_of_page and page_id not in self._snapshot_of_page:
            self._snapshot_of_page[page_id] = snapshot
        else:
            self.snapshots.free(snapshot)

    def purge(self, namespace: int) -> None:
        """Drop the evictable pages an adapter computed (it was unloaded: nothing will ask for them again)."""
        for page_id in [p for p in self._evictable if self._namespace_of_page[p] == namespace]:
            self._evict(page_id)

    # ---- internals ---------------------------------------------------------------------------------------------

    def _use(self, page_id: int) -> None:
        self._evictable.pop(page_id, None)
        self._num_users[page_id] = self._num_users.get(page_id, 0) + 1

    def _evict(self, page_id: int) -> None:
        del self._evictable[page_id]
        key = self._key_of_page.pop(page_id)
        del self._page_of_key[key]
        del self._namespace_of_page[page_id]
        self.pages.free([page_id])
        snapshot = self._snapshot_of_page.pop(page_id, None)
        if snapshot is not None:
            self.snapshots.free(snapshot)

    def check(self) -> None:
        """Invariants, for tests: every page is free, private-or-used, or evictable, and the maps agree."""
        assert set(self._page_of_key.values()) == set(self._key_of_page) == set(self._namespace_of_page)
        assert set(self._evictable) | set(self._num_users) == set(self._key_of_page)
        assert not set(self._evictable) & set(self._num_users)
        assert all(n > 0 for n in self._num_users.values())
        assert set(self._snapshot_of_page) <= set(self._key_of_page)
        assert len(set(self._snapshot_of_page.values())) == len(self._snapshot_of_page)
