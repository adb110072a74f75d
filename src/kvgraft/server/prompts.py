"""Chat messages to one prompt text, and generated tokens to text that can be streamed safely.

A tokenizer with a chat template renders the messages itself. Without one (the random and demo models' byte
tokenizer), the plain fallback writes each message as a `role: content` line and ends with `assistant:`, the
line the model is asked to continue.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

FALLBACK_ASSISTANT_PREFIX = "assistant:"


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    """The prompt text of a conversation.

    Args:
        tokenizer: the model's tokenizer (its chat template, if it has one).
        messages: the conversation, each {"role", "content"}.

    Returns:
        The text the model continues with the assistant's reply (without a leading BOS when encoding adds one).
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + FALLBACK_ASSISTANT_PREFIX
    text = str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    bos = tokenizer.bos_token
    # Templates usually write BOS as text, and encoding the prompt as a context adds it again: keep one.
    if isinstance(bos, str) and bos and text.startswith(bos) and _adds_bos(tokenizer):
        text = text[len(bos) :]
    return text


def _adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    ids = list(tokenizer("", add_special_tokens=True)["input_ids"])
    return bool(ids) and ids[0] == tokenizer.bos_token_id


class TextStream:
    """Turns tokens, as they are generated, into text deltas whose concatenation is the final text.

    A delta is only sent once it can no longer change: bytes of an unfinished UTF-8 character decode to U+FFFD
    until the character is complete, and the last (longest stop - 1) characters could still begin a stop string,
    which the final text cuts off. `finish` sends the rest of the final text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(s for s in stops if s)
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._tokens: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        """Take the next generated token.

        Args:
            token: its id.

        Returns:
            The text that became safe to send, possibly "".
        """
        self._tokens.append(token)
        text = str(self._tokenizer.decode(self._tokens, skip_special_tokens=True)).rstrip("\ufffd")
        cuts = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        safe = text[: min(cuts)] if cuts else text[: max(0, len(text) - self._holdback)]
        return self._advance(safe)

    def finish(self, final_text: str) -> str:
        """End the stream.

        Args:
            final_text: the generation's final text (stop string cut off).

        Returns:
            What of it was not sent yet.
        """
        return self._advance(final_text)

    def _advance(self, safe: str) -> str:
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta = safe[len(self.sent) :]
        self.sent = safe
        return delta
