"""ChunkAttnMetadataBuilder without a model runner (vLLM's attention-backend test shape): a real
VllmConfig of the tiny model, the platform builder underneath, builder.build called directly."""
import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_chunkattn.plugin import backend
from vllm_runs import tiny_model

pytestmark = pytest.mark.vllm
BS = 32
HEADS = 8      # tiny-llama's num_attention_heads: the builder sizes its workspace for the model's


@pytest.fixture(scope="module")
def vllm_config():
    return VllmConfig(model_config=ModelConfig(model=str(tiny_model()), dtype="float32"),
                      cache_config=CacheConfig(block_size=BS))


def make_builder(vllm_config) -> backend.ChunkAttnMetadataBuilder:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    with set_current_vllm_config(vllm_config):
        return backend.ChunkAttnMetadataBuilder(spec, ["layer.0"], vllm_config,
                                                torch.device("cpu"))


def test_metadata_carries_the_batch_slot_mapping(vllm_config):
    """Finding 5: like every in-tree backend's metadata, ours has the step's slot_mapping."""
    builder = make_builder(vllm_config)
    # Two decodes sharing block 1 (40 tokens each), then a 5-token prefill.
    query_start_loc = torch.tensor([0, 1, 2, 7], dtype=torch.int32)
    seq_lens = torch.tensor([40, 40, 5], dtype=torch.int32)
    slot_mapping = torch.tensor([2 * BS + 7, 3 * BS + 7, 4 * BS, 4 * BS + 1, 4 * BS + 2,
                                 4 * BS + 3, 4 * BS + 4])
    cm = CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc, seq_lens=seq_lens,
        num_reqs=3, num_actual_tokens=7, max_query_len=5, max_seq_len=40,
        block_table_tensor=torch.tensor([[1, 2], [1, 3], [4, 0]], dtype=torch.int32),
        slot_mapping=slot_mapping, seq_lens_cpu_upper_bound=seq_lens.clone())
    with set_current_vllm_config(vllm_config):
        md = builder.build(0, cm)
    assert md.num_decodes == 2 and md.prefill is not None
    assert torch.equal(md.slot_mapping, torch.tensor([71, 103, 128, 129, 130, 131, 132]))


def test_non_causal_metadata_is_refused_not_computed_causally(vllm_config):
    """Non-causal metadata (vLLM's attention test harness builds it; vLLM's selector never hands
    it to CUSTOM) is refused: building it is an error, not prefill rows computed as causal."""
    builder = make_builder(vllm_config)
    query_start_loc = torch.tensor([0, 5], dtype=torch.int32)
    seq_lens = torch.tensor([5], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc, seq_lens=seq_lens,
        num_reqs=1, num_actual_tokens=5, max_query_len=5, max_seq_len=5,
        block_table_tensor=torch.tensor([[1]], dtype=torch.int32),
        slot_mapping=torch.arange(BS, BS + 5), seq_lens_cpu_upper_bound=seq_lens.clone(),
        causal=False)
    with set_current_vllm_config(vllm_config), pytest.raises(NotImplementedError, match="causal"):
        builder.build(0, cm)
    assert not backend.ChunkAttnBackend.supports_non_causal()


def test_missing_native_kernel_is_a_startup_error_unless_opted_in(vllm_config, monkeypatch):
    """No silent slow path: without the native kernel for the device, building the backend fails
    and names the fix; CHUNKATTN_ALLOW_REFERENCE=1 opts in to the PyTorch reference."""
    assert backend.kernel_name(torch.device("cpu")) == "native-cpu"    # this checkout's build
    monkeypatch.setattr(backend, "_announced", False)
    make_builder(vllm_config)                                          # the real kernel: starts
    monkeypatch.setattr(backend, "_announced", False)
    monkeypatch.setattr(backend, "kernel_name", lambda device: "torch-reference")
    monkeypatch.delenv("CHUNKATTN_ALLOW_REFERENCE", raising=False)
    with pytest.raises(RuntimeError) as err:
        make_builder(vllm_config)
    message = str(err.value)
    assert "pip install -e . --no-build-isolation" in message
    assert "CHUNKATTN_ALLOW_REFERENCE=1" in message
    monkeypatch.setenv("CHUNKATTN_ALLOW_REFERENCE", "1")
    assert make_builder(vllm_config).block_size == BS


def _meta(t: torch.Tensor) -> torch.Tensor:
    """A device-side tensor the host cannot read: any .cpu(), .numpy() or .item() raises."""
    return torch.empty_like(t, device="meta")


def test_decode_plan_comes_from_host_copies_only(vllm_config):
    """build() plans from vLLM's host copies (the V1 runner's BlockTable.cpu rows found through
    plugin/host_block_table.py, seq_lens_cpu_upper_bound) and never reads the device tensors,
    played here by meta tensors."""
    from vllm.v1.worker.block_table import BlockTable

    from vllm_chunkattn.plan import build_plan
    from vllm_chunkattn.plugin import host_block_table
    host_block_table.install()
    table = BlockTable(BS, 8, 4, 64, False, torch.device("meta"), 1)
    rows = [[4, 5, 6], [4, 5, 7], [4, 8, 9]]             # block 4 shared by 3 rows, 5 by 2
    for i, r in enumerate(rows):
        table.add_row(r, i)
    seq_lens = torch.tensor([2 * BS + 3, 2 * BS + 9, 3 * BS], dtype=torch.int32)
    query_start_loc = torch.arange(4, dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=_meta(query_start_loc), query_start_loc_cpu=query_start_loc,
        seq_lens=_meta(seq_lens), num_reqs=3, num_actual_tokens=3, max_query_len=1,
        max_seq_len=3 * BS, block_table_tensor=table.get_device_tensor(3),
        slot_mapping=_meta(torch.zeros(3, dtype=torch.int64)),
        seq_lens_cpu_upper_bound=seq_lens)
    builder = make_builder(vllm_config)
    with set_current_vllm_config(vllm_config):
        md = builder.build(0, cm)
    want = build_plan(torch.tensor(rows, dtype=torch.int32), seq_lens, BS)
    assert md.plan.num_nodes == want.num_nodes == 2
    for name, t in vars(want).items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(getattr(md.plan, name), t), name
    assert md.decode_block_table.is_meta and md.decode_seq_lens.is_meta   # handed on untouched


def _decode_metadata(table: torch.Tensor, seq_lens: torch.Tensor) -> CommonAttentionMetadata:
    n = table.shape[0]
    qsl = torch.arange(n + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, num_reqs=n,
        num_actual_tokens=n, max_query_len=1, max_seq_len=int(seq_lens.max()),
        block_table_tensor=table, slot_mapping=torch.full((n,), -1, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq_lens.clone())


def test_a_new_builder_releases_the_views_of_the_old_kv_cache(vllm_config):
    """vLLM builds, captures graphs on a throwaway profiling KV cache, then makes new builders
    and allocates the real cache: the impls' cached K/V views must not keep the throwaway cache
    alive through that allocation."""
    import gc
    import weakref

    from vllm_chunkattn.ops.reference import tpp_decode_reference
    from vllm_chunkattn.bench.tree_batches import TREE_SPECS, random_tree_batch
    b = random_tree_batch(4, **TREE_SPECS["system_prompts"], block_size=BS, num_heads=HEADS,
                          num_kv_heads=2, layout="cpu_attn")
    builder = make_builder(vllm_config)
    with set_current_vllm_config(vllm_config):
        md = builder.build(0, _decode_metadata(b.block_table, b.seq_lens))
        impl = backend.ChunkAttnImpl(HEADS, 64, b.scale, 2, None, None, "auto")
    profiling_cache = b.kv_cache.clone()
    out = torch.empty_like(b.query)
    impl.forward(None, b.query, b.query[:, :2], b.query[:, :2], profiling_cache, md, out)
    assert impl._views[0] is profiling_cache
    gone = weakref.ref(profiling_cache)
    make_builder(vllm_config)                             # vLLM's builders for the real cache
    assert impl._views is None
    del profiling_cache
    gc.collect()
    assert gone() is None                                 # nothing of ours holds it
    impl.forward(None, b.query, b.query[:, :2], b.query[:, :2], b.kv_cache, md, out)
    ref = tpp_decode_reference(b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
                               md.plan, b.scale)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_sharing_counters_count_served_rows_not_vllms_dummy_batches(vllm_config):
    """On a GPU, vLLM warms each FULL-graph size up with an eager dummy batch through build()
    (and an idle data-parallel rank steps on one): rows on the null block 0, seq_len 1 or a
    made-up context. Those are no served decode, so /metrics' counters must not move; a served
    step then adds exactly its rows, their lengths and the chunks they share."""
    from vllm_chunkattn.plugin.stats import SHARING_STATS
    counters = ("decode_steps", "decode_rows", "kv_tokens", "shared_kv_tokens")
    builder = make_builder(vllm_config)
    before = SHARING_STATS.as_dict()
    for context in (1, 3 * BS + 5):                       # V2 profiles with a dummy context
        table = torch.zeros(6, 4, dtype=torch.int32)
        with set_current_vllm_config(vllm_config):
            md = builder.build(0, _decode_metadata(table, torch.full((6,), context,
                                                                      dtype=torch.int32)))
        assert md.num_decodes == 6 and md.plan is not None   # still planned and run
    unchanged = SHARING_STATS.as_dict()
    assert {k: unchanged[k] for k in counters} == {k: before[k] for k in counters}
    # Served: rows 0-2 share blocks 4 and 5 (2 full chunks), row 3 is graph padding.
    table = torch.tensor([[4, 5, 6, 0], [4, 5, 7, 0], [4, 5, 8, 0], [0, 0, 0, 0]],
                         dtype=torch.int32)
    seq_lens = torch.tensor([2 * BS + 1, 2 * BS + 7, 3 * BS, 0], dtype=torch.int32)
    with set_current_vllm_config(vllm_config):
        builder.build(0, _decode_metadata(table, seq_lens))
    after = SHARING_STATS.as_dict()
    assert after["decode_steps"] == before["decode_steps"] + 1
    assert after["decode_rows"] == before["decode_rows"] + 3
    assert after["kv_tokens"] == before["kv_tokens"] + 7 * BS + 8
    assert after["shared_kv_tokens"] == before["shared_kv_tokens"] + 2 * 2 * BS


def test_captured_decode_sizes_replay_any_tree_from_buffers_that_never_move(vllm_config):
    """CUDA graphs: the builder declares uniform single-token decode graphs. A batch size it
    was captured at (build_for_cudagraph_capture, on vLLM's dummy batch: seq_len 1, null
    blocks) then gets capacity-mode plans: every tensor the captured kernel call points at (plan,
    workspace, vLLM's block table and seq_lens) is the same in every later step, whatever the
    tree, and the padded plan is still exact. Other sizes and mixed batches get exact plans."""
    from vllm.v1.attention.backend import AttentionCGSupport

    from vllm_chunkattn.ops.reference import dense_decode_oracle, tpp_decode_reference
    from vllm_chunkattn.plugin.stats import SHARING_STATS
    from vllm_chunkattn.bench.tree_batches import TREE_SPECS, random_tree_batch
    assert (backend.ChunkAttnBackend.get_builder_cls()._cudagraph_support
            == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    n, width = 12, 16
    table, seq_lens = torch.zeros(n, width, dtype=torch.int32), torch.ones(n, dtype=torch.int32)
    builder = make_builder(vllm_config)
    steps = SHARING_STATS.decode_steps
    with set_current_vllm_config(vllm_config):
        captured = builder.build_for_cudagraph_capture(_decode_metadata(table, seq_lens))
    assert SHARING_STATS.decode_steps == steps            # a dummy batch is not a served step
    held = [t.data_ptr() for t in captured.decode.plan_args]
    for seed, spec in ((1, "system_prompts"), (2, "deep_tree")):
        b = random_tree_batch(seed, **TREE_SPECS[spec], max_seqs=n - 2, block_size=BS,
                              num_heads=HEADS, num_kv_heads=2)
        rows = b.block_table.shape[0]
        table.zero_()                                     # vLLM's persistent rows, in place
        table[:rows, :b.block_table.shape[1]] = b.block_table
        seq_lens.zero_()
        seq_lens[:rows] = b.seq_lens
        with set_current_vllm_config(vllm_config):
            md = builder.build(0, _decode_metadata(table, seq_lens))
        assert [t.data_ptr() for t in md.decode.plan_args] == held
        assert md.plan.num_partials == 4 * n and md.plan.num_nodes == n - 1   # padded
        out = tpp_decode_reference(b.query, b.key_cache, b.value_cache, table[:rows],
                                   seq_lens[:rows], _rows(md.plan, rows), b.scale)
        want, _ = dense_decode_oracle(b.query, b.key_cache, b.value_cache, b.block_table,
                                      b.seq_lens, b.scale)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert SHARING_STATS.decode_steps == steps + 2
    with set_current_vllm_config(vllm_config):
        other = builder.build(0, _decode_metadata(table[:n - 1], seq_lens[:n - 1]))
    assert other.plan.num_partials == other.plan.node_seq_ids.numel() < 4 * (n - 1)   # exact
    # n decodes and a prefill: never replayed by a graph (PIECEWISE), so an exact plan.
    mixed = _decode_metadata(torch.cat([table, table[:1]]), torch.cat([seq_lens, seq_lens[:1]]))
    mixed.query_start_loc_cpu[-1] += 4
    mixed.query_start_loc, mixed.num_actual_tokens, mixed.max_query_len = (
        mixed.query_start_loc_cpu, n + 5, 5)
    mixed.slot_mapping = torch.full((n + 5,), -1, dtype=torch.int64)
    with set_current_vllm_config(vllm_config):
        md = builder.build(0, mixed)
    assert md.num_decodes == n and md.prefill is not None
    assert md.plan.num_partials == md.plan.node_seq_ids.numel() < 4 * n
    assert builder.plans.num_builds == 2 and builder.graph_plans[n][0].num_builds == 3


def test_vllm_keeps_full_decode_graphs_with_custom():
    """What the declared support buys: vLLM's default FULL_AND_PIECEWISE mode stays as it is, so
    decode steps replay FULL graphs with our attention inside (mixed batches: PIECEWISE)."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    support = backend.ChunkAttnBackend.get_builder_cls().get_cudagraph_support(None, None)
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                               cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                               cudagraph_capture_sizes=[1, 2, 4, 8])
    mode = config.resolve_cudagraph_mode_and_sizes(support, "CUSTOM", 1, max_num_reqs=8)
    assert mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert mode.decode_mode() == CUDAGraphMode.FULL and mode.mixed_mode() == CUDAGraphMode.PIECEWISE


def test_no_graphs_when_the_pytorch_reference_decodes(monkeypatch):
    """CHUNKATTN_ALLOW_REFERENCE=1 where no native kernel loads: the reference reads the plan on
    the host, which a graph capture forbids, so the builder declares no graph support and vLLM
    captures no graph with attention inside."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport
    builder_cls = backend.ChunkAttnBackend.get_builder_cls()
    assert (builder_cls.get_cudagraph_support(None, None)
            == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    monkeypatch.setattr(backend, "kernel_name", lambda device: "torch-reference")
    support = builder_cls.get_cudagraph_support(None, None)
    assert support == AttentionCGSupport.NEVER
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                               cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                               cudagraph_capture_sizes=[1, 2, 4, 8])
    mode = config.resolve_cudagraph_mode_and_sizes(support, "CUSTOM", 1, max_num_reqs=8)
    assert mode.decode_mode() != CUDAGraphMode.FULL


def _rows(plan, rows):
    """The plan of the first `rows` rows of a padded one (the batch's query holds only those;
    the padding rows have no partials)."""
    from vllm_chunkattn.plan import TppPlan
    return TppPlan(rows, plan.num_nodes, plan.num_partials, plan.node_block_indptr,
                   plan.node_block_ids, plan.node_seq_indptr, plan.node_seq_ids,
                   plan.seq_partial_indptr[:rows + 1], plan.seq_partial_ids,
                   plan.seq_num_shared_blocks[:rows], plan.node_first_block)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM for CUDA")
def test_decode_build_and_forward_never_sync_on_cuda():
    """A decode step (build + every layer's forward) makes no host sync on CUDA."""
    from vllm.v1.worker.block_table import BlockTable

    from vllm_chunkattn.ops.reference import tpp_decode_reference
    from vllm_chunkattn.plugin import host_block_table
    from vllm_chunkattn.bench.tree_batches import TREE_SPECS, random_tree_batch
    config = VllmConfig(model_config=ModelConfig(model=str(tiny_model()), dtype="bfloat16"),
                        cache_config=CacheConfig(block_size=BS))
    host_block_table.install()
    b = random_tree_batch(0, **TREE_SPECS["system_prompts"], num_heads=HEADS, num_kv_heads=2,
                          head_size=64, block_size=BS, dtype=torch.bfloat16, device="cuda")
    n, width = b.block_table.shape
    table = BlockTable(BS, 32, width, 256, True, torch.device("cuda"), 1)
    for i, row in enumerate(b.block_table.tolist()):
        table.add_row(row, i)
    table.commit_block_table(n)
    seq_lens_cpu = b.seq_lens.cpu()
    qsl = torch.arange(n + 1, dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.cuda(), query_start_loc_cpu=qsl, seq_lens=b.seq_lens, num_reqs=n,
        num_actual_tokens=n, max_query_len=1, max_seq_len=int(seq_lens_cpu.max()),
        block_table_tensor=table.get_device_tensor(n),
        slot_mapping=torch.zeros(n, dtype=torch.int64, device="cuda"),
        seq_lens_cpu_upper_bound=seq_lens_cpu)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with set_current_vllm_config(config):
        builder = backend.ChunkAttnMetadataBuilder(spec, ["layer.0"], config,
                                                   torch.device("cuda"))
        impl = backend.ChunkAttnImpl(HEADS, 64, b.scale, 2, None, None, "auto")
        out = torch.full_like(b.query, float("nan"))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):                           # a build, then plan reuses
                md = builder.build(0, cm)
                for _layer in range(2):
                    impl.forward(None, b.query, b.query[:, :2], b.query[:, :2], b.kv_cache, md,
                                 out)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert builder.plans.num_builds == 1
    ref = tpp_decode_reference(b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
                               md.plan, b.scale)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM for CUDA")
def test_full_decode_graph_replays_each_steps_tree_through_the_builder():
    """CUDA graphs as vLLM's FULL decode graphs run them: the metadata of
    build_for_cudagraph_capture (vLLM's dummy batch) and one layer's forward are captured once;
    each later step build()s its own tree into the same buffers and the graph is replayed."""
    from vllm.v1.worker.block_table import BlockTable

    from vllm_chunkattn.ops.reference import tpp_decode_reference
    from vllm_chunkattn.plugin import host_block_table
    from vllm_chunkattn.bench.tree_batches import TREE_SPECS, caterpillar_batch, random_tree_batch
    from vllm_chunkattn.kv_layout import alloc_kv_cache
    config = VllmConfig(model_config=ModelConfig(model=str(tiny_model()), dtype="bfloat16"),
                        cache_config=CacheConfig(block_size=BS))
    host_block_table.install()
    kw = dict(num_heads=HEADS, num_kv_heads=2, head_size=64, block_size=BS, dtype=torch.bfloat16,
              device="cuda")
    trees = [random_tree_batch(3, **TREE_SPECS["system_prompts"], max_seqs=10, **kw),
             caterpillar_batch(12, **kw)]
    n, width = 12, 16
    table = BlockTable(BS, n, width, 256, True, torch.device("cuda"), 1)
    seq_lens = torch.ones(n, dtype=torch.int32, device="cuda")
    query = torch.zeros(n, HEADS, 64, dtype=torch.bfloat16, device="cuda")
    num_blocks = max(b.kv_cache.shape[0] for b in trees)
    kv_cache = alloc_kv_cache(num_blocks, BS, 2, 64, torch.bfloat16, "cuda", "flash")
    out = torch.zeros_like(query)
    qsl = torch.arange(n + 1, dtype=torch.int32)

    def metadata(host_seq_lens):
        table.commit_block_table(n)
        return CommonAttentionMetadata(
            query_start_loc=qsl.cuda(), query_start_loc_cpu=qsl, seq_lens=seq_lens, num_reqs=n,
            num_actual_tokens=n, max_query_len=1, max_seq_len=int(host_seq_lens.max()),
            block_table_tensor=table.get_device_tensor(n),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device="cuda"),
            seq_lens_cpu_upper_bound=host_seq_lens)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with set_current_vllm_config(config):
        builder = backend.ChunkAttnMetadataBuilder(spec, ["layer.0"], config,
                                                   torch.device("cuda"))
        impl = backend.ChunkAttnImpl(HEADS, 64, 0.125, 2, None, None, "auto")
        for i in range(n):                              # vLLM's dummy batch: null blocks
            table.add_row([0], i)
        captured = builder.build_for_cudagraph_capture(metadata(torch.ones(n, dtype=torch.int32)))

        def layer(md):
            impl.forward(None, query, query[:, :2], query[:, :2], kv_cache, md, out)
        layer(captured)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer(captured)
        for b in trees + trees[:1]:
            rows = b.query.shape[0]
            kv_cache[:b.kv_cache.shape[0]].copy_(b.kv_cache)
            for i in range(n):
                table.add_row(b.block_table[i].tolist() if i < rows else [0], i)
            host_seq_lens = torch.nn.functional.pad(b.seq_lens.cpu(), (0, n - rows))
            seq_lens.copy_(host_seq_lens)
            query.zero_()
            query[:rows].copy_(b.query)
            md = builder.build(0, metadata(host_seq_lens))
            assert [t.data_ptr() for t in md.decode.plan_args] == [
                t.data_ptr() for t in captured.decode.plan_args]
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ref = tpp_decode_reference(b.query, b.key_cache, b.value_cache, b.block_table,
                                       b.seq_lens, build_plan_of(b), 0.125)
            torch.testing.assert_close(out[:rows], ref, atol=1e-2, rtol=1e-2)
            assert torch.equal(out[rows:], torch.zeros_like(out[rows:]))


def build_plan_of(b):
    from vllm_chunkattn.plan import build_plan
    return build_plan(b.block_table.cpu(), b.seq_lens.cpu(), b.block_size)
