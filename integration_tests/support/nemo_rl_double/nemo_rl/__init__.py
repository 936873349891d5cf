"""Test double of NeMo RL v0.7.0 (see ../README.md). Not NeMo RL."""

__version__ = "0.7.0"
IS_TEST_DOUBLE = True
