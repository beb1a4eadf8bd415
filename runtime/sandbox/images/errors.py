"""The one error type of the image machinery, with a typed reason per kind of bad input.

Every failure to get an image ready (a bad reference, an unreachable registry, a layer that
would write outside its root, a Dockerfile that does not build, a full disk) is one
:class:`ImageError` raised during INIT, never a reward: the scheduler turns it into a FAILED
job whose message names the image (and so the task). ``task_fault`` tells the task's own fault
(its image is broken or missing) from the service's (the registry is down, the disk is full).
"""

from __future__ import annotations

from rollout.runtime.sandbox.base import SandboxError

REASONS = {
    "INVALID_IMAGE_REF": True,
    "IMAGE_NOT_FOUND": True,
    "IMAGE_AUTH_FAILED": True,
    "IMAGE_REJECTED": True,
    "IMAGE_BUILD_FAILED": True,
    "IMAGE_REGISTRY_UNREACHABLE": False,
    "IMAGE_DISK_FULL": False,
}
"""reason -> whether it is the task's fault (its image) rather than the service's."""


class ImageError(SandboxError):
    """An image could not be made ready; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, message: str, reason: str, *, ref: str = "") -> None:
        super().__init__(message, reason)
        self.ref = ref

    @property
    def task_fault(self) -> bool:
        return REASONS.get(self.reason, True)
