"""build_off_main_thread: the engine is built on a thread that is gone before serving starts."""

import threading

import pytest

from fastdecode.errors import ConfigError
from fastdecode.server.engine_loop import build_off_main_thread


def test_builds_on_a_thread_that_then_exits():
    seen = {}

    def build():
        seen["thread"] = threading.current_thread()
        return 41 + 1

    assert build_off_main_thread(build) == 42
    assert seen["thread"] is not threading.current_thread()
    assert not seen["thread"].is_alive()  # its OpenMP pool, if any, went with it


def test_reraises_the_builders_error_on_the_caller():
    def build():
        raise ConfigError("no such model")

    with pytest.raises(ConfigError, match="no such model"):
        build_off_main_thread(build)
