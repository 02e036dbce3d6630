"""Builds a tiny Llama checkpoint and byte-level BPE tokenizer on disk, with no hub access.

    python make_tiny_model.py OUT_DIR [--seed N] [--arch llama|qwen2] [--tied]

CPU attention in vLLM supports head sizes 32, 64, 80, ..., so: hidden 64, 2 heads
of 32, 2 layers. ``llama``: untied head, no biases, one KV head per query head.
``qwen2``: q/k/v biases and grouped-query attention (2 query heads share 1 KV head);
``--tied`` ties the output layer to the input embedding, as Qwen2.5 0.5B-3B,
Llama-3.2 1B/3B and Gemma do. Weights are random (seeded); the tokenizer is
trained on a few generated sentences.
"""

from __future__ import annotations

import argparse
import os

# Long enough for a streamed completion that outlasts a pause landing on a loaded
# machine (tests/vllm/test_vllm_e2e.py); rotary positions, so no more weights.
MAX_POSITIONS = 2048


def build(out: str, seed: int = 0, *, arch: str = "llama", tied: bool = False, hidden: int = 64,
          layers: int = 2, intermediate: int = 128, experts: int = 8) -> str:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    os.makedirs(out, exist_ok=True)
    words = ["weights", "sync", "engine", "trainer", "policy", "reward", "token", "model", "fast", "safe"]
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(200)]
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    common = dict(vocab_size=len(fast), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=hidden // 32, head_dim=32, max_position_embeddings=MAX_POSITIONS, bos_token_id=fast.bos_token_id,
                  eos_token_id=fast.eos_token_id, tie_word_embeddings=tied, torch_dtype="float32")
    if arch == "llama":
        config, model_class = LlamaConfig(num_key_value_heads=2, **common), LlamaForCausalLM
    elif arch == "qwen2":
        config, model_class = Qwen2Config(num_key_value_heads=1, **common), Qwen2ForCausalLM
    elif arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        config = Qwen3MoeConfig(num_key_value_heads=1, num_experts=experts, num_experts_per_tok=2,
                                moe_intermediate_size=intermediate // 2, decoder_sparse_step=1, norm_topk_prob=True,
                                **common)
        model_class = Qwen3MoeForCausalLM
    else:
        raise SystemExit(f"unknown arch {arch!r}: llama, qwen2 or qwen3_moe")
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():  # HF initialises biases to zero; a q/k/v bias mapped wrong must show
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3_moe"])
    ap.add_argument("--tied", action="store_true", help="tie the output layer to the input embedding")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (a multiple of 32: heads of 32)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8, help="qwen3_moe: routed experts per layer")
    args = ap.parse_args()
    print(build(args.out, args.seed, arch=args.arch, tied=args.tied, hidden=args.hidden, layers=args.layers,
                intermediate=args.intermediate, experts=args.experts))
