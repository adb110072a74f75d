"""How a run samples its next tokens: the parameters every decode and every receipt carries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; otherwise softmax sampling with a torch.Generator seeded with `seed`."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    """token ids that end decoding besides the tokenizer's EOS (a chat model's end of turn); the token is kept in
    the output tokens, and the text skips it like any special token"""

    def to_json(self) -> dict[str, Any]:
        """Returns: the parameters as receipts hold them (`stop_token_ids` only when there are any, so that a
        receipt written before they existed keeps its id)."""
        data: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop),
        }
        if self.stop_token_ids:
            data["stop_token_ids"] = list(self.stop_token_ids)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SamplingParams:
        return cls(
            max_new_tokens=int(data["max_new_tokens"]),
            temperature=float(data["temperature"]),
            top_p=float(data["top_p"]),
            seed=int(data["seed"]),
            stop=tuple(str(s) for s in data["stop"]),
            stop_token_ids=tuple(int(t) for t in data.get("stop_token_ids", ())),
        )
