"""The contract every other layer builds on: errors, hashes and ids, the fingerprint, the chunk schedule, cache
state, sampling and decoding, and the reproducibility settings. Imports nothing else from kvgraft."""
