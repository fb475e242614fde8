"""PlanStaging: a host-built TppPlan copied into persistent device buffers without a host sync.

Per upload, the plan's eight int32 arrays are packed into one pinned host slot and sent with one
non_blocking copy on the current stream into one device buffer; the returned plan's tensors are
views of that buffer. Nothing waits for the device:
  - the copy is stream-ordered after the kernels that read the previous plan from the same buffer;
  - a pinned slot is rewritten only after its last copy has landed (one event per slot). With
    NUM_SLOTS slots and vLLM running at most one step ahead of the GPU, that copy finished long
    ago, so the wait returns at once (it is a wait on an event, never a stream or device sync).
Buffers grow (doubling, rarely) when a plan outgrows them; the old device buffer is freed through
the caching allocator, which reuses it only in stream order.
"""
from __future__ import annotations

import torch

from .tpp_plan import TppPlan



class PlanStaging:
    NUM_SLOTS = 2

    def __init__(self, device: torch.device | str, capacity: int = 1 << 14):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"     # (any other device: plain copies, for tests)
        self.capacity = capacity                   # int32 elements of each buffer
        self._host: list[torch.Tensor | None] = [None] * self.NUM_SLOTS
        self._events: list[torch.cuda.Event | None] = [None] * self.NUM_SLOTS
        self._slot = 0
        self._dev: torch.Tensor | None = None
        self.num_uploads = 0

    def upload(self, plan: TppPlan) -> TppPlan:
        """plan: on the host (as PlanCache builds it). Returns the same plan on self.device, its
        tensors views of the persistent buffer (valid until the next upload)."""
        arrays = plan.tensors()
        total = sum(a.numel() for a in arrays)
        while self.capacity < total:
            self.capacity *= 2
        slot, self._slot = self._slot, (self._slot + 1) % self.NUM_SLOTS
        host = self._host[slot]
        if host is None or host.numel() < self.capacity:
            host = self._host[slot] = torch.empty(self.capacity, dtype=torch.int32,
                                                  pin_memory=self._cuda)
        elif self._events[slot] is not None:
            self._events[slot].synchronize()       # its previous copy: done steps ago
        if self._dev is None or self._dev.numel() < self.capacity:
            self._dev = torch.empty(self.capacity, dtype=torch.int32, device=self.device)
        views, offset = {}, 0
        for name, a in zip(TppPlan.TENSORS, arrays):
            n = a.numel()
            host[offset:offset + n].copy_(a)
            views[name] = self._dev[offset:offset + n]
            offset += n
        self._dev[:total].copy_(host[:total], non_blocking=True)
        if self._cuda:
            event = self._events[slot] = self._events[slot] or torch.cuda.Event()
            event.record()
        self.num_uploads += 1
        return TppPlan(plan.num_seqs, plan.num_nodes, plan.num_partials, **views)
