import pytest
import torch

from fastdecode.loading import load_model


@pytest.fixture(scope="session")
def smollm2(default_num_threads):
    """The embedded default model (SmolLM2-135M-Instruct), loaded once per session: its float model
    (``lazy=False``, so ``weights="auto"`` runs it as float), which these tests compare with transformers'
    float outputs. The file's own Q4_1 blocks, the default of a model loaded at the size of its file,
    are tested in test_default_weights.py."""
    torch.set_num_threads(default_num_threads)
    return load_model("smollm2-135m", lazy=False)
