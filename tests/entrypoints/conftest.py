"""The command line drives a real server: the client tests' server fixtures, shared."""

from tests.client.conftest import harness, make_harness, threaded_server

__all__ = ["harness", "make_harness", "threaded_server"]
