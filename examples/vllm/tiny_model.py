"""Writes a tiny model folder that `vllm serve` loads: a config.json (Llama, or DeepSeek-V2
with MLA), random weights drawn here with a fixed seed (model.safetensors) and a word-level
tokenizer built here, so that nothing comes from a model hub. Tokens are "w0" ...
"w{vocab-1}"; text in and out maps one word per token.

Why not --load-format dummy: vLLM's dummy weights are uniform in (-1e-3, 1e-3), so attention
contributes next to nothing and the next token depends on the last token alone (checked: every
prompt ending in w9 continued "w413 w277 w413 ..."): a decode that read garbage KV would still
answer like the aggregated server. Weights scaled as a trained model's (unit embeddings,
1/sqrt(fan_in) matrices, unit norms) make every answer depend on the whole prompt's KV.

    python tiny_model.py OUT_DIR [--arch llama|deepseek_v2]
"""
import argparse
import json
import os

VOCAB = 512
BOS, EOS = 1, 2


def llama_config() -> dict:
    # vLLM's CPU attention kernels are built for head sizes 32, 64, 80, ... (not 16).
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": BOS, "eos_token_id": EOS, "torch_dtype": "float32",
    }


def deepseek_v2_config() -> dict:
    # MLA: one latent entry per token (kv_lora_rank + qk_rope_head_dim values), no MoE layer
    # (first_k_dense_replace covers both layers) so that only attention is DeepSeek-shaped.
    # vLLM's CPU MLA decode kernel is built for DeepSeek's latent size only (512 + 64 = 576).
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 2, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "bos_token_id": BOS, "eos_token_id": EOS, "torch_dtype": "float32",
    }


def write_tokenizer(out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab["<unk>"], vocab["<s>"], vocab["</s>"] = 0, BOS, EOS
    vocab = {k: v for k, v in vocab.items() if k not in ("w0", "w1", "w2")}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
                   "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 2048,
                   "add_bos_token": False, "clean_up_tokenization_spaces": False}, f)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}, f)


def write_weights(out: str, seed: int = 0) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out),
                                             dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0) if "norm" in name else p.zero_()
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained rewrites config.json; keep the one written here (vLLM reads it).


def write_model(out: str, arch: str = "llama") -> str:
    os.makedirs(out, exist_ok=True)
    config = {"llama": llama_config, "deepseek_v2": deepseek_v2_config}[arch]()
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    write_weights(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS, "eos_token_id": EOS}, f)
    write_tokenizer(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--arch", choices=("llama", "deepseek_v2"), default="llama")
    args = ap.parse_args()
    print(write_model(args.out, args.arch))


if __name__ == "__main__":
    main()
