"""tests/opcheck.py, the operators' checks: they fail where an op is wrong as lowering runs it."""
import numpy as np
import pytest

from ops.activation import ElementUnary
from tests.opcheck import check_tiled, spec


class _ReadsWhatItSaysItDoesNot(ElementUnary):
    """gelu, whose backward reads x, declaring that it reads y alone: lowering gives it None for x."""

    def backward_reads(self):
        return (False,), (True,)


def test_check_tiled_gives_backward_none_for_what_the_op_says_it_does_not_read():
    """check_tiled passed every input to backward whatever the op declared, so a wrong declaration
    passed it and then failed in training (AttributeError: 'NoneType' object has no attribute ...)."""
    rng = np.random.default_rng(0)
    x, g = (rng.standard_normal((6, 4)).astype(np.float32) for _ in range(2))
    check_tiled(ElementUnary("act", [spec((6, 4))], fn="gelu"), [x], {}, [g])
    with pytest.raises((AttributeError, TypeError)):
        check_tiled(_ReadsWhatItSaysItDoesNot("act", [spec((6, 4))], fn="gelu"), [x], {}, [g])
