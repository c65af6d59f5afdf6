"""Make a tiny Llama with random weights for a real server to serve (no download).

    python scripts/tiny_model.py OUT            # 2 layers, full attention
    python scripts/tiny_model.py OUT --swa 128  # hybrid: layer 0 slides (window 128), layer 1 is full
    python scripts/tiny_model.py OUT --conv     # hybrid LFM2: layer 0 a short convolution, layer 1 full
    python scripts/tiny_model.py OUT --gdn      # hybrid Qwen3-Next: layer 0 gated delta net, layer 1 full

Serve it with token ids in (``--skip-tokenizer-init``); on CPU add ``--device cpu
--model-impl transformers``. The hybrid model opts in to sglang's hybrid
sliding-window memory (``is_hybrid_swa`` with a ``hybrid_layer_pattern``), so the
server builds its SWA allocator: the seed bug's pool family. The LFM2 model keeps a
convolution state per request in sglang's hybrid request pool (the mamba family); sglang
serves it with its own model code, on CPU under ``kvreplay record --cpu-compat`` with
``--page-size 1 --disable-overlap-schedule`` (docs/mamba.md). The Qwen3-Next model is
one sglang gives the extra buffer (a tracking pair per request), on a GPU only
(scripts/gpu-check.sh, step ``mamba``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def make(out: Path, swa_window: int = 0, vocab: int = 2048, conv: bool = False, gdn: bool = False) -> Path:
    import torch

    if gdn:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                              layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                              linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=128, shared_expert_intermediate_size=128, decoder_sparse_step=1,
                              mlp_only_layers=[], torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        Qwen3NextForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
        path = out / "config.json"  # sglang reads the layer pattern by its older name
        config = json.loads(path.read_text())
        config.update(full_attention_interval=2)
        path.write_text(json.dumps(config, indent=1))
        return out

    if conv:
        from transformers import Lfm2Config, Lfm2ForCausalLM

        cfg = Lfm2Config(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         layer_types=["conv", "full_attention"], conv_L_cache=3, block_auto_adjust_ff_dim=False,
                         torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(0)
        Lfm2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
        path = out / "config.json"  # vLLM reads the widths by the names of LFM2's own checkpoints
        config = json.loads(path.read_text())
        config.update(conv_dim=cfg.hidden_size, block_dim=cfg.hidden_size)
        path.write_text(json.dumps(config, indent=1))
        return out
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
    ap.add_argument("--conv", action="store_true", help="hybrid LFM2 (a convolution state per request)")
    ap.add_argument("--gdn", action="store_true", help="hybrid Qwen3-Next (a gated-delta-net state per request)")
    a = ap.parse_args()
    if (a.conv + a.gdn + bool(a.swa)) > 1:
        raise SystemExit("tiny_model.py: --swa, --conv and --gdn make different models; give one")
    try:
        print(make(a.out, a.swa, a.vocab, a.conv, a.gdn))
    except ModuleNotFoundError as exc:  # the server's venv has them; a bare one may not
        raise SystemExit(f"tiny_model.py: needs {exc.name} (pip install torch transformers, or run it with the "
                         "Python of the server's venv)") from None
    except OSError as exc:
        raise SystemExit(f"tiny_model.py: cannot write {a.out}: {exc.strerror or exc}") from None
