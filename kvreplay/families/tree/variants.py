"""Bug variants of the builtin tree: each overrides one hook of ``PrefixTree``, in the
shapes sglang's prefix caches have had (kvreplay's own re-statements, not sglang's code)."""

from __future__ import annotations

from kvreplay.families.tree.tree import Held, Node, PrefixTree


class ForgetsRow(PrefixTree):
    """A finished request's row free returns early for one request in ten: its slots are
    neither freed nor cached, and the idle check later finds them missing
    (``pool memory leak detected``)."""

    def _free_row(self, request: int, held: Held, start: int, end: int) -> None:
        if request % 10 == 7:
            return
        super()._free_row(request, held, start, end)


class KeepsOldLock(PrefixTree):
    """A checkpoint locks the request's new last node without unlocking the old one: the
    old path stays protected for ever and the protected size never returns to zero."""

    def _release_lock(self, handle: int) -> None:
        if self._in_checkpoint:
            self.handles.pop(handle, None)  # the handle is forgotten, its lock kept
            return
        super()._release_lock(handle)

    _in_checkpoint = False

    def checkpoint(self, request: int, pages: tuple[int, ...], up_to: int,
                   outputs: int | None = None) -> tuple[int, ...]:
        self._in_checkpoint = True
        try:
            return super().checkpoint(request, pages, up_to, outputs)
        finally:
            self._in_checkpoint = False


class EvictsLocked(PrefixTree):
    """Eviction ignores lock counts: a leaf a running request has locked is freed under
    it, and its slots are handed out again while the request still reads them."""

    def _may_evict(self, node: Node) -> bool:
        return node.id != 0 and not node.children


class FreesCachedPrefix(PrefixTree):
    """A checkpoint frees the duplicates from the row's start, not from its protected
    length: the slots of the prefix the tree already held are freed while the tree still
    holds them (counted twice)."""

    def _duplicates(self, held: Held, prefix: int) -> tuple[int, int]:
        return 0, prefix


class UnlockLeavesSize(PrefixTree):
    """A node's last unlock makes it evictable but leaves its size in the protected count:
    the sizes drift from what the nodes hold."""

    def _unlocked(self, node: Node) -> None:
        self.evictable_size_ += len(node.value)
