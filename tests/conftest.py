import os

import pytest
import torch

from tpfuse import knobs

# Triton kernels run under the interpreter when there is no GPU. It must be set before any
# @triton.jit function is defined, so it lives here, ahead of every test import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip without a CUDA GPU and `multigpu` tests with fewer than two, before any of
    their fixtures runs."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needs = {"gpu": 1, "multigpu": 2}
    for item in items:
        for marker, count in needs.items():
            if item.get_closest_marker(marker) is not None and gpus < count:
                item.add_marker(
                    pytest.mark.skip(reason=f"`{marker}` test: needs {count} CUDA GPU(s), found {gpus}")
                )
                break


@pytest.fixture(autouse=True)
def _knobs_follow_the_environment():
    """A test that sets a TPFUSE_* variable calls knobs.reload(); after it (and monkeypatch's undo)
    the knobs are read again, so none leaks into the next test."""
    yield
    knobs.reload()
