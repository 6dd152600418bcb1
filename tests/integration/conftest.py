import pytest

from fastdecode.loading import load_model


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (SmolLM2-135M-Instruct), loaded once per session."""
    return load_model("smollm2-135m")
