"""benchmarks/speed_curve.py's cliff rule and tail ratio, on curves with known answers."""

import math

from benchmarks.speed_curve import cliffs, tail_ratio


def test_a_power_law_has_no_cliff_and_its_exponent():
    ns = [2**k for k in range(1, 12)]
    k, bad = cliffs(ns, [0.01 * n**0.5 for n in ns])
    assert math.isclose(k, 0.5, rel_tol=1e-9) and bad == []


def test_a_point_three_times_above_the_curve_is_named():
    ns = [2**k for k in range(1, 12)]
    walls = [0.01 * n for n in ns]
    walls[7] *= 3.0  # N = 256
    assert cliffs(ns, walls)[1] == [256]


def test_points_below_16_gpus_are_not_fitted_or_named():
    ns = [2, 4, 8, 16, 32, 64]
    walls = [50.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # a slow start-up at 2 GPUs: not a cliff
    k, bad = cliffs(ns, walls)
    assert bad == [] and math.isclose(k, 0.0, abs_tol=1e-12)


def test_tail_ratio_per_doubling():
    assert tail_ratio([1024, 2048], [3.0, 6.0]) == 2.0  # linear
    assert math.isclose(tail_ratio([1024, 4096], [1.0, 4.0]), 2.0)  # linear over two doublings
    assert math.isclose(tail_ratio([8, 16], [1.0, 1.0]), 1.0)  # flat
    assert math.isnan(tail_ratio([8], [1.0]))
