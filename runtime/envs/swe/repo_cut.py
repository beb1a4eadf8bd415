"""A task's repository cut at ``base_commit``: what every sandbox of a swe job receives.

A task's ``repo_source`` may be a full clone whose later commits hold the fix (a SWE-bench
import points at one). Pruning inside the agent's workspace is not enough: the grading sandbox
also receives the source, and the agent's code runs there (the tests import it), where it could
check the fix out of a later commit before the tests look. So the source is cut once, in a
throwaway sandbox (git on task-supplied data never runs on the host), into a bundle of one ref
at ``base_commit``: only ``base_commit`` and its ancestors, whatever the source held. The cut is
cached on the host by the digest of the source and the commit, under
``$ROLLOUT_SWE_SOURCE_CACHE`` (default ``~/.cache/rollout/swe-sources``), which no sandbox
sees. An archive's files outside git are not carried over: the workspace is the clean checkout.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rollout.runtime.envs.common import write_private
from rollout.runtime.handler import HandlerError
from rollout.runtime.sandbox import hostfs

CUT_REF = "refs/heads/main"
_MAX_BUNDLE = 4 << 30
_CUT = r"""
set -euo pipefail
src=$1 kind=$2 base=$3 out=$PWD/cut.bundle
export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_TERMINAL_PROMPT=0
work=$(mktemp -d)
if [ "$kind" = archive ]; then
  mkdir "$work/x"
  tar -xf "$src" -C "$work/x"
  if [ -e "$work/x/.git" ]; then from=$work/x/.git; else
    set -- "$work"/x/*/.git
    [ $# -eq 1 ] && [ -e "$1" ] || {
      echo "the archive holds no git repository (.git)" >&2; exit 3; }
    from=$1
  fi
else
  from=$src
fi
git init -q --bare "$work/cut.git"
cd "$work/cut.git"
git fetch -q "$from" '+refs/*:refs/src/*'
commit=$(git rev-parse -q --verify "$base^{commit}") || {
  echo "commit $base is not in the repository" >&2; exit 4; }
git update-ref __REF__ "$commit"
git bundle create -q "$out" __REF__
rm -rf -- "$work" "$(dirname -- "$src")"
""".replace("__REF__", CUT_REF)


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_SWE_SOURCE_CACHE")
                or Path.home() / ".cache" / "rollout" / "swe-sources")


def _key(kind: str, data: bytes, base: str) -> str:
    digest = hashlib.sha256(f"{kind}\0{base}\0".encode())
    digest.update(data)
    return digest.hexdigest()[:32]


def _read_cached(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _store(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cut-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


async def cut_at_base(kind: str, data: bytes, base: str,
                      sandbox_factory: Callable[..., Awaitable[Any]] | None, *,
                      timeout: float = 300.0) -> tuple[str, bytes]:  # noqa: ASYNC109
    """``("bundle", bytes)`` of a bundle holding ``base`` and its history only, from a source
    as :func:`rollout.runtime.envs.swe.handler.read_source` returns it. REPO_CHECKOUT_FAILED when
    the
    source holds no repository or not ``base``."""
    if sandbox_factory is None:
        raise HandlerError("this server has no sandbox runtime configured", "NO_SANDBOX")
    path = cache_dir() / f"{await asyncio.to_thread(_key, kind, data, base)}.bundle"
    if (cached := await asyncio.to_thread(_read_cached, path)) is not None:
        return "bundle", cached
    sandbox = await sandbox_factory()
    try:
        src = await write_private(sandbox, "repo-source", data)
        result = await sandbox.exec(["bash", "-c", _CUT, "cut", src, kind, base],
                                    timeout=timeout, cwd=sandbox.workspace_in_sandbox)
        if not result.ok:
            raise HandlerError(f"could not check out {base} from the task's repo_source: "
                               f"{result.output[-800:]}", "REPO_CHECKOUT_FAILED")
        cut = await asyncio.to_thread(hostfs.read_beneath, sandbox.workspace, "cut.bundle",
                                      _MAX_BUNDLE)
    finally:
        await sandbox.destroy()
    await asyncio.to_thread(_store, path, cut)
    return "bundle", cut
