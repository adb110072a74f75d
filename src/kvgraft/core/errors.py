"""One error hierarchy for kvgraft.

The core raises these; only the CLI and the server turn them into a message and an exit code or a status.
Every message is one line that says what went wrong. Core messages never name a CLI flag or an HTTP field: the CLI
and the server add their own hint (`hint_for` in each), since the same error has a different remedy in each.
"""


class KvgraftError(Exception):
    """Base of every error kvgraft raises on purpose."""


class BadInputError(KvgraftError):
    """The caller asked for something that cannot be done (empty text, too long, bad option)."""


class NotAChainError(BadInputError):
    """Several grafts were asked for as one exact context, but they do not form one chain."""


class NotFoundError(KvgraftError):
    """A graft id (or prefix) matches nothing in the store, or more than one graft."""


class UntrustedGraftError(NotFoundError):
    """Under a trust policy, a graft no trusted key has signed: it is stored, but not there for use."""


class FormatError(KvgraftError):
    """A manifest or tensors file is malformed, truncated or of an unknown format version."""


class IntegrityError(KvgraftError):
    """Stored bytes do not match the hashes recorded for them."""


class FingerprintMismatchError(KvgraftError):
    """A graft was made by another model, tokenizer, dtype or chunk schedule than the one in use."""


class EnvironmentMismatchError(KvgraftError):
    """Only the numeric environment differs (threads, CPU, library versions): exactness is not guaranteed."""


class ReproducibilityError(KvgraftError):
    """Two computations of the same tokens in this run gave different bits (`check` builds, store verification)."""


class StoreError(KvgraftError):
    """The store cannot be read or written (missing permissions, not a directory)."""


class MissingBlockError(StoreError):
    """A put names a block the writer reused from the store, and the store no longer has it (a concurrent removal):
    the writer computes the block again and retries."""
