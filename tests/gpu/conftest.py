"""GPU tests run only where torch sees at least two CUDA devices and libodc has the CUDA transport;
elsewhere every test here is reported as skipped, with the reason."""

import pytest

import odc


def _gpu_skip_reason():
    if not odc.has_cuda():
        return "libodc was built without CUDA"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.cuda.device_count() < 2:
        return f"needs 2 or more CUDA devices, found {torch.cuda.device_count()}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))
