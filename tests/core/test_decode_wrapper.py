"""TppDecodeWrapper, the library API: its docstring example runs as written, and plan/run give
per-sequence attention (the fp64 oracle, which knows nothing of plans) on trees, steps after
step, eagerly and with graph-capacity plans."""
import re

import pytest
import torch

import vllm_chunkattn
from vllm_chunkattn import TppDecodeWrapper, decode
from vllm_chunkattn.bench.tree_batches import random_tree_batch
from vllm_chunkattn.ops import dense_decode_oracle


def test_the_docstring_example_runs_and_is_exact():
    code = "\n".join(line[4:] for line in decode.__doc__.split('"""')[0].splitlines()
                     if line.startswith("    "))
    scope = {}
    exec(code, scope)
    ref, _ = dense_decode_oracle(scope["query"], scope["key_cache"], scope["value_cache"],
                                 scope["block_table"], scope["seq_lens"],
                                 scope["head_size"] ** -0.5)
    torch.testing.assert_close(scope["out"], ref.to(scope["out"].dtype), atol=1e-5, rtol=1e-5)


def test_the_wrapper_is_exported_from_the_package():
    assert "TppDecodeWrapper" in vllm_chunkattn.__all__
    assert re.search(r"wrapper\.plan\(.*\)", decode.__doc__)


@pytest.mark.parametrize("use_cuda_graph", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_once_run_per_layer_matches_the_oracle(seed, use_cuda_graph):
    b = random_tree_batch(seed, depth=2, fanout=3, block_size=16)
    num_seqs, num_heads, head_size = b.query.shape
    # Capacity plans on the CPU: the reference reads them (the CPU kernel takes exact plans).
    wrapper = TppDecodeWrapper(b.block_size, use_cuda_graph=use_cuda_graph,
                               max_num_seqs=num_seqs, table_width=b.block_table.shape[1],
                               kernel="reference" if use_cuda_graph else "native")
    plan = wrapper.plan(b.block_table, b.seq_lens, num_heads, head_size,
                        num_blocks=b.key_cache.shape[0])
    assert plan.num_nodes > 0                          # the batch shares something
    assert (wrapper.launch.ops is None) == use_cuda_graph    # which kernel runs: native / reference
    if use_cuda_graph:
        assert plan.num_nodes == num_seqs - 1          # padded to the capacity
    for layer in range(3):                             # new queries, same plan
        query = torch.randn_like(b.query)
        out = torch.full_like(query, float("nan"))
        lse = torch.full((num_seqs, num_heads), float("nan"))
        wrapper.run(query, b.key_cache, b.value_cache, b.scale, out, lse)
        ref, ref_lse = dense_decode_oracle(query, b.key_cache, b.value_cache, b.block_table,
                                           b.seq_lens, b.scale)
        torch.testing.assert_close(out, ref.to(out.dtype), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)


def test_graph_mode_refuses_a_batch_of_another_size():
    b = random_tree_batch(0, block_size=16)
    wrapper = TppDecodeWrapper(b.block_size, use_cuda_graph=True,
                               max_num_seqs=b.query.shape[0] + 1,
                               table_width=b.block_table.shape[1], kernel="reference")
    with pytest.raises(ValueError, match="exactly"):
        wrapper.plan(b.block_table, b.seq_lens, b.query.shape[1], b.query.shape[2])
    with pytest.raises(ValueError, match="max_num_seqs"):
        TppDecodeWrapper(16, use_cuda_graph=True)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        TppDecodeWrapper(16, use_cuda_graph=True, max_num_seqs=4, table_width=8)


def test_run_before_plan_is_a_clear_error():
    with pytest.raises(RuntimeError, match="before plan"):
        TppDecodeWrapper(16).run(torch.zeros(1, 1, 64), torch.zeros(1, 16, 1, 64),
                                 torch.zeros(1, 16, 1, 64), 1.0)
