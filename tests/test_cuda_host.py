"""Host-side guard of the CUDA TPP kernel's index math (csrc/cuda/tpp_kernels.cuh): a line-by-line
emulation of its work decomposition (CTA -> node / window / rows / KV split / slot, warp KV parts,
smem stages, merge order) computing attention with torch on CPU, checked against
tpp_decode_reference. Runs without a GPU; keep it in step with the kernel."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from vllm_chunkattn.ops.reference import tpp_decode_reference
from vllm_chunkattn.plan import TppPlan, build_plan
from vllm_chunkattn.testing import TREE_SPECS, random_tree_batch

K_WARPS, K_MAX_ROWS, K_SEQ_HEADS = 4, 64, 16
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
NEG_INF = float("-inf")


def tile_tokens(head_size: int) -> int:          # TileShape<D>::kTokens
    return 64 if head_size <= 128 else 32


@dataclass
class Decomp:                                     # the work-decomposition fields of TppParams
    num_seqs: int
    num_nodes: int
    num_partials: int
    num_heads: int
    num_kv_heads: int
    group: int
    chunk_splits: int
    seq_splits: int
    chunk_heads: int
    chunk_head_tiles: int
    chunk_seqs: int
    num_windows: int
    seq_heads: int
    seq_head_tiles: int

    @property
    def partial_grid_x(self) -> int:
        return (self.chunk_splits * self.num_windows * self.chunk_head_tiles
                + self.num_seqs * (self.seq_splits - 1) * self.seq_head_tiles)

    @property
    def slots_needed(self) -> int:
        return self.chunk_splits * self.num_partials + self.num_seqs * (self.seq_splits - 1)


def fit_splits(cs: int, ss: int, num_partials: int, num_seqs: int, slots: int) -> tuple[int, int]:
    """tpp_decode.cu: lower seq splits, then chunk splits, until the workspace holds them."""
    while cs * num_partials + num_seqs * (ss - 1) > slots:
        if ss > 1:
            ss -= 1
        else:
            cs -= 1
    return cs, ss


def decompose(plan_sizes, num_seqs, num_heads, num_kv_heads, chunk_splits, seq_splits) -> Decomp:
    num_nodes, num_partials = plan_sizes
    group = num_heads // num_kv_heads
    chunk_heads = min(group, K_MAX_ROWS)
    chunk_seqs = K_MAX_ROWS // chunk_heads
    seq_heads = min(group, K_SEQ_HEADS)
    return Decomp(num_seqs, num_nodes, num_partials, num_heads, num_kv_heads, group,
                  chunk_splits, seq_splits, chunk_heads, -(-group // chunk_heads), chunk_seqs,
                  0 if num_nodes == 0 else num_nodes + -(-num_partials // chunk_seqs),
                  seq_heads, -(-group // seq_heads))


class Emulator:
    """Runs the two launches CTA by CTA; rows are (query offset as (seq, head)) or None."""

    def __init__(self, batch, plan: TppPlan, d: Decomp, num_slots: int):
        self.b, self.plan, self.d = batch, plan, d
        self.q = batch.query.float()
        self.k, self.v = batch.key_cache.float(), batch.value_cache.float()
        self.bs = batch.block_size
        self.head_size = self.q.shape[-1]
        self.scale_log2 = batch.scale * LOG2E
        self.po = torch.full((num_slots, d.num_heads, self.head_size), float("nan"))
        self.pm = torch.full((num_slots, d.num_heads), float("nan"))
        self.pl = torch.full((num_slots, d.num_heads), float("nan"))
        self.writes = torch.zeros(num_slots, d.num_heads, dtype=torch.int64)
        self.ind = plan.node_seq_indptr.tolist()
        self.bind = plan.node_block_indptr.tolist()

    # attend_tile: returns per-row (o [R, D], m natural, l) after the KV-part merge.
    def attend(self, rows, ids, t_begin, t_end, kv_head, wm):
        nt = tile_tokens(self.head_size)
        parts = min(K_WARPS // wm, nt // 16)
        tok_w = nt // parts
        assert tok_w % 16 == 0 and len(rows) <= 16 * wm
        r = len(rows)
        q = torch.stack([self.q[s, h] if s is not None else torch.zeros(self.head_size)
                         for s, h in rows]) if r else torch.zeros(0, self.head_size)
        num_tokens = max(t_end - t_begin, 0)
        num_stages = -(-num_tokens // nt)
        states = []
        for part in range(parts):
            o = torch.zeros(r, self.head_size)
            m2 = torch.full((r,), NEG_INF)
            l = torch.zeros(r)
            for it in range(num_stages):
                tok0 = t_begin + it * nt + part * tok_w
                toks = torch.arange(tok0, tok0 + tok_w)
                valid = toks < t_end
                kt, vt = torch.zeros(tok_w, self.head_size), torch.zeros(tok_w, self.head_size)
                for c, t in enumerate(toks.tolist()):
                    if t < t_end:                 # load_kv_stage: zero-fill past t_end
                        blk = int(ids[t // self.bs])
                        kt[c], vt[c] = self.k[blk, t % self.bs, kv_head], self.v[blk, t % self.bs, kv_head]
                s = (q @ kt.T) * self.scale_log2
                s = torch.where(valid[None, :], s, torch.full_like(s, NEG_INF))
                mn = torch.maximum(m2, s.amax(dim=1))
                ms = torch.where(mn == NEG_INF, torch.zeros_like(mn), mn)
                alpha = torch.exp2(m2 - ms)
                p = torch.exp2(s - ms[:, None])
                l = l * alpha + p.sum(dim=1)
                o = o * alpha[:, None] + p @ vt
                m2 = mn
            states.append((o, m2, l))
        o, m2, l = states[0]
        for qo, qm, ql in states[1:]:             # part 0 merges parts 1.. in order
            mn = torch.maximum(m2, qm)
            ms = torch.where(mn == NEG_INF, torch.zeros_like(mn), mn)
            a, b = torch.exp2(m2 - ms), torch.exp2(qm - ms)
            o, l, m2 = o * a[:, None] + qo * b[:, None], l * a + ql * b, mn
        return o, m2, l

    def write_slot(self, slot, h, o, m2, l):
        self.po[slot, h], self.pm[slot, h], self.pl[slot, h] = o, m2 * LN2, l
        self.writes[slot, h] += 1

    def tail_range(self, seq, split, num_splits):
        first = int(self.plan.seq_num_shared_blocks[seq])
        length = int(self.b.seq_lens[seq]) - first * self.bs
        ids = self.b.block_table[seq, first:]
        if length <= 0:
            return ids, 0, 0
        nt = tile_tokens(self.head_size)
        per = -(-(-(-length // num_splits)) // nt) * nt
        t_begin = min(length, split * per)
        return ids, t_begin, min(length, t_begin + per)

    def seq_rows(self, seq, kv_head, ht):
        d = self.d
        rows, heads = [], []
        for r in range(d.seq_heads):
            hh = ht * d.seq_heads + r
            valid = hh < d.group
            rows.append((seq, kv_head * d.group + hh) if valid else (None, None))
            heads.append(kv_head * d.group + hh if valid else None)
        return rows, heads

    def partial_cta(self, x, kv_head):
        d = self.d
        num_chunk_ctas = d.chunk_splits * d.num_windows * d.chunk_head_tiles
        if x < num_chunk_ctas:
            ht = x % d.chunk_head_tiles
            x //= d.chunk_head_tiles
            win, split = x % d.num_windows, x // d.num_windows
            lo, hi = 0, d.num_nodes - 1
            while lo < hi:                        # largest n with ind[n] // chunk_seqs + n <= win
                mid = (lo + hi + 1) // 2
                if self.ind[mid] // d.chunk_seqs + mid <= win:
                    lo = mid
                else:
                    hi = mid - 1
            n, w = lo, win - lo
            p_lo = max(self.ind[n], w * d.chunk_seqs)
            p_hi = min(self.ind[n + 1], (w + 1) * d.chunk_seqs)
            if p_lo >= p_hi:
                return
            num_rows = (p_hi - p_lo) * d.chunk_heads
            assert num_rows <= K_MAX_ROWS
            rows, outs = [], []
            for r in range(num_rows):
                j, hh = r // d.chunk_heads, ht * d.chunk_heads + r % d.chunk_heads
                valid = hh < d.group
                h = kv_head * d.group + hh
                rows.append((int(self.plan.node_seq_ids[p_lo + j]), h) if valid else (None, None))
                outs.append((split * d.num_partials + p_lo + j, h) if valid else None)
            length = (self.bind[n + 1] - self.bind[n]) * self.bs
            nt = tile_tokens(self.head_size)
            per = -(-(-(-length // d.chunk_splits)) // nt) * nt
            t_begin = min(length, split * per)
            t_end = min(length, t_begin + per)
            ids = self.plan.node_block_ids[self.bind[n]:self.bind[n + 1]]
            wm = 1 if num_rows <= 16 else 2 if num_rows <= 32 else 4
            o, m2, l = self.attend(rows, ids, t_begin, t_end, kv_head, wm)
            for r, dst in enumerate(outs):
                if dst is not None:
                    self.write_slot(dst[0], dst[1], o[r], m2[r], l[r])
        else:
            x -= num_chunk_ctas
            ht = x % d.seq_head_tiles
            x //= d.seq_head_tiles
            split, seq = 1 + x % (d.seq_splits - 1), x // (d.seq_splits - 1)
            slot = d.chunk_splits * d.num_partials + seq * (d.seq_splits - 1) + split - 1
            rows, heads = self.seq_rows(seq, kv_head, ht)
            ids, t_begin, t_end = self.tail_range(seq, split, d.seq_splits)
            o, m2, l = self.attend(rows, ids, t_begin, t_end, kv_head, 1)
            for r, h in enumerate(heads):
                if h is not None:
                    self.write_slot(slot, h, o[r], m2[r], l[r])

    def merge_slot(self, slot, h, o, m2, l):
        pm2 = float(self.pm[slot, h]) * LOG2E
        mn = max(m2, pm2)
        ms = 0.0 if mn == NEG_INF else mn
        a, b = 2.0 ** (m2 - ms), 2.0 ** (pm2 - ms)
        return o * a + self.po[slot, h] * b, mn, l * a + float(self.pl[slot, h]) * b

    def final_cta(self, x, kv_head, out, lse):
        d = self.d
        seq, ht = x // d.seq_head_tiles, x % d.seq_head_tiles
        rows, heads = self.seq_rows(seq, kv_head, ht)
        ids, t_begin, t_end = self.tail_range(seq, 0, d.seq_splits)
        o_all, m_all, l_all = self.attend(rows, ids, t_begin, t_end, kv_head, 1)
        sp = self.plan.seq_partial_indptr.tolist()
        for r, h in enumerate(heads):
            if h is None:
                continue
            o, m2, l = o_all[r], float(m_all[r]), float(l_all[r])
            for k in range(sp[seq], sp[seq + 1]):
                j = int(self.plan.seq_partial_ids[k])
                for s in range(d.chunk_splits):
                    o, m2, l = self.merge_slot(s * d.num_partials + j, h, o, m2, l)
            for s in range(1, d.seq_splits):
                slot = d.chunk_splits * d.num_partials + seq * (d.seq_splits - 1) + s - 1
                o, m2, l = self.merge_slot(slot, h, o, m2, l)
            out[seq, h] = o / max(l, 1e-30)
            lse[seq, h] = m2 * LN2 + (math.log(l) if l > 0 else NEG_INF)

    def run(self):
        d = self.d
        for kv_head in range(d.num_kv_heads):
            for x in range(d.partial_grid_x):
                self.partial_cta(x, kv_head)
        # Every slot the final merge reads was written exactly once, none twice.
        assert self.writes.numel() == 0 or int(self.writes.max()) <= 1
        out = torch.full((d.num_seqs, d.num_heads, self.head_size), float("nan"))
        lse = torch.full((d.num_seqs, d.num_heads), float("nan"))
        for kv_head in range(d.num_kv_heads):
            for x in range(d.num_seqs * d.seq_head_tiles):
                self.final_cta(x, kv_head, out, lse)
        return out, lse


def pad_plan(plan: TppPlan, extra_nodes: int, extra_partials: int) -> TppPlan:
    """Capacity mode: empty nodes appended (indptr repeats), partial arrays padded with junk."""
    def pad_indptr(t):
        return torch.cat([t, t[-1:].repeat(extra_nodes)])

    def pad_ids(t):
        return torch.cat([t, torch.full((extra_partials,), 12345, dtype=torch.int32)])
    return TppPlan(plan.num_seqs, plan.num_nodes + extra_nodes, plan.num_partials + extra_partials,
                   pad_indptr(plan.node_block_indptr), plan.node_block_ids,
                   pad_indptr(plan.node_seq_indptr), pad_ids(plan.node_seq_ids),
                   plan.seq_partial_indptr, plan.seq_partial_ids, plan.seq_num_shared_blocks)


def emulate(batch, plan, chunk_splits, seq_splits, spare_slots=None):
    num_seqs, num_heads, _ = batch.query.shape
    num_kv_heads = batch.key_cache.shape[2]
    num_nodes = plan.node_seq_indptr.numel() - 1
    num_partials = plan.node_seq_ids.numel()
    if spare_slots is None:
        slots = chunk_splits * num_partials + num_seqs * (seq_splits - 1)
    else:
        slots = max(num_partials, 1) + spare_slots
    cs, ss = fit_splits(chunk_splits, seq_splits, num_partials, num_seqs, slots)
    d = decompose((num_nodes, num_partials), num_seqs, num_heads, num_kv_heads, cs, ss)
    assert d.slots_needed <= max(slots, 1)
    return Emulator(batch, plan, d, max(slots, 1)).run()


HEADS = [(4, 4), (8, 2), (8, 1), (9, 3), (64, 1), (128, 1)]


@pytest.mark.parametrize("spec", sorted(TREE_SPECS))
@pytest.mark.parametrize("splits", [(1, 1), (2, 3), (3, 2)])
def test_emulation_matches_reference(spec, splits):
    batch = random_tree_batch(7, **TREE_SPECS[spec], num_heads=8, num_kv_heads=2, head_size=64,
                              block_size=16)
    plan = build_plan(batch.block_table, batch.seq_lens, batch.block_size)
    out, lse = emulate(batch, plan, *splits)
    ref, ref_lse = tpp_decode_reference(batch.query, batch.key_cache, batch.value_cache,
                                        batch.block_table, batch.seq_lens, plan, batch.scale,
                                        return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


SHAPES = [(64, 16), (64, 64), (256, 16), (128, 32)]
# Large groups (one sharer per window, several head tiles) are slow to emulate: fewer shapes.
CASES = [(h, *s) for h in HEADS[:4] for s in SHAPES] + [((64, 1), 64, 16), ((128, 1), 256, 16)]


@pytest.mark.parametrize("heads,head_size,block_size", CASES)
def test_emulation_heads_and_shapes(heads, head_size, block_size):
    # Deep trees with long nodes: several smem stages, windows split across nodes, GQA tiling.
    batch = random_tree_batch(11, fanouts=[2, 3, 4], max_node_blocks=5, max_private_blocks=4,
                              num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                              block_size=block_size)
    plan = build_plan(batch.block_table, batch.seq_lens, batch.block_size)
    out, lse = emulate(batch, plan, 2, 2)
    ref, ref_lse = tpp_decode_reference(batch.query, batch.key_cache, batch.value_cache,
                                        batch.block_table, batch.seq_lens, plan, batch.scale,
                                        return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_capacity_mode_padding():
    # Padded plan (empty nodes, junk partial ids) and padded rows (seq_len 0): same real rows,
    # padded rows give 0 with lse = -inf, no NaN anywhere.
    batch = random_tree_batch(3, **TREE_SPECS["system_prompts"], num_heads=8, num_kv_heads=2)
    plan = build_plan(batch.block_table, batch.seq_lens, batch.block_size)
    ref, ref_lse = tpp_decode_reference(batch.query, batch.key_cache, batch.value_cache,
                                        batch.block_table, batch.seq_lens, plan, batch.scale,
                                        return_lse=True)
    n, pad = batch.query.shape[0], 3
    batch.query = torch.cat([batch.query, torch.randn(pad, *batch.query.shape[1:])])
    batch.block_table = torch.cat([batch.block_table,
                                   torch.zeros(pad, batch.block_table.shape[1], dtype=torch.int32)])
    batch.seq_lens = torch.cat([batch.seq_lens, torch.zeros(pad, dtype=torch.int32)])
    base = pad_plan(plan, extra_nodes=4, extra_partials=5)
    last = base.seq_partial_indptr[-1:]
    padded = TppPlan(n + pad, base.num_nodes, base.num_partials, base.node_block_indptr,
                     base.node_block_ids, base.node_seq_indptr, base.node_seq_ids,
                     torch.cat([base.seq_partial_indptr, last.repeat(pad)]), base.seq_partial_ids,
                     torch.cat([base.seq_num_shared_blocks, torch.zeros(pad, dtype=torch.int32)]))
    out, lse = emulate(batch, padded, 2, 2)
    torch.testing.assert_close(out[:n], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:n], ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    assert torch.isneginf(lse[n:]).all()


@pytest.mark.parametrize("spare", [0, 3, 1000])
def test_split_capacity_fit(spare):
    # The default workspace (num_partials rows) means no split; spare rows enable splits.
    batch = random_tree_batch(5, **TREE_SPECS["batch_17"], num_heads=4, num_kv_heads=2)
    plan = build_plan(batch.block_table, batch.seq_lens, batch.block_size)
    out, _ = emulate(batch, plan, 3, 4, spare_slots=spare)
    ref = tpp_decode_reference(batch.query, batch.key_cache, batch.value_cache,
                               batch.block_table, batch.seq_lens, plan, batch.scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    cs, ss = fit_splits(3, 4, plan.num_partials, 17, plan.num_partials + spare)
    assert (cs, ss) == ((1, 1) if spare == 0 else (1, 1) if spare < 17 else (3, 4))


def test_window_mapping_is_a_bijection():
    # Every (node, partial position) lands in exactly one (window CTA, row); gaps exit.
    for chunk_seqs in (1, 2, 3, 5, 16, 64):
        for sizes in ([2], [2, 3, 9, 1, 17], [64, 2, 2], [0, 3, 0, 0, 5]):
            ind = [0]
            for s in sizes:
                ind.append(ind[-1] + s)
            num_nodes, num_partials = len(sizes), ind[-1]
            seen = []
            for win in range(num_nodes + -(-num_partials // chunk_seqs)):
                lo, hi = 0, num_nodes - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if ind[mid] // chunk_seqs + mid <= win:
                        lo = mid
                    else:
                        hi = mid - 1
                n, w = lo, win - lo
                p_lo, p_hi = max(ind[n], w * chunk_seqs), min(ind[n + 1], (w + 1) * chunk_seqs)
                seen += [(n, p) for p in range(p_lo, p_hi)]
            want = [(n, p) for n in range(num_nodes) for p in range(ind[n], ind[n + 1])]
            assert sorted(seen) == want, (chunk_seqs, sizes)

