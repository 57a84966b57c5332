"""The host-side arithmetic of a Triton launch (runtime/triton_launch.py): plain-Python stand-ins for Triton's
constexpr cdiv and next_power_of_2, which must agree with Triton's everywhere a launch can use them."""

import triton

from attnforge.runtime.triton_launch import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_agree_with_triton():
    for n in [*range(0, 1100), 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64, 128):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
