"""A tiny random-weight Llama for real vLLM on CPU, made without a model hub.

Run inside the vLLM virtualenv (it has torch, transformers, tokenizers and peft), by
`real_vllm.py build`: `python tiny_llama.py MODEL_DIR LORA_DIR`.

- the model: Llama, hidden 256, 2 layers, 4 attention heads / 2 KV heads, vocab 4,096,
  weights drawn from a fixed seed, saved in bfloat16 with safetensors (about 9 MB);
- its tokenizer: byte-level BPE trained here with `tokenizers` on the help texts that ship
  with Python (`pydoc_data.topics`), with Llama-3's special tokens and chat template
  (`chat_template.jinja`), so that vLLM's chat API takes it as it takes a real Llama-3;
- a LoRA adapter for it (peft, r=8 on q_proj and v_proj), initialised non-zero so that
  it changes the output.

Output is gibberish: tests check protocol, not prose. The same Python and packages give
the same files, byte for byte.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SEED = 20
VOCAB = 4096
HIDDEN = 256
BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
# Llama-3's special tokens, with the ids they have there relative to each other.
SPECIAL = [
    BOS,
    EOS,
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    EOT,
    "<|python_tag|>",
]
# Llama-3's template, without its tool and date preamble.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = message['content'] | map(attribute='text') | join('') %}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}\n"
)


def training_text() -> list[str]:
    """English that ships with every Python: the help topics pydoc shows."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def make_tokenizer(out: Path) -> dict[str, int]:
    """Train, save and return the special tokens' ids."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, ids[BOS])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=EOS,
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return ids


def make_model(out: Path, ids: dict[str, int]) -> object:
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOS], ids[EOT]],
        pad_token_id=ids[EOS],
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[EOT]], pad_token_id=ids[EOS]
    )
    model.save_pretrained(str(out), safe_serialization=True)
    return model


def make_lora(model: object, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED + 1)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        # peft's default zeroes B (the adapter changes nothing at first): random instead.
        init_lora_weights=False,
    )
    get_peft_model(model, config).save_pretrained(str(out), safe_serialization=True)


def main(model_dir: Path, lora_dir: Path) -> None:
    model_dir.mkdir(parents=True)
    ids = make_tokenizer(model_dir)
    model = make_model(model_dir, ids)
    make_lora(model, lora_dir)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: tiny_llama.py MODEL_DIR LORA_DIR")
    if os.environ.get("PYTHONHASHSEED") != "0":
        # peft writes target_modules from a set: its order follows the string hash seed.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
