"""Graft stores: one small interface (`GraftStore`), a local directory backend first."""

from kvgraft.store.base import GraftStore, StoredGraft
from kvgraft.store.local import LocalStore, default_store_path, open_store

__all__ = ["GraftStore", "LocalStore", "StoredGraft", "default_store_path", "open_store"]
