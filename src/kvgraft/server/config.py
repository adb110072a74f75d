"""What a server is started with: auth, limits and where receipts go."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvgraft.core.errors import BadInputError

API_KEY_ENV = "KVGRAFT_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    """A server's settings; `check` refuses inconsistent ones."""

    api_key: str | None = None
    """Bearer token that library writes need; with no key, library writes are refused."""
    protect_reads: bool = False
    """Require the same token on every /v1 endpoint, not only on writes."""
    max_queue: int = 16
    """Requests waiting for the model beyond the one it is running; more are answered 429."""
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 512
    """The largest max_tokens a request may ask for."""
    default_completion_tokens: int = 16
    """max_tokens of /v1/completions when the request gives none (OpenAI's default); chat defaults to the limit."""
    receipts_dir: Path | None = None
    """A directory to persist receipts in; None keeps them in the store (`receipts/<id>.json`), shared by replicas."""
    receipts_in_memory: int = 1000
    retrieval_candidates: int = 3
    library_refresh_s: float = 5.0
    """How stale the retrieval index of a non-local store may be (a local store's changes show at once)."""
    hidden_paths: tuple[str, ...] = ()
    """Paths of the server's own (the trusted keys' directory) that messages to clients show as `<hidden>`."""

    def check(self) -> None:
        """Refuse settings the server cannot run with.

        Raises:
            BadInputError: an empty API key, protected reads without a key, a limit below 1, or a default
                completion length outside 1..max_tokens_limit.
        """
        if self.api_key is not None and not self.api_key.strip():
            raise BadInputError("the API key is empty; give a non-empty --api-key or unset it")
        if self.protect_reads and not self.api_key:
            raise BadInputError(f"protecting reads needs an API key (--api-key or ${API_KEY_ENV})")
        for name in ("max_queue", "max_body_bytes", "max_tokens_limit", "receipts_in_memory", "retrieval_candidates"):
            if getattr(self, name) < 1:
                raise BadInputError(f"{name} must be at least 1")
        if not 1 <= self.default_completion_tokens <= self.max_tokens_limit:
            raise BadInputError("default_completion_tokens must be between 1 and max_tokens_limit")
