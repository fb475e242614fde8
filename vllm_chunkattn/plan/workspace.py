"""TppWorkspace: the fp32 partial states a step's plan needs, kept across layers and steps."""
from __future__ import annotations

import torch


class TppWorkspace:
    """fp32 partial states of the chunk-first phase, grown on demand and reused across layers and
    steps (no per-call allocation once warm; fixed addresses for CUDA graphs once large enough).

    On CUDA, rows beyond num_partials are the split-KV scratch: the kernel splits long nodes and
    private tails only as far as these spare rows allow (csrc/cuda/tpp_decode.cu).
    spare_rows_per_partial: 0 for CUDA graphs, whose plans are padded to a capacity of partials
    (capacity.py) that already leaves the kernel spare rows in most steps."""

    CUDA_SPARE_ROWS_PER_PARTIAL = 4
    CUDA_SPARE_ROWS_PER_SEQ = 8

    def __init__(self, spare_rows_per_partial: int = CUDA_SPARE_ROWS_PER_PARTIAL):
        self.spare_rows_per_partial = spare_rows_per_partial
        self.o = self.m = self.l = None

    def rows(self, num_partials: int, num_seqs: int, device) -> int:
        need = max(num_partials, 1)
        if torch.device(device).type == "cuda":
            need += self.spare_rows_per_partial * num_partials + self.CUDA_SPARE_ROWS_PER_SEQ * num_seqs
        return need

    def holds(self, num_partials: int, num_seqs: int, num_heads: int, head_size: int,
              device) -> bool:
        """Whether get() would return the tensors it holds now (no reallocation)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:     # tensors always name their index
            dev = torch.device("cuda", torch.cuda.current_device())
        return (self.o is not None and self.o.device == dev
                and self.o.shape[0] >= self.rows(num_partials, num_seqs, device)
                and self.o.shape[1:] == (num_heads, head_size))

    def get(self, num_partials: int, num_seqs: int, num_heads: int, head_size: int, device):
        if not self.holds(num_partials, num_seqs, num_heads, head_size, device):
            need = self.rows(num_partials, num_seqs, device)
            self.o = torch.empty(need, num_heads, head_size, dtype=torch.float32, device=device)
            self.m = torch.empty(need, num_heads, dtype=torch.float32, device=device)
            self.l = torch.empty(need, num_heads, dtype=torch.float32, device=device)
        return self.o, self.m, self.l
