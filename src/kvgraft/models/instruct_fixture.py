"""A random instruct model written as a local Hugging Face directory, built offline in seconds.

It stands in for a real instruct checkpoint wherever one is needed with no download (tests, `kvgraft replicate`
on a machine without models): a tiny Llama with fixed-seed random weights, a byte-level BPE tokenizer trained in
memory on a small corpus (subword merges, so a token is often several characters and token boundaries move
when texts are joined), and a ChatML-style chat template with system, user and assistant roles. The directory
loads like any checkpoint: `kvgraft.models.loading.load_model(str(path))`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast

from kvgraft.models.random_models import MAX_POSITIONS, build_random_model

PAD, BOS, EOS, TURN_START = "<pad>", "<bos>", "<|im_end|>", "<|im_start|>"
INSTRUCT_SPECIAL_TOKENS = (PAD, BOS, EOS, TURN_START)
"""ids 0-3; `<|im_end|>` ends a turn and is the EOS, as in Qwen's instruct models"""
INSTRUCT_VOCAB_SIZE = 384
INSTRUCT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, opened with the BOS token as Llama's and Gemma's templates are (the tokenizer adds a BOS as well)"""

_CORPUS = (
    "Ada has 12 cards. Gets 7. Loses 3. How many cards now?",
    "Ben has 40 coins. Finds 3 bags of 5. Sells 9. How many coins now?",
    "3*5=15, 40+15=55, 55-9=46. Answer:46",
    "Put your final answer within \\boxed{}. The answer is \\boxed{\\frac{1}{2}}.",
    "You are a careful mathematician. Reason step by step, then state the final answer.",
    "system user assistant Let x be a real number such that x^2 = 4. Find the sum of all such x.",
    "Grafts keep the state of a model after it has read a text, so that the text need not be read again.",
)


def build_instruct_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a small built-in corpus (deterministic: same corpus, same merges).

    Every text round-trips (the 256 byte symbols are in the alphabet); encoding a text prepends `<bos>`.

    Returns:
        The tokenizer, with the chat template set.
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=INSTRUCT_VOCAB_SIZE,
        special_tokens=list(INSTRUCT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[TURN_START],
    )
    tokenizer.chat_template = INSTRUCT_CHAT_TEMPLATE
    return tokenizer


def instruct_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """A tiny Llama sized to the tokenizer's vocabulary (2 layers, 128 wide: a prefill of 1K tokens takes ms)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_random_instruct_model(
    seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The random instruct model in memory (what `save_random_instruct_model` writes).

    Args:
        seed: the weights' seed.
        dtype: the weights' dtype (drawn in float32, then cast).

    Returns:
        (model in eval mode, tokenizer with its chat template).
    """
    tokenizer = build_instruct_tokenizer()
    return build_random_model(instruct_config(tokenizer), seed, dtype), tokenizer


def save_random_instruct_model(path: str | Path, seed: int = 0) -> Path:
    """Write a random instruct model (weights, config, tokenizer, chat template) as a Hugging Face directory.

    Args:
        path: the directory (created; files in it are overwritten).
        seed: the weights' seed (the same seed writes the same weights).

    Returns:
        The directory.
    """
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    model, tokenizer = build_random_instruct_model(seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
