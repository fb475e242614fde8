"""A one-layer EAGLE draft head for the tiny model (test-only): the model's own layer 0 weights
without its input norm, and an `fc` that passes the target's hidden state on with seeded noise.
vLLM loads it as EagleLlamaForCausalLM, sharing the target's embedding and lm_head."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from vllm_runs import tiny_model

DRAFT_DIR = Path(__file__).resolve().parents[2] / ".cache" / "tiny-eagle-draft"


def eagle_draft() -> Path:
    from safetensors.torch import load_file, save_file
    if (DRAFT_DIR / "model.safetensors").exists():
        return DRAFT_DIR
    src = tiny_model()
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = 1
    hidden = config["hidden_size"]
    weights = {name.removeprefix("model."): w for name, w in
               load_file(src / "model.safetensors").items()
               if name.startswith("model.layers.0.") and "input_layernorm" not in name}
    fc = torch.zeros(hidden, 2 * hidden)
    fc[:, hidden:] = torch.eye(hidden)
    fc += 0.02 * torch.randn(hidden, 2 * hidden, generator=torch.Generator().manual_seed(7))
    weights["fc.weight"] = fc
    tmp = DRAFT_DIR.with_name(DRAFT_DIR.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, tmp / name)
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors")
    shutil.rmtree(DRAFT_DIR, ignore_errors=True)
    tmp.rename(DRAFT_DIR)
    return DRAFT_DIR
