"""Every sandbox test runs for both backends (docker skips with a clear reason when no
engine answers)."""
import pytest

from sbx_helpers import backend_or_skip


@pytest.fixture(params=["docker", "local"])
def backend(request) -> str:
    return backend_or_skip(request.param)
