"""Builds a tiny Llama model with random weights and a locally trained tokenizer.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a few
sentences, the weights are random (seeded, float32), and the chat template is
written here. Head size 64, because vLLM's CPU attention kernels reject 16.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "An inference platform serves language models behind an OpenAI compatible API.",
    "Ray Serve scales replicas up and down with the number of ongoing requests.",
    "vLLM keeps the key value cache in paged blocks and batches requests continuously.",
    "Hello world! How are you today? I am fine, thank you.",
    "Kubernetes schedules pods onto nodes; GPUs are requested as extended resources.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 2048 4096",
]

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


def build_tokenizer(out_dir: Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_llama(out_dir: str | Path, *, seed: int = 1234) -> Path:
    """Writes config, safetensors weights and tokenizer files to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    (out / "tiny_model.json").write_text(json.dumps({"vocab_size": vocab, "seed": seed}))
    return out


if __name__ == "__main__":
    import sys

    print(build_tiny_llama(sys.argv[1]))
