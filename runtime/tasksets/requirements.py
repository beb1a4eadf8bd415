"""Task-supplied package names, checked before anything on the host sees them.

A swe task's ``spec.pip_packages`` reach ``pip download`` on the host (``rollout tasks
prepare``). pip reads each argument as an option, a local path, a URL or a requirement: a local
path builds the project and runs its ``setup.py`` on the host, an option such as ``--log=PATH``
writes a host file. So only plain requirement specifiers pass (``pytest==8.3.5``,
``numpy>=1.26,<2``, ``requests[socks]``), parsed with ``packaging`` and handed on in their
canonical form, never as the task wrote them.
"""

from __future__ import annotations

from packaging.requirements import InvalidRequirement, Requirement

from rollout.runtime.types import InvalidArgument

_FILE_SUFFIXES = (".whl", ".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tar.xz",
                  ".txz", ".tar.lz", ".tlz", ".egg", ".py")
_EXAMPLE = "a requirement specifier such as 'pytest==8.3.5' or 'numpy>=1.26,<2'"


def _refuse(value: str, why: str, field: str) -> InvalidArgument:
    shown = value if len(value) <= 200 else value[:200] + "..."
    return InvalidArgument(f"swe task field {field!r}: {shown!r} {why}; only {_EXAMPLE} is "
                           "accepted", "INVALID_TASK", f"task.{field}")


def requirement(value: str, field: str = "spec.pip_packages") -> str:
    """The canonical form of one requirement specifier; INVALID_TASK for anything else
    (options, paths, URLs, direct references, environment markers)."""
    text = value.strip()
    if text.startswith("-"):
        raise _refuse(value, "is a pip option", field)
    if "://" in text or text.startswith(("git+", "hg+", "svn+", "bzr+", "file:")):
        raise _refuse(value, "is a URL", field)
    if text.startswith(("/", ".", "~")) or "/" in text or "\\" in text:
        raise _refuse(value, "is a path", field)
    try:
        req = Requirement(text)
    except InvalidRequirement as e:
        raise _refuse(value, f"is not a requirement specifier ({e})", field) from None
    if req.url:
        raise _refuse(value, "is a direct reference (name @ URL)", field)
    if req.marker is not None:
        raise _refuse(value, "has an environment marker (not supported: list the packages "
                             "the task's environment needs)", field)
    if req.name.lower().endswith(_FILE_SUFFIXES):
        raise _refuse(value, "names a file (pip would install a local file of that name)",
                      field)
    return str(req)
