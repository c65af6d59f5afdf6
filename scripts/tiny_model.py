"""Make a tiny Llama with random weights for a real server to serve (no download).

    python scripts/tiny_model.py OUT            # 2 layers, full attention
    python scripts/tiny_model.py OUT --swa 128  # hybrid: layer 0 slides (window 128), layer 1 is full

Serve it with token ids in (``--skip-tokenizer-init``); on CPU add ``--device cpu
--model-impl transformers``. The hybrid model opts in to sglang's hybrid
sliding-window memory (``is_hybrid_swa`` with a ``hybrid_layer_pattern``), so the
server builds its SWA allocator: the seed bug's pool family."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def make(out: Path, swa_window: int = 0, vocab: int = 2048) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    if swa_window:
        path = out / "config.json"
        config = json.loads(path.read_text())
        config.update(is_hybrid_swa=True, hybrid_layer_pattern=[1, 0], sliding_window=swa_window,
                      layer_types=["sliding_attention", "full_attention"])
        path.write_text(json.dumps(config, indent=1))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--swa", type=int, default=0, metavar="WINDOW", help="hybrid sliding-window model")
    ap.add_argument("--vocab", type=int, default=2048)
    a = ap.parse_args()
    try:
        print(make(a.out, a.swa, a.vocab))
    except ModuleNotFoundError as exc:  # the server's venv has them; a bare one may not
        raise SystemExit(f"tiny_model.py: needs {exc.name} (pip install torch transformers, or run it with the "
                         "Python of the server's venv)") from None
    except OSError as exc:
        raise SystemExit(f"tiny_model.py: cannot write {a.out}: {exc.strerror or exc}") from None
