"""Python client of the Rollout Service: ``RolloutClient`` (async), ``RolloutClientSync``,
resuming sessions, typed errors, trajectory helpers. Depends only on grpcio, protobuf,
googleapis-common-protos and grpcio-status; the ``rollout`` command (``rollout.entrypoints``)
adds rich for its tables."""

from rollout.client.aio import RolloutClient
from rollout.client.errors import RolloutError
from rollout.client.session import Session
from rollout.client.specs import group_specs, job_spec
from rollout.client.sync import RolloutClientSync, SessionSync
from rollout.client.trajectory import Flat, flatten, from_json, to_json

__all__ = ["Flat", "RolloutClient", "RolloutClientSync", "RolloutError", "Session",
           "SessionSync", "flatten", "from_json", "group_specs", "job_spec", "to_json"]
