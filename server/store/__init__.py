"""The durable job store: one package, so nothing above it and nothing inside it import each other.

- ``job_store``: :class:`JobStore`, the jobs / transitions / deliveries API the scheduler uses,
  made of ``job_writes`` (the writer thread's ops), ``job_reads`` (queries on the reader thread)
  and ``job_pruning`` (the retention pass's deletes); ``records``: the values it takes and
  returns, :class:`JobRecord` among them.
- ``sqlite``: the schema, connections and the group-commit writer thread under it.
- ``file``: refusing a store file that is not ours before SQLite touches it.

The store sits below the scheduler: it imports neither ``server.pipeline`` nor
``server.scheduler`` nor the servicer (tests/server/test_layering.py checks it), so the stage
pipeline can depend on it without a cycle. Callers import the names below from
``rollout.server.store``.
"""

# ``X as X``: an explicit re-export (ruff and mypy), without an ``__all__`` whose strings would
# read like error reasons to tests/server/test_error_reasons.py.
from rollout.server.store.file import STORE_FILE as STORE_FILE
from rollout.server.store.file import StoreFileError as StoreFileError
from rollout.server.store.file import check_store_file as check_store_file
from rollout.server.store.job_store import JobStore as JobStore
from rollout.server.store.records import FinishRecord as FinishRecord
from rollout.server.store.records import GroupTaken as GroupTaken
from rollout.server.store.records import JobRecord as JobRecord
from rollout.server.store.records import OwnerJobCounts as OwnerJobCounts
from rollout.server.store.records import PruneStats as PruneStats
from rollout.server.store.records import StoreClosed as StoreClosed
from rollout.server.store.records import Transition as Transition
from rollout.server.store.records import now as now
from rollout.server.store.sqlite import SYNCHRONOUS as SYNCHRONOUS
from rollout.server.store.sqlite import StoreWriteFailed as StoreWriteFailed
