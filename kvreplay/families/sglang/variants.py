"""Historical SGLang SWA pool bugs, each re-created by overriding only the hook
where the bug lived (see ``swa.py``). They exist so the checker can be shown to
catch each one at the call that creates the bad state."""

from __future__ import annotations

import torch

from kvreplay.families.sglang.swa import SWAPool


class _TokenExactClearing(SWAPool):
    """Before #27779: SWA frees clear the mapping of the tokens passed only, so the
    untouched tokens of a released page keep pointing at their old SWA slot."""

    def _mapping_to_clear(self, free_index: torch.Tensor) -> torch.Tensor:
        return free_index


class StaleTailSWAPool(_TokenExactClearing):
    """sglang 0.5.12, the seed bug (#25805 and #27779 both missing):
    ``alloc_extend_swa_tail`` also leaves the non-tail part's old mapping in place."""

    def _clear_non_tail(self, non_tail: torch.Tensor) -> None:
        return None


class PagePartialClearSWAPool(_TokenExactClearing):
    """sglang 0.5.12.post1: #25805 in (non-tail cleared), #27779 not yet."""


class UnfilteredPage0SWAPool(SWAPool):
    """#38519: ``free_swa_segment`` frees whatever the mapping says, so a page with
    no SWA peer (entry 0) releases SWA page 0, the padding page."""

    def _mapped_pages(self, swa_tokens: torch.Tensor) -> torch.Tensor:
        return swa_tokens


class DeferredLookupSWAPool(SWAPool):
    """#36081: a grouped ``free_swa`` remembers full slots and reads their mapping at
    ``free_group_end``, after a cache action in the same group may have re-pointed
    it, so it frees the new peer and leaks the old one."""

    def free_swa(self, free_index: torch.Tensor) -> None:
        if self.free_group is None or self.page_size == 1 or free_index.numel() == 0:
            super().free_swa(free_index)
            return
        self.swa_free_group.append(self._mapping_to_clear(free_index))

    def _resolve_swa_group(self, pending: list[torch.Tensor]) -> torch.Tensor:
        touched = torch.cat(pending)
        swa = self.full_to_swa_index_mapping[touched]
        self.clear_full_to_swa_mapping(touched)
        return swa
