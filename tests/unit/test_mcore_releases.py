"""The supported megatron-core releases: one code path per release line, others refused."""

import pytest

from megatron_ext.config import ConfigError
from megatron_ext.megatron import mcore
from megatron_ext.megatron.version import mcore_version, parse_version, public_version


@pytest.mark.parametrize("version", ["0.17.1", "0.18.2", "0.20.0", "0.15.3"])
def test_unsupported_releases_are_refused_naming_both(version):
    with pytest.raises(ConfigError) as info:
        mcore.release(version)
    message = str(info.value)
    assert message.startswith("megatron-core:")
    assert version in message and "0.16.x, 0.19.x" in message


@pytest.mark.parametrize(
    "version,module",
    [("0.16.1", "core_v0_16"), ("0.19.0", "core_v0_19"), ("0.19.2+652790b", "core_v0_19")],
)
def test_supported_releases_map_to_their_module(version, module):
    release = mcore.release(version)
    assert release.__name__.endswith(module)
    # Every release module offers the same names.
    assert callable(release.start_grad_sync) and callable(release.bucket_grad)


def test_installed_release_is_supported():
    assert parse_version(mcore_version())[:2] in mcore.SUPPORTED
    assert public_version("0.19.2+652790b") == "0.19.2"
