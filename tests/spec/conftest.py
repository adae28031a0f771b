import pytest

from tpfuse.model.config import ModelConfig

from .fixtures import tiny_target_config


@pytest.fixture
def target_config() -> ModelConfig:
    return tiny_target_config()
