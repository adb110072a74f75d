"""A byte-level tokenizer built in memory: one token per byte plus <pad>, <eos>, <bos>.

Used by the random:<arch> models so that tests and benchmarks run with no download. Any text round-trips.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Token ids: 0 <pad>, 1 <eos>, 2 <bos>, then 3 + byte value. Encoding a text prepends <bos>."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=_byte_of_char)
    vocab = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(byte_chars)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def _byte_of_char(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's printable remapping of 0-255)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = 256 + extra
            extra += 1
    inverse = {code: b for b, code in mapping.items()}
    return inverse[ord(ch)]
