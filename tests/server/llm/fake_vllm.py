"""A stand-in for the ``vllm`` CLI in tests: ``fake_vllm.py serve MODEL --host H --port P``.

It serves MODEL with ``rollout llm-serve`` (same HTTP subset), so the launcher's command line,
health wait, supervision and shutdown are exercised without vLLM. ``--fail-fast`` exits at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT)]


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "serve":
        print("usage: fake_vllm.py serve MODEL [--host H] [--port P]", file=sys.stderr)
        return 2
    if "--fail-fast" in argv:
        return 3
    model, rest = argv[1], argv[2:]
    host = rest[rest.index("--host") + 1] if "--host" in rest else "127.0.0.1"
    port = rest[rest.index("--port") + 1] if "--port" in rest else "8000"
    from rollout.server.llm.http_server import main as serve_main

    return serve_main(["--host", host, "--port", port, "--model", model])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
