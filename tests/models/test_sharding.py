"""Sharded forward equals unsharded, on 8 forced host CPU devices in a subprocess."""

import subprocess
import sys
from pathlib import Path

import pytest

from distill.models import sharding


def test_sharded_logits_equal_unsharded_on_eight_host_devices():
    script = Path(__file__).with_name("sharded_forward_check.py")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "block_diffusion: sharded logits equal unsharded" in result.stdout


def test_logical_axis_rules_map_names_to_mesh_axes():
    spec = sharding.logical_to_spec(("batch", "length", "vocab"))
    assert tuple(spec) == ("data", None, "model")
    with pytest.raises(ValueError, match="`logical_axes`"):
        sharding.logical_to_spec(("batch", "nonsense"))


def test_mesh_larger_than_the_devices_is_refused():
    with pytest.raises(ValueError, match="`mesh`"):
        sharding.make_mesh(data=1024, model=1)
