"""Tiny seeded checkpoints of the model families vLLM users deploy, with *peaky* attention.

Each family keeps its real attention features (gpt-oss: sinks + alternating sliding/full layers;
Gemma 2: logit soft-capping + alternating sliding/global; Gemma 3: 5:1 sliding/global with q/k
norms; Mistral: a window on every layer; Phi-3: head size 96; Phi-4-mini: a window longer than
the context, partial rotary) at a size that serves in seconds on a CPU. The weights are seeded
random tensors, then sharpened: q/k projections (or Gemma 3's q/k norms) are scaled so attention
logits are large, so each query attends to a few keys and a wrong window, sink, soft-cap or head
size changes greedy tokens (tests/families/test_family_models.py proves it for each family).

    python -m families.models --all            # from tests/: builds models/families/<name>
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_chunkattn.tiny_model import VOCAB_SIZE

REPO = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO / "models" / "families"
SEED = 0

_COMMON = dict(vocab_size=VOCAB_SIZE, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               max_position_embeddings=2048, tie_word_embeddings=False)

# name -> spec. "config": the transformers config's kwargs (floats as floats: transformers 5
# validates their types); "qk_scale": how much q and k are each multiplied by (attention logits
# grow by its square); "mlp_scale" / "embed_scale": MLP outputs and input embeddings damped so
# attention, not a shared MLP direction, decides the next token; "window": the sliding window
# of the sliding layers (None: no window); "perturb": what the peakiness test changes, each a config
# override (`config`) and/or an edit of the loaded HF model (`edit`, a name in EDITS).
FAMILIES: dict[str, dict] = {
    "gpt-oss": dict(
        config_class="GptOssConfig", architecture="GptOssForCausalLM",
        config=dict(_COMMON, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 64,
                                     "rope_theta": 150000.0}),
        qk_scale=8.0, sinks=(2.0, 3.0), window=16,
        perturb={"window": dict(config={"sliding_window": 8}),
                 "sinks": dict(edit="zero_sinks")}),
    "gemma2": dict(
        config_class="Gemma2Config", architecture="Gemma2ForCausalLM",
        config=dict(_COMMON, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    query_pre_attn_scalar=64, sliding_window=32,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    attn_logit_softcapping=10.0, final_logit_softcapping=30.0,
                    tie_word_embeddings=True),
        qk_scale=8.0, mlp_scale=0.2, embed_scale=0.5, window=32,
        perturb={"window": dict(config={"sliding_window": 24}),
                 "softcap": dict(config={"attn_logit_softcapping": 50.0})}),
    "gemma3": dict(
        config_class="Gemma3TextConfig", architecture="Gemma3ForCausalLM",
        config=dict(_COMMON, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                    query_pre_attn_scalar=128, sliding_window=48,
                    layer_types=["sliding_attention"] * 5 + ["full_attention"],
                    tie_word_embeddings=True),
        qk_scale=3.0, mlp_scale=0.2, window=48,
        perturb={"window": dict(config={"sliding_window": 40})}),
    "mistral-sw": dict(
        config_class="MistralConfig", architecture="MistralForCausalLM",
        config=dict(_COMMON, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                    sliding_window=40),
        qk_scale=8.0, window=40,
        perturb={"window": dict(config={"sliding_window": 32})}),
    "phi3-hd96": dict(
        config_class="Phi3Config", architecture="Phi3ForCausalLM",
        config=dict(_COMMON, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, sliding_window=None,
                    original_max_position_embeddings=2048),
        qk_scale=8.0, window=None,
        # A kernel padding 96 to 128 must keep 96's scale: 128's changes the tokens.
        perturb={"head_size_scale": dict(edit="scale_as_head_128")}),
    "phi4-mini-like": dict(
        config_class="Phi3Config", architecture="Phi3ForCausalLM",
        config=dict(_COMMON, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1,
                    sliding_window=262144, original_max_position_embeddings=2048,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.75}),
        qk_scale=8.0, window=None,   # 262144 > max_position_embeddings: no token falls outside
        # Were the (never reached) window applied as a small one, the tokens would change.
        perturb={"window": dict(config={"sliding_window": 32})}),
}


def _attention_modules(model):
    return [m for name, m in model.named_modules() if name.endswith("self_attn")]


def _sharpen(model, spec) -> None:
    """Scale q and k so attention logits are large; give gpt-oss clearly non-zero sinks; larger
    output weights (as the tiny Llama) so greedy choices are far from ties."""
    import torch

    s = spec["qk_scale"]
    with torch.no_grad():
        for attn in _attention_modules(model):
            if hasattr(attn, "q_norm"):
                # Gemma 3 normalizes q and k per head (x * (1 + w), w = 0 at init): scaling the
                # projections would be undone, the norms' weights are not.
                attn.q_norm.weight.fill_(s - 1.0)
                attn.k_norm.weight.fill_(s - 1.0)
            elif hasattr(attn, "qkv_proj"):     # Phi-3: [q; k; v] rows
                q_rows = attn.config.num_attention_heads * attn.head_dim
                kv_rows = attn.config.num_key_value_heads * attn.head_dim
                attn.qkv_proj.weight[:q_rows + kv_rows].mul_(s)
            else:
                for proj in (attn.q_proj, attn.k_proj):
                    proj.weight.mul_(s)
                    if proj.bias is not None:
                        proj.bias.mul_(s)
            if hasattr(attn, "sinks"):
                mean, std = spec["sinks"]
                attn.sinks.copy_(torch.randn_like(attn.sinks) * std + mean)
        for layer in model.model.layers:
            # Damp the MLPs: their outputs share a direction (GELU/SiLU means are positive),
            # which, undamped, makes every position predict the same token.
            if hasattr(layer, "post_feedforward_layernorm"):     # Gemma: x * (1 + w)
                layer.post_feedforward_layernorm.weight.fill_(spec.get("mlp_scale", 1.0) - 1.0)
            elif hasattr(layer.mlp, "down_proj"):
                layer.mlp.down_proj.weight.mul_(spec.get("mlp_scale", 1.0))
        model.get_input_embeddings().weight.mul_(spec.get("embed_scale", 1.0))
        if not model.config.tie_word_embeddings:
            model.get_output_embeddings().weight.mul_(8.0)


def _zero_sinks(model) -> None:
    import torch
    with torch.no_grad():
        for attn in _attention_modules(model):
            attn.sinks.zero_()


def _scale_as_head_128(model) -> None:
    for attn in _attention_modules(model):
        attn.scaling = 128 ** -0.5


EDITS = {"zero_sinks": _zero_sinks, "scale_as_head_128": _scale_as_head_128}


def make_family_model(name: str, out: Path, dtype: str = "float32", seed: int = SEED) -> Path:
    """Writes config.json, the tiny word-level tokenizer and seeded, sharpened safetensors
    weights of family `name` into `out`."""
    import torch
    import transformers

    from vllm_chunkattn.tiny_model import save_tokenizer

    spec = FAMILIES[name]
    out = save_tokenizer(out)
    torch.manual_seed(seed)
    config = getattr(transformers, spec["config_class"])(**spec["config"])
    model = getattr(transformers, spec["architecture"])(config).float()
    _sharpen(model, spec)
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update({"architectures": [spec["architecture"]], "torch_dtype": dtype})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _spec_text(name: str) -> str:
    return json.dumps({"name": name, "seed": SEED, **FAMILIES[name]}, sort_keys=True, indent=1)


def ensure_family_model(name: str) -> Path:
    """models/families/<name>, built once and rebuilt when FAMILIES[name] changes (the spec is
    stored beside the weights). Built in a temporary folder and renamed, so two pytest-xdist
    workers never see half a checkpoint."""
    import os
    import shutil

    out = MODELS_DIR / name
    stamp = "family_spec.json"
    if (out / "model.safetensors").exists() and (out / stamp).exists() \
            and (out / stamp).read_text() == _spec_text(name):
        return out
    tmp = MODELS_DIR / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    make_family_model(name, tmp)
    (tmp / stamp).write_text(_spec_text(name))
    shutil.rmtree(out, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:                     # another worker renamed its copy first: the same bytes
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_hf(name: str, perturb: str | None = None):
    """The family's HF model (eager attention, which honours windows, sinks and caps), with
    perturbation `perturb` of FAMILIES[name]["perturb"] applied."""
    import torch
    from transformers import AutoModelForCausalLM

    p = FAMILIES[name]["perturb"][perturb] if perturb else {}
    model = AutoModelForCausalLM.from_pretrained(
        ensure_family_model(name), attn_implementation="eager", dtype=torch.float32,
        **p.get("config", {}))
    if "edit" in p:
        EDITS[p["edit"]](model)
    return model.eval()


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens, each step a full forward pass (no KV cache: nothing but the mask decides
    which keys a query sees)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def token_prompts(seed: int, lengths) -> list[list[int]]:
    """Seeded random word ids (no <unk>, <s>, </s>), one prompt per length."""
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def vllm_job(name: str, groups: list[dict], backend: str | None = None) -> dict:
    """A tests/llm_job.py job serving family `name` in fp32 (stock vLLM's CPU backend when
    `backend` is None). A small token budget chunks the long prompts, so steps mix decode rows
    with chunked-prefill rows."""
    engine = dict(model=str(ensure_family_model(name)), dtype="float32", block_size=32,
                  max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=128 << 20,
                  seed=0, max_num_seqs=16, max_num_batched_tokens=256)
    if backend is not None:
        engine["attention_backend"] = backend
    return {"engine": engine, "groups": groups}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help=f"families (default all): {', '.join(FAMILIES)}")
    args = p.parse_args(argv)
    for name in args.names or FAMILIES:
        print(ensure_family_model(name))


if __name__ == "__main__":
    main()
