"""ChunkTreeKVCacheManager against vLLM's own KVCacheManager (prefix caching on) through the calls
the scheduler makes, no engine: what may be shared across requests (prompt embeddings, images)."""
import inspect
import re
import types

import pytest

pytest.importorskip("vllm")

import torch
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched import scheduler as vllm_scheduler
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from vllm_chunkattn.plugin.kv_cache_manager import ChunkTreeKVCacheManager
from vllm_chunkattn.bench.kv_manager_sim import make_manager

pytestmark = pytest.mark.vllm
BS = 16
KINDS = ("stock", "tree")


@pytest.fixture(scope="module")
def hasher():
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BS, hash_fn)


def request(hasher, request_id, prompt=None, **kwargs) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher,
                   **kwargs)


def lookup(manager, req) -> int:
    """Prefix-hit tokens the scheduler would be told for this request."""
    return manager.get_computed_blocks(req)[1]


def run_to_end(manager, req) -> None:
    """Admit the whole prompt (with its hit), compute it, finish: its blocks stay cached."""
    blocks, num_hit, _ = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    manager.free(req)


def test_prompt_embeds_kv_is_served_only_to_the_same_embeddings(hasher):
    """Finding 1: prompt-embeds requests carry placeholder token ids (zeros). Their KV must not
    be served to a text prompt of zeros nor to other embeddings; the same embeddings may share."""
    embeds = torch.randn(3 * BS + 5, 8, generator=torch.Generator().manual_seed(0))
    hits = {}
    for kind in KINDS:
        manager = make_manager(kind, 64, BS)
        run_to_end(manager, request(hasher, "embeds", prompt_embeds=embeds))
        hits[kind] = {
            "text_zeros": lookup(manager, request(hasher, "text", [0] * (3 * BS) + [7] * 5)),
            "other_embeds": lookup(manager, request(hasher, "other", prompt_embeds=embeds + 1)),
            "same_embeds": lookup(manager, request(hasher, "same", prompt_embeds=embeds.clone())),
        }
    # 53 prompt tokens: at most 52 may hit (the last is recomputed), i.e. 3 full blocks.
    assert hits["tree"] == hits["stock"] == {"text_zeros": 0, "other_embeds": 0,
                                             "same_embeds": 3 * BS}, hits


@pytest.mark.parametrize("prompt_blocks, reserved_blocks, fits", [
    (8, 4, True),       # whole prompt fits the free blocks; chunk + reservation fits too
    (8, 9, False),      # the reservation leaves too little for the chunk itself
    (11, 0, False),     # the whole prompt does not fit the pool
])
def test_reserved_blocks_gate_the_scheduled_chunk_not_the_whole_prompt(
        hasher, prompt_blocks, reserved_blocks, fits):
    """Finding 2 (vLLM's contract): with full_sequence_must_fit, the whole prompt is checked
    against the free blocks, and reserved_blocks applies only to the chunk being scheduled."""
    results = {}
    for kind in KINDS:
        manager = make_manager(kind, 11, BS)                # 10 usable blocks (0 is null)
        req = request(hasher, "r", list(range(3, 3 + prompt_blocks * BS)))
        new_blocks = manager.allocate_slots(req, 2 * BS, full_sequence_must_fit=True,
                                            reserved_blocks=reserved_blocks)
        results[kind] = None if new_blocks is None else len(new_blocks.get_block_ids()[0])
    assert results["tree"] == results["stock"] == (2 if fits else None), results


def image(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


@pytest.mark.parametrize("offset", [2 * BS, 2 * BS + 5])
def test_text_before_the_first_image_is_shared_across_images(hasher, offset):
    """Finding 3: the chunks wholly before the first placeholder are plain text, shared with
    requests that carry another image or none; from the placeholder's chunk on, only the same
    image matches."""
    text = list(range(3, 3 + offset))
    prompt = text + [9] * BS + list(range(500, 519))      # image placeholders, then more text
    hits = {}
    for kind in KINDS:
        manager = make_manager(kind, 64, BS)
        run_to_end(manager, request(hasher, "a", prompt, mm_features=[image("img-a", offset, BS)]))
        hits[kind] = {
            "other_image": lookup(manager, request(hasher, "b", prompt,
                                                   mm_features=[image("img-b", offset, BS)])),
            "same_image": lookup(manager, request(hasher, "c", prompt,
                                                  mm_features=[image("img-a", offset, BS)])),
            "text_only": lookup(manager, request(hasher, "d", text + [7] * 40)),
        }
    # Blocks 0-1 end at or before the placeholder; the prompt has len(prompt) - 1 hittable tokens.
    full = (len(prompt) - 1) // BS * BS
    assert hits["tree"] == hits["stock"] == {"other_image": 2 * BS, "same_image": full,
                                             "text_only": 2 * BS}, hits


def test_max_cache_hit_length_caps_the_match_in_tokens(hasher):
    """vLLM 0.33 calls get_computed_blocks(request, max_cache_hit_length) positionally; the cap
    is in tokens and only whole chunks below it hit (the last token is still recomputed)."""
    manager = make_manager("tree", 64, BS)
    prompt = list(range(3, 3 + 5 * BS))
    run_to_end(manager, request(hasher, "a", prompt))
    req = request(hasher, "b", prompt)
    assert lookup(manager, req) == 4 * BS                           # 5 * BS - 1 hittable
    hits = {cap: manager.get_computed_blocks(req, cap)[1]
            for cap in (0, BS - 1, 2 * BS, 2 * BS + 7, 10 * BS)}
    assert hits == {0: 0, BS - 1: 0, 2 * BS: 2 * BS, 2 * BS + 7: 2 * BS, 10 * BS: 4 * BS}
    assert manager.get_computed_blocks(req, None)[1] == 4 * BS
    # 0.33 passes the cap to the connector-side lookup too.
    assert manager.get_computed_blocks_for_connector(req, 2 * BS + 7)[1:] == (2 * BS, 0, False)


def test_every_method_the_scheduler_calls_is_the_tree_managers_own():
    """Composition, not adoption: whatever the installed vLLM's Scheduler calls on its KV cache
    manager is defined in ChunkTreeKVCacheManager's own class body (a tree answer, an explicit
    delegation or a clear refusal), never inherited to run on stock state the tree never fills.
    Attributes the scheduler reads (not methods) must still be there."""
    source = inspect.getsource(vllm_scheduler)
    names = set(re.findall(r"self\.kv_cache_manager\s*\.\s*(\w+)", source))
    methods = {name for name in names if isinstance(
        inspect.getattr_static(KVCacheManager, name, None), (types.FunctionType, property))}
    assert {"get_computed_blocks", "allocate_slots", "free", "usage"} <= methods, names
    inherited = sorted(name for name in methods if name not in ChunkTreeKVCacheManager.__dict__)
    assert inherited == [], f"the tree manager inherits {inherited} from KVCacheManager"
    manager = make_manager("tree", 16, BS)
    assert all(hasattr(manager, name) for name in names - methods), names - methods


def test_the_tree_manager_wraps_vllms_and_names_a_call_it_lacks(hasher, monkeypatch):
    """Composition: the stock manager is held, not adopted, and a KVCacheManager method a newer
    vLLM would call is an error naming it instead of stock code run on stock state."""
    manager = make_manager("tree", 16, BS)
    assert not isinstance(manager, KVCacheManager) and isinstance(manager.stock, KVCacheManager)
    monkeypatch.setattr(KVCacheManager, "take_new_kind_of_state", lambda self: [],
                        raising=False)
    assert manager.stock.take_new_kind_of_state() == []
    with pytest.raises(AttributeError, match="'take_new_kind_of_state'.*does not provide"):
        manager.take_new_kind_of_state()
    assert not hasattr(manager, "no_such_attribute")
    # Hit statistics stay vLLM's own: the lookup the scheduler records lands in them.
    prompt = list(range(3, 3 + 2 * BS + 1))
    run_to_end(manager, request(hasher, "a", prompt))
    req = request(hasher, "b", prompt)
    manager.record_prefix_cache_stats(req, lookup(manager, req))
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, req.num_tokens, 2 * BS)
    assert manager.make_prefix_cache_stats().requests == 0      # taken: a fresh one starts


def test_connector_lookups_answer_from_the_tree(hasher):
    """The connector-side lookups the scheduler calls give what vLLM's manager gives."""
    prompt = list(range(3, 3 + 4 * BS + 3))
    answers = {}
    for kind in KINDS:
        manager = make_manager(kind, 64, BS)
        run_to_end(manager, request(hasher, "a", prompt))
        req = request(hasher, "b", prompt)
        blocks, num_hit, _, diverged = manager.get_computed_blocks_for_connector(req)
        truncated = manager.truncate_computed_blocks(blocks, 2 * BS)
        manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks)
        answers[kind] = (num_hit, diverged, len(truncated.get_block_ids()[0]),
                         [len(manager.get_block_ids_for_computed_tokens("b", n)[0])
                          for n in (0, 1, BS, BS + 1, req.num_tokens)])
    assert answers["tree"] == answers["stock"] == (4 * BS, False, 2, [0, 1, 1, 2, 5]), answers
