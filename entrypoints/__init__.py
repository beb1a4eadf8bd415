"""The composition roots: the ``rollout`` command and the quickstart, which start a server, run
a trainer or drive the client library. The only package that may import both the client library
and the server (tests/server/test_layering.py): neither of those imports this one."""
