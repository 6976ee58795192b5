"""Which vLLM releases kvoffload.vllm loads in, and how a release's
differences are applied (kvoffload._vllm_releases), without vLLM: the
checks against each real release are in test_vllm.py."""

import pytest

from kvoffload import _vllm_releases as r


@pytest.mark.parametrize("version", ["0.26.0", "0.27.1", "0.30.0", "0.33.0", "0.34.0", "0.34.1rc2", "0.33.0.dev12+gabc"])
def test_the_supported_releases_load(version):
    assert r.check_version(version, env={}) is True


@pytest.mark.parametrize("version", ["0.25.2", "0.35.0", "1.0.0", "0.9.2", "dev", ""])
def test_other_releases_are_refused_naming_the_installed_version(version):
    with pytest.raises(r.UnsupportedRelease) as e:
        r.check_version(version, env={})
    msg = str(e.value)
    assert f"vLLM {version} is installed" in msg and "supports vLLM 0.26 to 0.34" in msg, msg
    assert r.ANY_VERSION_ENV in msg, "says how to try anyway"
    assert isinstance(e.value, ImportError), "an import of kvoffload.vllm fails with it"


def test_the_override_loads_an_unsupported_release_as_unsupported():
    assert r.check_version("0.35.0", env={r.ANY_VERSION_ENV: "1"}) is False
    with pytest.raises(r.UnsupportedRelease):
        r.check_version("0.35.0", env={r.ANY_VERSION_ENV: "yes"})


def test_parse():
    assert r.parse("0.34.0") == (0, 34) and r.parse("v1.2.3") == (1, 2)
    with pytest.raises(ValueError):
        r.parse("nightly")


class _Manager:
    def __init__(self, **kw):
        self.kw = kw


def _release(size, args):
    return r.Release(
        version="0.x",
        manager_size_arg=size,
        manager_args=frozenset(args),
        offloading_info=None,
        expedited_loads=False,
        device_pointers=False,
        failed_results=False,
    )


def test_the_manager_gets_the_size_under_the_releases_name_and_only_its_keywords():
    old = _release("num_blocks", ["cache_policy", "enable_events"])
    m = old.manager(_Manager, 7, cache_policy="arc", enable_events=True, info=None, cache_policy_module_path=None)
    assert m.kw == {"num_blocks": 7, "cache_policy": "arc", "enable_events": True}
    new = _release("num_chunks", ["cache_policy", "info"])
    assert new.manager(_Manager, 3, cache_policy="lru", info="i").kw == {"num_chunks": 3, "cache_policy": "lru", "info": "i"}


def test_a_setting_the_release_cannot_take_is_an_error_naming_the_key():
    old = _release("num_blocks", ["cache_policy"])
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\['cache_policy_module_path'\].*vLLM 0.x"):
        old.manager(_Manager, 7, cache_policy_module_path="my.policy")
