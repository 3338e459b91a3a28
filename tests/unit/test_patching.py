"""AttributePatches: the one reversible setattr the adapters use."""

import types

from megatron_ext.megatron.patching import AttributePatches


def test_restore_puts_back_values_and_removes_new_attributes_in_reverse_order():
    owner = types.SimpleNamespace(a=1)
    patches = AttributePatches()
    patches.set(owner, "a", 2)
    patches.set(owner, "b", 3)  # did not exist
    patches.set(owner, "a", 4)  # patched twice: restore must end at the first value
    assert (owner.a, owner.b) == (4, 3)
    assert patches.targets == [(owner, "a"), (owner, "b"), (owner, "a")]
    patches.restore()
    assert owner.a == 1 and not hasattr(owner, "b")
    assert patches.targets == []
    patches.restore()  # idempotent
    assert owner.a == 1
