"""The part of an image's configuration a sandbox applies, as a value.

``Env``, ``WorkingDir`` and ``User`` apply (the image's ``PATH`` carries its interpreter, a
SWE-bench image's ``WorkingDir`` is ``/testbed``); ``Entrypoint`` and ``Cmd`` are kept for
reference and never run: a job's processes are the tools', not the image's service.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le",
           "s390x": "s390x", "riscv64": "riscv64", "i686": "386"}


def host_architecture() -> str:
    """This machine's architecture in OCI spelling (``amd64``, ``arm64``)."""
    machine = platform.machine()
    return _GOARCH.get(machine, machine)


@dataclass(frozen=True)
class ImageConfig:
    env: tuple[tuple[str, str], ...] = ()
    """``Env`` in order (later entries of one name win, as in the image)."""
    working_dir: str = ""
    user: str = ""
    """As the image gives it (``""``, ``"1000"``, ``"app:app"``)."""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    architecture: str = ""
    os: str = ""

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    @classmethod
    def from_oci(cls, doc: Mapping[str, Any]) -> ImageConfig:
        """From an OCI image configuration document (``application/vnd.oci.image.config``)."""
        conf = doc.get("config") or {}
        env = []
        for item in conf.get("Env") or ():
            name, sep, value = str(item).partition("=")
            if sep and name:
                env.append((name, value))
        return cls(env=tuple(env), working_dir=str(conf.get("WorkingDir") or ""),
                   user=str(conf.get("User") or ""),
                   entrypoint=tuple(str(a) for a in conf.get("Entrypoint") or ()),
                   cmd=tuple(str(a) for a in conf.get("Cmd") or ()),
                   architecture=str(doc.get("architecture") or ""),
                   os=str(doc.get("os") or ""))

    def to_json(self) -> dict[str, Any]:
        return {"env": [list(p) for p in self.env], "working_dir": self.working_dir,
                "user": self.user, "entrypoint": list(self.entrypoint), "cmd": list(self.cmd),
                "architecture": self.architecture, "os": self.os}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ImageConfig:
        return cls(env=tuple((str(a), str(b)) for a, b in data.get("env") or ()),
                   working_dir=str(data.get("working_dir", "")), user=str(data.get("user", "")),
                   entrypoint=tuple(data.get("entrypoint") or ()),
                   cmd=tuple(data.get("cmd") or ()),
                   architecture=str(data.get("architecture", "")), os=str(data.get("os", "")))
