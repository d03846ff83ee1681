"""Host-side page allocation for a :class:`~comprl_jax.models.kv_cache.PagedKVCache`.

A paged cache holds a pool of ``P`` pages of ``page`` positions and a page table ``[B, W]`` per row. The host
decides which pages a row owns: before a turn, :meth:`PageTable.reserve` gives each row the pages its context,
input and reply can reach (``ceil(need / page)``), taking free pages from the pool, and the pool grows (doubling,
its contents copied) when they run out. Memory therefore follows the tokens the rows hold, not ``B x`` the longest
row, and a turn's attention reads a window of the table (:meth:`PagedKVCache.window`), so it follows the longest
*live* row, not the allocation.
"""

from __future__ import annotations

import numpy as np


class PageTable:
    """Which pages each of ``rows`` rows owns, for rows of up to ``max_len`` positions.

    Args:
      rows: rows of the cache (its batch). max_len: positions per row at most (a multiple of ``page_size``).
      page_size: positions per page. num_pages: the pool's pages now (grows with :meth:`grow_to`).
    """

    def __init__(self, rows: int, max_len: int, page_size: int, num_pages: int):
        if max_len % page_size:
            raise ValueError(f"max_len={max_len} must be a multiple of page_size={page_size}")
        self.rows, self.max_len, self.page_size = int(rows), int(max_len), int(page_size)
        self.num_pages = int(num_pages)
        self.owned: list[list[int]] = [[] for _ in range(self.rows)]
        self.free: list[int] = list(range(self.num_pages))

    def pages_for(self, positions: int) -> int:
        return -(-int(positions) // self.page_size)

    def missing(self, needs: dict[int, int]) -> int:
        """Pages the pool lacks to give each row ``b`` room for ``needs[b]`` positions."""
        want = sum(max(self.pages_for(n) - len(self.owned[b]), 0) for b, n in needs.items())
        return max(want - len(self.free), 0)

    def grow_to(self, num_pages: int) -> None:
        """The pool now has ``num_pages`` pages (the old ones keep their indices; the new ones are free)."""
        if num_pages < self.num_pages:
            raise ValueError(f"a page pool only grows: {self.num_pages} -> {num_pages}")
        self.free += list(range(self.num_pages, int(num_pages)))
        self.num_pages = int(num_pages)

    def reserve(self, needs: dict[int, int]) -> None:
        """Gives row ``b`` pages for ``needs[b]`` positions (keeping the pages it has). Raises when the pool is
        short (call :meth:`missing` and grow it first) or a row would exceed ``max_len``."""
        if self.missing(needs):
            raise ValueError(f"the page pool is short of {self.missing(needs)} pages; grow it first")
        for b, n in needs.items():
            if n > self.max_len:
                raise ValueError(f"row {b}: {n} positions exceed the cache's max_len={self.max_len}")
            while len(self.owned[b]) < self.pages_for(n):
                self.owned[b].append(self.free.pop(0))

    def release(self, b: int) -> None:
        """Row ``b``'s pages go back to the pool (its context is dropped)."""
        self.free = sorted(self.free + self.owned[b])
        self.owned[b] = []

    def table(self) -> np.ndarray:
        """``[rows, max_len / page]`` int32 page table; ``num_pages`` where a row has no page."""
        out = np.full((self.rows, self.max_len // self.page_size), self.num_pages, np.int32)
        for b, pages in enumerate(self.owned):
            out[b, : len(pages)] = pages
        return out

    @property
    def used(self) -> int:
        """Pages owned by some row."""
        return self.num_pages - len(self.free)

    # -- moving page lists between rows (the slot engine's parking and compaction: host-side, nothing copied) --
    def take(self, b: int) -> list[int]:
        """Row ``b``'s pages, taken from it (the row then owns none) but not freed: the caller holds them (e.g. a
        parked row) until :meth:`give` or :meth:`free_pages`."""
        pages, self.owned[b] = self.owned[b], []
        return pages

    def give(self, b: int, pages: list[int]) -> None:
        """Row ``b`` (owning no pages) takes ``pages`` (from :meth:`take`), in order."""
        if self.owned[b]:
            raise ValueError(f"row {b} owns {len(self.owned[b])} pages; release or take them first")
        self.owned[b] = list(pages)

    def free_pages(self, pages: list[int]) -> None:
        """Pages held outside the table (from :meth:`take`) go back to the pool."""
        self.free = sorted(self.free + list(pages))

    def keep_rows(self, rows: list[int], total: int) -> None:
        """A table of ``total`` rows whose row ``i`` is old row ``rows[i]`` (distinct; rows past ``len(rows)``
        own nothing); the pages of the old rows not kept go back to the pool."""
        if len(set(rows)) != len(rows) or len(rows) > total:
            raise ValueError(f"keep_rows needs at most {total} distinct rows, got {rows}")
        dropped = [p for b in range(self.rows) if b not in set(rows) for p in self.owned[b]]
        self.owned = [self.owned[b] for b in rows] + [[] for _ in range(total - len(rows))]
        self.rows = int(total)
        self.free_pages(dropped)
