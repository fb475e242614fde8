"""plugin/host_block_table.py: the host copies of the block table the builder plans from on a GPU
(the V2 runner's mirror), and the check a CPU run makes of them (CHUNKATTN_CHECK_HOST_ROWS)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_chunkattn.plugin import host_block_table as h


def test_v2_runner_mirror_follows_append_block_ids():
    """The V2 runner keeps block ids only on the device; the mirror fed from append_block_ids
    must give the rows its gather would (by request index, overwrite on a new request)."""
    class BlockTables:                                    # the attributes we read, no more
        pass
    gpu = torch.zeros(4, 6, dtype=torch.int32)
    tables = BlockTables()
    tables.block_tables, tables.input_block_tables = [SimpleNamespace(gpu=gpu)], [gpu]
    tables.num_blocks = SimpleNamespace(np=np.zeros((1, 4), np.int32))
    tables.redirect_writes_to_null_block = False

    def append(req, ids, overwrite):                    # BlockTables.append_block_ids, then ours
        start = 0 if overwrite else tables.num_blocks.np[0, req]
        tables.num_blocks.np[0, req] = start + len(ids[0])
        h._after_v2_append(tables, req, ids, overwrite)
    h._after_v2_init(tables)
    append(2, ([7, 8],), True)
    append(0, ([7, 9, 3],), True)
    append(2, ([5],), False)
    append(0, ([1],), True)                              # request slot 0 reused
    cm = SimpleNamespace(block_table_tensor=gpu, req_idx=np.array([2, 0]))
    assert h.host_block_table(cm, 2, 16)[:, :3].tolist() == [[7, 8, 5], [1, 9, 3]]
    tables.redirect_writes_to_null_block = True
    append(2, ([6],), False)
    assert h.host_block_table(cm, 1, 16)[0, :4].tolist() == [7, 8, 5, 0]
    # A FULL-graph step padded to 4 rows: req_idx names the 2 real requests (V2's
    # idx_mapping_np), the padding rows come back zero as the device gather leaves them.
    padded = h.host_block_table(cm, 4, 16)
    assert padded.shape == (4, 6) and padded.dtype == np.int32
    assert padded[:2, :3].tolist() == [[7, 8, 5], [1, 9, 3]] and not padded[2:].any()


def test_the_check_compares_the_blocks_a_row_reaches(monkeypatch):
    """V2's gather copies each row's live ids and leaves older ids after them: the check ignores
    entries past a row's seq_len, and fails on any difference before it, and on seq_lens."""
    table = torch.tensor([[7, 8, 5, 36], [1, 9, 0, 0]], dtype=torch.int32)   # 36: stale
    seq_lens = torch.tensor([40, 33], dtype=torch.int32)                      # 3 and 3 blocks
    mirror = np.array([[7, 8, 5, 0], [1, 9, 0, 0]], np.int32)
    monkeypatch.setattr(h, "_runner_host_rows", lambda cm, n: ("V2 block table", mirror[:n]))
    cm = SimpleNamespace(block_table_tensor=table, seq_lens=seq_lens,
                         seq_lens_cpu_upper_bound=seq_lens.clone())
    assert h.host_block_table(cm, 2, 16, check=True).tolist() == mirror.tolist()   # planned from
    mirror[1, 2] = 4                                                     # a live block differs
    with pytest.raises(RuntimeError, match=r"host copy \(V2 block table\) differs .* rows \[1\]"):
        h.host_block_table(cm, 2, 16, check=True)
    assert h.host_block_table(cm, 2, 16)[1, 2] == 4                     # off: no check
    assert h.host_seq_lens(cm, 2, True, check=True).tolist() == [40, 33]
    cm.seq_lens_cpu_upper_bound[0] = 41
    with pytest.raises(RuntimeError, match=r"seq_lens_cpu_upper_bound\) differs .* rows \[0\]"):
        h.host_seq_lens(cm, 2, True, check=True)
    assert h.host_seq_lens(cm, 2, True).tolist() == [40, 33]            # off: no check
