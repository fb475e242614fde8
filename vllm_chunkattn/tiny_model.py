"""The embedded default model: a tiny Llama-shaped checkpoint made locally, seeded, no download.

Attention shapes are realistic (head_dim 128, 8 query heads / 2 KV heads: GQA 4) so kernels see
what a real model gives them; everything else is small so CPU serving is fast. Weights are real
random tensors (not vLLM's near-flat dummy weights), so greedy decoding has clear winners and
token-identical comparisons between backends mean something.

    python -m vllm_chunkattn.tiny_model --out models/tiny-llama
    python -m vllm_chunkattn.tiny_model --out models/tiny-llama-bf16 --dtype bfloat16   # GPU check

The default is fp32 (bit-exact comparisons on CPU). --dtype bfloat16/float16 saves the same seeded
weights rounded to that dtype, for token-identity checks where the GPU kernels run (bf16/fp16).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# A word-level vocabulary: whitespace-split words round-trip exactly through encode/decode,
# which vLLM's benchmark datasets rely on (they decode random ids and re-encode the text).
_WORDS = """a about after all also an and answer any are as ask assistant at be because been
before being best between both but by can code could data day do does each even every example
fact few find first for from function give good great had has have he help helpful her here
him his how i if in information into is it its just know language large last let like list
long look make many may me model more most much must my need new no not now number of on one
only or other our out over own part people please prompt question questions read request right
said same say see she should show so some step such system take tell than that the their them
then there these they thing think this those through time to tool two under up us use user
very want was way we well were what when where which while who why will with word work would
write year yes you your""".split()
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
VOCAB_SIZE = 2048
SPECIAL = ["<unk>", "<s>", "</s>"]

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "vocab_size": VOCAB_SIZE, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def vocabulary() -> list[str]:
    words = list(SPECIAL) + _WORDS
    for a in _SYLLABLES:
        for b in _SYLLABLES:
            if len(words) == VOCAB_SIZE:
                return words
            words.append(a + b)
    return words


def save_tokenizer(out: str | Path) -> Path:
    """Writes the word-level tokenizer (ids 0..VOCAB_SIZE-1, <s> = 1, </s> = 2) into `out`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out)
    return out


DTYPES = ("float32", "bfloat16", "float16")


def make_tiny_model(out: str | Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Writes config.json, tokenizer files and seeded safetensors weights into `out`. The weights
    are drawn in fp32 whatever `dtype` is, then rounded to it: every dtype holds the same model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose from {DTYPES}")
    out = save_tokenizer(out)
    torch.manual_seed(seed)
    config = LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"})
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        # Larger output weights than the init's 0.02 make next-token distributions peaked, so
        # greedy choices are far from ties and sampled text is not uniform noise.
        model.lm_head.weight.mul_(8.0)
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update({"architectures": CONFIG["architectures"], "torch_dtype": dtype})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def ensure_tiny_model(out: str | Path = "models/tiny-llama") -> Path:
    """Make the model once; later calls reuse the directory."""
    out = Path(out)
    if not (out / "model.safetensors").exists():
        make_tiny_model(out)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="models/tiny-llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="weights and config dtype (default float32)")
    args = p.parse_args(argv)
    print(make_tiny_model(args.out, args.seed, args.dtype))


if __name__ == "__main__":
    main()
