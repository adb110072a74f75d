"""`Engine.put(check=True)`: each new block is computed twice and nothing is stored unless both agree in every bit."""

from __future__ import annotations

import pytest
import torch

from kvgraft.core.errors import ReproducibilityError
from kvgraft.store import LocalStore

from conftest import TEST_CHUNK, TEXT, EngineFactory


def test_check_stores_the_same_graft_as_a_plain_build(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    plain = engine.build(TEXT)
    checked = engine.put(TEXT, check=True)
    assert checked.id == plain.manifest.id
    assert store.ids() == [checked.id]


def test_check_also_covers_blocks_built_after_reused_ones(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    engine.put(TEXT[: 3 * TEST_CHUNK - 1])  # 3 blocks (with BOS) that the next build reuses
    put = engine.put(TEXT, check=True)
    assert put.reused_blocks == 3
    assert put.id == make_engine().build(TEXT).manifest.id


class _FlipOnSecondPass:
    """A forward hook on one layer that changes one bit of its output on the n-th call: a computation that is not
    reproducible, as a machine whose arithmetic misbehaves would make it."""

    def __init__(self, on_call: int) -> None:
        self.calls = 0
        self.on_call = on_call

    def __call__(self, module: torch.nn.Module, args: object, output: object) -> object:
        self.calls += 1
        if self.calls != self.on_call:
            return output
        hidden = output[0] if isinstance(output, tuple) else output
        assert isinstance(hidden, torch.Tensor)
        changed = hidden.clone()
        changed.view(torch.int32 if changed.element_size() == 4 else torch.int16).reshape(-1)[-1] ^= 1
        return (changed, *output[1:]) if isinstance(output, tuple) else changed


@pytest.mark.parametrize("spec", ["random:llama", "random:gemma4"])
def test_check_refuses_a_build_that_differs_and_stores_nothing(
    make_engine: EngineFactory, store: LocalStore, spec: str
) -> None:
    engine = make_engine(spec)
    chunks = (len(TEXT) + 1) // TEST_CHUNK
    layers = engine.model.model.layers  # type: ignore[union-attr]
    # The first pass runs `chunks` forwards; the fault hits the second pass's last chunk in layer 0.
    hook = layers[0].register_forward_hook(_FlipOnSecondPass(on_call=2 * chunks))
    try:
        with pytest.raises(ReproducibilityError) as raised:
            engine.put(TEXT, check=True)
    finally:
        hook.remove()
    assert str(raised.value).startswith(f"block {chunks - 1} (layers.001.")
    assert "differed between two computations of the same tokens; nothing was stored" in str(raised.value)
    assert store.ids() == []
    assert engine.put(TEXT, check=True).id == engine.build(TEXT).manifest.id  # the fault is gone: stored
