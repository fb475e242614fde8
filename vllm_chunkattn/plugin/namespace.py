"""Request namespaces: what besides the token ids decides whether two requests' KV can be shared.
Chunks of different namespaces never match (tree.py), as vLLM folds the same inputs into its
block hashes (kv_cache_utils.generate_block_hash_extra_keys)."""
from __future__ import annotations

import hashlib
import weakref
from collections.abc import Hashable

from vllm.v1.request import Request
from vllm.v1.utils import tensor_data

from ..tree import SplitNamespace

# Request -> digest of its prompt embeddings: hashed once per request, forgotten with it.
_embeds_digests: weakref.WeakKeyDictionary[Request, bytes] = weakref.WeakKeyDictionary()


def request_namespace(request: Request) -> Hashable:
    """LoRA adapter, cache_salt, prompt embeddings and multimodal inputs: placeholder token ids
    (zeros for embeddings, repeated placeholder ids for images) do not identify the content.
    Multimodal inputs key only the chunks from the one holding the first placeholder on."""
    lora = request.lora_request.lora_int_id if request.lora_request else 0
    embeds = _embeds_digest(request) if request.prompt_embeds is not None else None
    text = None
    if lora or request.cache_salt is not None or embeds is not None:
        text = (lora, request.cache_salt, embeds)
    if not request.mm_features:
        return text
    mm = tuple((f.identifier, f.mm_position.offset) for f in request.mm_features)
    first = min(f.mm_position.offset for f in request.mm_features)
    return SplitNamespace(text, (text, mm), first)


def _embeds_digest(request: Request) -> bytes:
    digest = _embeds_digests.get(request)
    if digest is None:
        embeds = request.prompt_embeds
        h = hashlib.sha256(f"{embeds.dtype}{tuple(embeds.shape)}".encode())
        h.update(tensor_data(embeds))
        if request.prompt_is_token_ids is not None:     # mixed prompts: which rows are embeds
            h.update(bytes(request.prompt_is_token_ids))
        digest = _embeds_digests[request] = h.digest()
    return digest
