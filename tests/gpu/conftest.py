"""GPU tests run only where torch sees at least two CUDA devices (one for tests marked one_gpu) and
libodc has the CUDA transport; elsewhere every test here is reported as skipped, with the reason."""

import pytest

import odc


def _gpu_skip_reason(devices_needed: int):
    if not odc.has_cuda():
        return "libodc was built without CUDA"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.cuda.device_count() < devices_needed:
        return f"needs {devices_needed} or more CUDA devices, found {torch.cuda.device_count()}"
    return None


def pytest_collection_modifyitems(config, items):
    reasons = {needed: _gpu_skip_reason(needed) for needed in (1, 2)}
    for item in items:
        if "tests/gpu" not in str(item.fspath):
            continue
        reason = reasons[1 if item.get_closest_marker("one_gpu") else 2]
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
