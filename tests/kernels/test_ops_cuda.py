"""The CUDA TPP kernel (csrc/cuda) against tpp_decode_reference: random trees, fp16/bf16, head
sizes, GQA, block sizes, forced KV splits, NaN-filled out, batch order, empty plan, CUDA graphs
(exact and capacity mode), opcheck. Skipped without a CUDA GPU. The attention variants (window,
soft cap, sinks): test_ops_cuda_variants.py."""
from __future__ import annotations

import pytest
import torch

from vllm_chunkattn.ops import CUDA_BLOCK_SIZES
from vllm_chunkattn.ops.reference import tpp_decode_reference
from vllm_chunkattn.plan import TppPlan, build_plan, empty_plan
from vllm_chunkattn.bench.cuda_work import split_spare_slots
from vllm_chunkattn.bench.tree_batches import (COMPACT_STAGE_CASES, TC_TOL, TREE_SPECS,
                                               assert_matches_reference, caterpillar_batch,
                                               named_tree, pad_batch, padded_to_capacity,
                                               poison_unread_kv,
                                               random_tree_batch, value_cache_elsewhere)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEADS = [(32, 32), (32, 8), (8, 1), (9, 3)]
# CHUNKATTN_OVERLAP_FINAL both ways; the ones forcing the overlap on are marked, so that
# run_on_device.sh can tell an overlap that is wrong on the GPU from any other failure.
OVERLAP_OFF_ON = [pytest.param("0", id="overlap_off"),
                  pytest.param("1", id="overlap_on", marks=pytest.mark.overlap_on)]


@pytest.fixture(scope="module")
def ops():
    from vllm_chunkattn.ops.native import native_ops
    o = native_ops(torch.device("cuda"))
    assert o is not None, "the CUDA kernel did not build / register"
    return o


def make_batch(spec, seed=0, **kw):
    kw = {**named_tree(spec), **kw}
    return random_tree_batch(seed, device="cuda", **kw)


def workspace(num_slots, num_heads, head_size):
    num_slots = max(num_slots, 1)
    return (torch.full((num_slots, num_heads, head_size), float("nan"), device="cuda"),
            torch.full((num_slots, num_heads), float("nan"), device="cuda"),
            torch.full((num_slots, num_heads), float("nan"), device="cuda"))


def run(ops, b, plan, spare_slots=0, out=None, lse=None, **variant):
    """variant: the op's sliding_window, soft_cap, sinks."""
    num_seqs, num_heads, head_size = b.query.shape
    ws = workspace(plan.node_seq_ids.numel() + spare_slots, num_heads, head_size)
    out = torch.full_like(b.query, float("nan")) if out is None else out
    lse = torch.full((num_seqs, num_heads), float("nan"), device="cuda") if lse is None else lse
    ops.tpp_decode(b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
                   *plan.tensors(), *ws, b.scale, out, lse, **variant)
    return out, lse


check = assert_matches_reference


def plan_of(b):
    return build_plan(b.block_table.cpu(), b.seq_lens.cpu(), b.block_size).to("cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", sorted(TREE_SPECS))
def test_tree_specs(ops, spec, dtype):
    b = make_batch(spec, num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=dtype)
    plan = plan_of(b)
    check(b, plan, *run(ops, b, plan))


@pytest.mark.parametrize("spec", ["system_prompts", "deep_tree", "no_sharing"])
def test_shared_nodes_alone(ops, spec):
    # bench's ours_with_fi_tails (test_cuda_simt_emulation's twin): every row cut to the tokens
    # its shared nodes cover; rows with nodes have no tail, rows without any have seq_len 0.
    b = make_batch(spec, seed=4, num_heads=16, num_kv_heads=4, head_size=128, block_size=16,
                   dtype=torch.bfloat16)
    plan = plan_of(b)
    b.seq_lens = (plan.seq_num_shared_blocks * b.block_size).to(torch.int32)
    out, lse = run(ops, b, plan)
    check(b, plan, out, lse)
    empty = b.seq_lens == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("spec", ["system_prompts", "deep_tree"])
def test_shapes(ops, spec, block_size, heads, head_size, dtype):
    b = make_batch(spec, seed=1, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                   block_size=block_size, dtype=dtype)
    plan = plan_of(b)
    check(b, plan, *run(ops, b, plan))


@pytest.mark.parametrize("heads", [(48, 1), (80, 1)])
def test_wide_groups(ops, heads):
    # Groups past one CTA's rows: several head tiles per sequence (and per chunk at 80).
    b = make_batch("system_prompts", seed=8, num_heads=heads[0], num_kv_heads=heads[1],
                   head_size=128, block_size=16, dtype=torch.bfloat16)
    plan = plan_of(b)
    check(b, plan, *run(ops, b, plan))


@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_runs_turn_the_pipeline_over(ops, dtype, head_size):
    # 2-6 smem stages per CTA: the cp.async double buffer is refilled while other warps may
    # still read it (the SIMT emulation caught a missing barrier there only with such trees).
    b = make_batch("long", seed=1, num_heads=16, num_kv_heads=4, head_size=head_size,
                   block_size=16, dtype=dtype)
    assert int(b.seq_lens.max()) > 4 * 64
    plan = plan_of(b)
    check(b, plan, *run(ops, b, plan))


@pytest.mark.parametrize("forced", [(2, 1), (1, 3), (3, 4), (16, 16)])
@pytest.mark.parametrize("spec", ["single_prefix", "deep_tree", "batch_17"])
def test_forced_splits(ops, splits, spec, forced):
    b = make_batch(spec, seed=2, num_heads=16, num_kv_heads=4, head_size=128, block_size=16,
                   dtype=torch.float16, max_node_blocks=6, max_private_blocks=6)
    plan = plan_of(b)
    splits(*forced)
    spare = split_spare_slots(plan, b.query.shape[0], *forced)
    check(b, plan, *run(ops, b, plan, spare_slots=spare))


@pytest.mark.parametrize("cap", [1, 3])
@pytest.mark.parametrize("spec", ["deep_tree", "batch_17"])
def test_a_final_cta_merges_its_slots_in_batches(ops, splits, monkeypatch, spec, cap):
    # The slots a final CTA merges are listed in smem, a few thousand at a time: forced short,
    # the rows' 16 splits x chunk partials + tail splits go through several batches.
    b = make_batch(spec, seed=3, num_heads=16, num_kv_heads=4, head_size=128, block_size=16,
                   dtype=torch.bfloat16, max_node_blocks=6, max_private_blocks=6)
    plan = plan_of(b)
    splits(16, 4)
    monkeypatch.setenv("CHUNKATTN_SLOT_LIST_CAP", str(cap))
    spare = split_spare_slots(plan, b.query.shape[0], 16, 4)
    check(b, plan, *run(ops, b, plan, spare_slots=spare))


@pytest.mark.parametrize("launch,case", COMPACT_STAGE_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_each_launch_in_compact_stages(ops, splits, monkeypatch, launch, case, dtype):
    """CHUNKATTN_{FINAL,PARTIAL}_STAGE_TOKENS=32: the launch's compact 32-token instantiation runs
    (its name in the profiler says so; the final launch's default, the partial launch's an
    option: 3 CTAs an SM at head 128) and gives the reference's results; =64: the 64-token one.
    The SIMT emulation runs the same cases on CPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    spec, head_size, forced = case
    kw = dict(num_heads=16, num_kv_heads=4, head_size=head_size, block_size=16, dtype=dtype)
    b = make_batch(spec, seed=9, **kw)
    plan = plan_of(b)
    splits(*forced)
    spare = split_spare_slots(plan, b.query.shape[0], *forced)
    for tokens in (32, 64):
        monkeypatch.setenv(f"CHUNKATTN_{launch.upper()}_STAGE_TOKENS", str(tokens))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = run(ops, b, plan, spare_slots=spare)
            torch.cuda.synchronize()
        check(b, plan, *got)
        kernels = {e.name for e in prof.events()
                   if e.device_type == DeviceType.CUDA and f"tpp_{launch}_kernel" in e.name}
        assert kernels and all(f", {head_size}, {tokens}>" in n for n in kernels), kernels


@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
def test_kv_addresses_in_32_or_64_bits_read_the_same_tokens(ops, monkeypatch, head_size):
    """load_kv_stage's two address paths on the GPU: one int32 offset a token for K and V (the
    flash layout; V in a tensor of its own with K's strides), 64-bit offsets where V's strides
    differ or CHUNKATTN_KV_OFFSETS_I64=1 asks. The SIMT emulation runs the same cases on CPU
    and also checks which path each took."""
    b = make_batch("system_prompts", seed=4, num_heads=8, num_kv_heads=2, head_size=head_size,
                   block_size=16, dtype=torch.bfloat16)
    plan = plan_of(b)
    monkeypatch.delenv("CHUNKATTN_KV_OFFSETS_I64", raising=False)
    check(b, plan, *run(ops, b, plan))
    for vb in value_cache_elsewhere(b).values():
        check(vb, plan, *run(ops, vb, plan))
    monkeypatch.setenv("CHUNKATTN_KV_OFFSETS_I64", "1")
    check(b, plan, *run(ops, b, plan))


@pytest.mark.parametrize("overlap", OVERLAP_OFF_ON)
@pytest.mark.parametrize("spec", ["single_prefix", "system_prompts", "batch_17"])
def test_final_launch_overlapped_or_not(ops, splits, monkeypatch, spec, overlap):
    """The final launch beside the partial one (CHUNKATTN_OVERLAP_FINAL, default on sm_90+): its
    CTAs merge the partial slots only once the partial grid is complete. Both launches carry
    work (split chunks and tails, long nodes), and a race would not show on every call."""
    monkeypatch.setenv("CHUNKATTN_OVERLAP_FINAL", overlap)
    b = make_batch(spec, seed=7, num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                   dtype=torch.bfloat16, max_node_blocks=24, max_private_blocks=20)
    plan = plan_of(b)
    splits(4, 3)
    spare = split_spare_slots(plan, b.query.shape[0], 4, 3)
    for _ in range(5):
        check(b, plan, *run(ops, b, plan, spare_slots=spare))


@pytest.mark.overlap_on
@pytest.mark.timeline
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs sm_90+")
def test_the_final_launch_starts_before_the_partial_one_ends(ops, monkeypatch):
    """That the overlap is real, not only allowed: in the profiler's timeline the final kernel
    starts before the partial kernel ends, and with CHUNKATTN_OVERLAP_FINAL=0 only after it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    b = random_tree_batch(3, fanouts=[1, 32], max_node_blocks=256, max_private_blocks=64,
                          num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                          dtype=torch.bfloat16, device="cuda")
    plan = plan_of(b)

    def spans(overlap):
        monkeypatch.setenv("CHUNKATTN_OVERLAP_FINAL", overlap)
        run(ops, b, plan, spare_slots=4096)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(ops, b, plan, spare_slots=4096)
            torch.cuda.synchronize()
        kernels = {e.name: e.time_range for e in prof.events() if e.device_type == DeviceType.CUDA}
        part = next(v for k, v in kernels.items() if "tpp_partial_kernel" in k)
        final = next(v for k, v in kernels.items() if "tpp_final_kernel" in k)
        return part, final
    part, final = spans("1")
    assert final.start < part.end, (part, final)
    part, final = spans("0")
    assert final.start >= part.end, (part, final)


def test_long_nodes_default_heuristic(ops):
    # One long prefix, few rows: the heuristic splits it across CTAs (when the workspace allows).
    b = random_tree_batch(4, fanouts=[1, 4], max_node_blocks=64, max_private_blocks=40,
                          num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                          dtype=torch.bfloat16, device="cuda")
    plan = plan_of(b)
    check(b, plan, *run(ops, b, plan, spare_slots=4096))
    check(b, plan, *run(ops, b, plan, spare_slots=0))


@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
def test_kv_no_row_holds_is_never_let_in(ops, head_size):
    """Every cache row no sequence reads holds NaN (poison_unread_kv): a stage's tokens past its
    run must land as zeros (cp.async's zero fill)."""
    b = make_batch("long", seed=3, num_heads=8, num_kv_heads=2, head_size=head_size,
                   block_size=16, dtype=torch.float16)
    assert poison_unread_kv(b) > 16 and b.key_cache[0].isnan().all()
    plan = plan_of(b)
    check(b, plan, *run(ops, b, plan))


def test_empty_plan(ops):
    b = make_batch("system_prompts", num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16)
    plan = empty_plan(b.query.shape[0]).to("cuda")
    check(b, plan, *run(ops, b, plan))


def test_batch_order_invariance(ops):
    b = make_batch("deep_tree", seed=5, num_heads=16, num_kv_heads=4, head_size=128,
                   dtype=torch.float16)
    out, lse = run(ops, b, plan_of(b))
    perm = torch.randperm(b.query.shape[0], generator=torch.Generator().manual_seed(0)).cuda()
    b.query, b.block_table, b.seq_lens = b.query[perm], b.block_table[perm], b.seq_lens[perm]
    out_p, lse_p = run(ops, b, plan_of(b))
    torch.testing.assert_close(out_p, out[perm], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse_p, lse[perm], atol=1e-4, rtol=1e-4)


def test_rejects_fp32(ops):
    b = make_batch("batch_1", dtype=torch.float32, head_size=64)
    with pytest.raises(RuntimeError, match="fp16/bf16"):
        run(ops, b, plan_of(b))


def replay_captured(step, query, out):
    """Captures step() in a CUDA graph (after a warm-up outside the capture), then replays it on
    new query values with out filled with NaN: what the replay writes is all that is left."""
    from vllm_chunkattn.bench.timing import cuda_graph
    replay = cuda_graph(step)
    query.copy_(torch.randn_like(query))
    out.fill_(float("nan"))
    replay()
    torch.cuda.synchronize()


def replay_padded_plan(ops, b, rows: int, **variant):
    """b padded to `rows` rows of `rows` blocks, its capacity-padded plan's op call (with
    `variant`'s keyword arguments) captured and replayed as replay_captured does: (out, lse)."""
    plan = padded_to_capacity(b, rows, rows)
    num_heads, head_size = b.query.shape[1:]
    ws = workspace(plan.num_partials + 8 * rows, num_heads, head_size)
    out = torch.empty_like(b.query)
    lse = torch.empty(rows, num_heads, device="cuda")

    def step():
        ops.tpp_decode(b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
                       *plan.tensors(), *ws, b.scale, out, lse, **variant)
    replay_captured(step, b.query, out)
    return out, lse


def test_cuda_graph_replay(ops):
    b = make_batch("system_prompts", seed=6, num_heads=32, num_kv_heads=8, head_size=128,
                   dtype=torch.bfloat16)
    plan = plan_of(b)
    num_seqs, num_heads, head_size = b.query.shape
    ws = workspace(plan.num_partials, num_heads, head_size)
    out = torch.empty_like(b.query)
    lse = torch.empty(num_seqs, num_heads, device="cuda")

    def step():
        ops.tpp_decode(b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
                       *plan.tensors(), *ws, b.scale, out, lse)
    replay_captured(step, b.query, out)
    check(b, plan, out, lse)


@pytest.mark.parametrize("overlap", OVERLAP_OFF_ON)
def test_cuda_graph_capacity_mode(ops, monkeypatch, overlap):
    # What a vLLM FULL decode graph does (backend.py): capture once on a capacity-mode plan, then
    # each step PlanCache writes the step's tree into the same device buffer and the graph
    # replays it. Three trees, one deeper than the capacity (pruned), rows padded with seq_len 0.
    # Captured with the final launch overlapped (a programmatic edge in the graph, sm_90+) or not.
    monkeypatch.setenv("CHUNKATTN_OVERLAP_FINAL", overlap)
    from vllm_chunkattn.decode import TppLaunch
    from vllm_chunkattn.plan import TppWorkspace
    from vllm_chunkattn.plan.cache import PlanCache
    from vllm_chunkattn.plan.capacity import PlanCapacity
    kw = dict(num_heads=16, num_kv_heads=4, head_size=128, dtype=torch.float16, device="cuda",
              fanouts=[3, 4], max_node_blocks=3, max_private_blocks=2)
    batches = [random_tree_batch(8, max_seqs=12, **kw), random_tree_batch(9, max_seqs=10, **kw),
               caterpillar_batch(11, **{k: kw[k] for k in ("num_heads", "num_kv_heads",
                                                            "head_size", "dtype", "device")})]
    num_seqs, width = 12, 12
    # One static KV cache (flash layout) whose contents each step copies in, as vLLM's would be.
    nb = max(b.key_cache.shape[0] for b in batches)
    kv = torch.zeros(nb, batches[0].block_size, 4, 2 * 128, dtype=torch.float16, device="cuda")
    key_cache, value_cache = kv[..., :128], kv[..., 128:]
    bt = torch.zeros(num_seqs, width, dtype=torch.int32, device="cuda")
    q = torch.zeros(num_seqs, 16, 128, dtype=torch.float16, device="cuda")
    sl = torch.zeros(num_seqs, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    lse = torch.empty(num_seqs, 16, device="cuda")
    cache = PlanCache(16, "cuda", capacity=PlanCapacity.for_batch(num_seqs, width))
    ws = TppWorkspace(spare_rows_per_partial=0)

    def load(b):
        n = b.query.shape[0]
        key_cache[:b.key_cache.shape[0]].copy_(b.key_cache)
        value_cache[:b.value_cache.shape[0]].copy_(b.value_cache)
        bt.zero_()
        bt[:n, :b.block_table.shape[1]].copy_(b.block_table)
        sl.zero_()
        sl[:n].copy_(b.seq_lens)
        q.zero_()
        q[:n].copy_(b.query)
        return cache.get(bt.cpu().numpy(), sl.cpu().numpy(), num_blocks=nb)

    launch = TppLaunch(load(batches[0]), bt, sl, 16, 128, "cuda", ws)
    launch.run(q, key_cache, value_cache, batches[0].scale, out, lse)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch.run(q, key_cache, value_cache, batches[0].scale, out, lse)
    assert plan_of(batches[2]).num_partials > cache.capacity.num_partials   # pruned to fit
    for b in batches[1:] + batches[:1]:
        plan = load(b)
        assert [getattr(plan, f).data_ptr() for f in ("node_seq_ids", "seq_partial_ids")] == [
            launch.plan.node_seq_ids.data_ptr(), launch.plan.seq_partial_ids.data_ptr()]
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        n = b.query.shape[0]
        check(b, plan_of(b), out[:n], lse[:n])
        assert torch.equal(out[n:], torch.zeros_like(out[n:]))
        assert torch.isneginf(lse[n:]).all()


def test_opcheck(ops):
    b = make_batch("system_prompts", num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16)
    plan = plan_of(b)
    num_seqs, num_heads, head_size = b.query.shape
    args = (b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
            *plan.tensors(),
            *workspace(plan.num_partials, num_heads, head_size), b.scale,
            torch.empty_like(b.query), torch.empty(num_seqs, num_heads, device="cuda"))
    # Every opcheck util, as on CPU (test_ops_cpu.py): the fake impl that native_ops registers
    # (ops/native.py) serves both devices.
    torch.library.opcheck(torch.ops.chunkattn.tpp_decode.default, args)


@pytest.mark.parametrize("block_size", CUDA_BLOCK_SIZES)
def test_every_advertised_block_size(ops, block_size):
    # The backend advertises exactly these on CUDA (ChunkAttnBackend.get_supported_kernel_block_sizes).
    b = make_batch("system_prompts", seed=7, num_heads=16, num_kv_heads=4, head_size=128,
                   block_size=block_size, dtype=torch.bfloat16)
    plan = plan_of(b)
    check(b, plan, *run(ops, b, plan))


def _args(b, plan):
    num_seqs, num_heads, head_size = b.query.shape
    ws = workspace(plan.num_partials, num_heads, head_size)
    return dict(query=b.query, key_cache=b.key_cache, value_cache=b.value_cache,
                block_table=b.block_table, seq_lens=b.seq_lens, **{
                    k: v for k, v in vars(plan).items() if isinstance(v, torch.Tensor)},
                partial_o=ws[0], partial_m=ws[1], partial_l=ws[2], scale=b.scale,
                out=torch.empty_like(b.query), lse=torch.empty(num_seqs, num_heads, device="cuda"))


# Shape/dtype mistakes: the CUDA op must refuse them with the CPU op's message (csrc/tpp_checks.h).
SHAPE_ERRORS = {
    "block_table_rows": lambda a: dict(block_table=a["block_table"][:-1]),
    "seq_partial_ids_short": lambda a: dict(seq_partial_ids=a["seq_partial_ids"][:-1]),
    "node_seq_indptr_long": lambda a: dict(node_seq_indptr=torch.cat(
        [a["node_seq_indptr"], a["node_seq_indptr"][-1:]])),
    "partial_o_too_few_rows": lambda a: dict(partial_o=a["partial_o"][:1]),
    "lse_shape": lambda a: dict(lse=a["lse"][:, :-1]),
    "seq_lens_int64": lambda a: dict(seq_lens=a["seq_lens"].long()),
    "key_head_size": lambda a: dict(key_cache=a["key_cache"][..., :64],
                                    value_cache=a["value_cache"][..., :64]),
}


@pytest.mark.parametrize("error", sorted(SHAPE_ERRORS))
def test_bad_shapes_fail_as_on_cpu(ops, error):
    b = make_batch("system_prompts", seed=8, num_heads=8, num_kv_heads=2, head_size=128,
                   dtype=torch.float16)
    args = _args(b, plan_of(b))
    assert args["partial_o"].shape[0] > 1
    args.update(SHAPE_ERRORS[error](args))
    messages = []
    for device in ("cuda", "cpu"):
        a = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        with pytest.raises(RuntimeError) as err:
            torch.ops.chunkattn.tpp_decode(**a)
        messages.append(str(err.value).splitlines()[0])
    assert messages[0] == messages[1] and messages[0].startswith("tpp_decode: ")


def test_bad_plan_is_refused_on_the_host_before_the_copy():
    # The CUDA op reads no plan data (no sync); PlanCache checks the host plan for it.
    from vllm_chunkattn.plan.cache import PlanCache
    b = make_batch("system_prompts", seed=9, num_heads=8, num_kv_heads=2, dtype=torch.float16)
    bt, sl = b.block_table.cpu(), b.seq_lens.cpu()
    bt[0, (int(sl[0]) - 1) // b.block_size] = b.key_cache.shape[0]
    cache = PlanCache(b.block_size, "cuda")
    assert cache.check_on_host
    with pytest.raises(RuntimeError, match="block_table row"):
        cache.get(bt, sl, num_blocks=b.key_cache.shape[0])


class _DecodeSteps:
    """Two trees decoded in turn as a serving step does them: per step a PlanCache rebuild (host
    plan, host check, pinned staging into persistent buffers), per layer TppLaunch.run.
    capacity: as in a CUDA graph step (both trees padded to one captured batch size, plans
    padded to its capacities, a workspace without split spares)."""

    def __init__(self, capacity: bool, seeds: tuple[int, int]):
        from vllm_chunkattn.plan import TppWorkspace
        from vllm_chunkattn.plan.cache import PlanCache
        from vllm_chunkattn.plan.capacity import PlanCapacity
        kw = dict(num_heads=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)
        self.batches = [make_batch("system_prompts", seed=seeds[0], **kw),
                        make_batch("deep_tree", seed=seeds[1], **kw)]
        self.cache, self.ws = PlanCache(16, "cuda"), TppWorkspace()
        if capacity:
            rows = max(b.query.shape[0] for b in self.batches) + 2
            width = max(b.block_table.shape[1] for b in self.batches)
            self.batches = [pad_batch(b, rows, width) for b in self.batches]
            self.cache = PlanCache(16, "cuda", capacity=PlanCapacity.for_batch(rows, width))
            self.ws = TppWorkspace(spare_rows_per_partial=0)
        self.host = [(b.block_table.cpu().numpy(), b.seq_lens.cpu().numpy())
                     for b in self.batches]
        self.outs = [torch.full_like(b.query, float("nan")) for b in self.batches]

    def step(self, i: int) -> None:
        from vllm_chunkattn.decode import TppLaunch
        b = self.batches[i]
        plan = self.cache.get(*self.host[i], num_blocks=b.key_cache.shape[0])
        launch = TppLaunch(plan, b.block_table, b.seq_lens, 16, 128, "cuda", self.ws)
        for _layer in range(3):
            launch.run(b.query, b.key_cache, b.value_cache, b.scale, self.outs[i])

    def check(self) -> None:
        for b, out in zip(self.batches, self.outs):
            ref = tpp_decode_reference(b.query, b.key_cache, b.value_cache, b.block_table,
                                       b.seq_lens, plan_of(b), b.scale)
            torch.testing.assert_close(out, ref, **TC_TOL[b.query.dtype])


@pytest.mark.parametrize("capacity", [False, True])
def test_decode_steps_make_no_host_sync(ops, capacity):
    # A decode step's host and device work (_DecodeSteps) under sync debug "error".
    # Alternating two trees rebuilds every step, so both staging slots are reused.
    steps = _DecodeSteps(capacity, seeds=(10, 11))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for n in range(6):
            steps.step(n % 2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert steps.cache.num_builds == 6 and steps.cache._staging.num_uploads == 6
    steps.check()


def _sleep_cycles_per_ms() -> float:
    """torch.cuda._sleep spins for a number of GPU clock cycles: how many make a millisecond."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)                          # first launch out of the way
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


@pytest.mark.parametrize("capacity", [False, True])
def test_a_decode_step_does_not_wait_for_the_gpu(ops, capacity):
    """The catch-all behind sync debug mode (which sees only torch's own sync helpers, not an
    Event.synchronize, a pinned allocation or a pageable copy): with the GPU busy for a second,
    NUM_SLOTS decode steps (each a rebuild: host plan, host check, staged upload, then three
    layers) are queued and the stream is still busy afterwards, so the host never waited."""
    from vllm_chunkattn.plan.staging import PlanStaging
    steps = _DecodeSteps(capacity, seeds=(12, 13))
    for i in (0, 1, 0, 1):                           # warm: staging, workspace, kernel attributes
        steps.step(i)
    cycles_per_ms = _sleep_cycles_per_ms()
    torch.cuda.synchronize()
    builds = steps.cache.num_builds
    torch.cuda._sleep(int(1000 * cycles_per_ms))     # the GPU is busy for about a second
    for n in range(PlanStaging.NUM_SLOTS):
        steps.step(n % 2)
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert steps.cache.num_builds == builds + PlanStaging.NUM_SLOTS      # every step rebuilt
    assert still_busy, "a decode step waited for the GPU (a host sync on the decode path)"
    steps.check()
