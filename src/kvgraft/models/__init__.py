"""Models kvgraft can run without a download: random architectures for tests, the bundled demo model, and the
loader that also opens any local Hugging Face causal LM."""
