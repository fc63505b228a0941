"""The compiled CEM attention kernel's tuning options, from ``CEMLAB_FLEX_KERNEL_OPTIONS``."""

import pytest

from workloads.models import flex


def test_kernel_options_come_from_the_environment_as_a_json_object(monkeypatch):
    monkeypatch.delenv("CEMLAB_FLEX_KERNEL_OPTIONS", raising=False)
    assert flex._kernel_options_from_env() == {}
    monkeypatch.setenv("CEMLAB_FLEX_KERNEL_OPTIONS", '{"fwd_BLOCK_N": 64, "WRITE_DQ": false}')
    assert flex._kernel_options_from_env() == {"fwd_BLOCK_N": 64, "WRITE_DQ": False}
    for bad in ("[64]", "BLOCK_N=64"):
        monkeypatch.setenv("CEMLAB_FLEX_KERNEL_OPTIONS", bad)
        with pytest.raises(ValueError, match="^CEMLAB_FLEX_KERNEL_OPTIONS: expected a JSON"):
            flex._kernel_options_from_env()
