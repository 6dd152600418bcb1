import pytest
import torch

from fastdecode.loading import load_model


@pytest.fixture(scope="session")
def smollm2(default_num_threads):
    """The embedded default model (SmolLM2-135M-Instruct), loaded once per session."""
    torch.set_num_threads(default_num_threads)
    return load_model("smollm2-135m")
