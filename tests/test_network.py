"""fsdplab.network: the ratio lesson 07 quotes instead of "one to two orders of magnitude"."""

import pytest

from fsdplab import network


def test_speed_ratio_comes_from_the_presets():
    assert network.speed_ratio("A100", "400 Gb/s") == pytest.approx(300 / 50)
    assert network.speed_ratio("A100", "25 GbE") == pytest.approx(300 / 3.125)
    assert network.speed_ratio(network.Link("x", 10.0), network.Link("y", 2.5)) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="unknown link"):
        network.speed_ratio("A100", "carrier pigeon")
