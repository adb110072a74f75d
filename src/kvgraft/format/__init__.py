"""The open file formats: graft manifests, block and tensors files, manifest metadata, receipts. Checkable with
safetensors and hashlib alone (docs/FORMAT.md is the spec)."""
