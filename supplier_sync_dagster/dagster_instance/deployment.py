"""Running the Dagster webserver and daemon for a profile, and backfills through GraphQL.

Used by the integration test and the backfill benchmark, and usable from a shell session:
it starts ``dagster-webserver`` and the daemon (``supplier-sync daemon``, see
:func:`supplier_sync_dagster.dagster_instance.daemon.run_daemon`) as their own process groups (a background job of a shell script would
ignore SIGTERM), waits until the webserver answers, launches partition backfills through
the GraphQL API and waits for them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import httpx

ROOT = Path(__file__).resolve().parents[2]
ASSETS = (
    "raw_hotel_snapshots",
    "normalized_hotels",
    "hotel_mappings",
    "hotel_diffs",
    "published_hotels",
)


def _backfill_mutation(field: str, argument: str, params_type: str, *errors: str) -> str:
    """A mutation that launches a backfill: it answers the backfill's id, or an error."""
    cases = "".join(f"    ... on {error} {{ message }}\n" for error in errors)
    return (
        f"mutation($params: {params_type}!) {{\n"
        f"  {field}({argument}: $params) {{\n"
        "    __typename\n"
        "    ... on LaunchBackfillSuccess { backfillId }\n"
        "    ... on PythonError { message stack }\n"
        f"{cases}  }}\n}}\n"
    )


_LAUNCH_BACKFILL = _backfill_mutation(
    "launchPartitionBackfill",
    "backfillParams",
    "LaunchBackfillParams",
    "PartitionKeysNotFoundError",
)
_REEXECUTE_BACKFILL = _backfill_mutation(
    "reexecutePartitionBackfill", "reexecutionParams", "ReexecutionParams"
)

LOCATION = "supplier_sync_dagster"  # workspace.yaml's code location
_REPOSITORY = {"repositoryLocationName": LOCATION, "repositoryName": "__repository__"}

_LAUNCH_RUN = """
mutation($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message stack }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on InvalidSubsetError { message }
    ... on PipelineNotFoundError { message }
  }
}
"""

_RELOAD_LOCATION = """
mutation($name: String!) {
  reloadRepositoryLocation(repositoryLocationName: $name) {
    __typename
    ... on WorkspaceLocationEntry {
      locationOrLoadError { __typename ... on PythonError { message } }
    }
  }
}
"""

_JOB_NAMES = """
query($selector: RepositorySelector!) {
  repositoryOrError(repositorySelector: $selector) {
    __typename
    ... on Repository { jobs { name } }
    ... on PythonError { message }
  }
}
"""

_BACKFILL_STATUS = """
query($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill { status }
  }
}
"""


_PARTITION_STATUSES = """
query($key: AssetKeyInput!, $partitions: [String!]) {
  assetNodeOrError(assetKey: $key) {
    __typename
    ... on AssetNode {
      assetPartitionStatuses {
        __typename
        ... on DefaultPartitionStatuses {
          materializedPartitions failedPartitions materializingPartitions unmaterializedPartitions
        }
      }
      latestMaterializationByPartition(partitions: $partitions) {
        partition
        runId
        metadataEntries {
          label
          ... on IntMetadataEntry { intValue }
          ... on FloatMetadataEntry { floatValue }
          ... on TextMetadataEntry { text }
          ... on BoolMetadataEntry { boolValue }
          ... on JsonMetadataEntry { jsonString }
        }
      }
      assetChecksOrError {
        __typename
        ... on AssetChecks {
          checks {
            name
            partitionStatuses {
              __typename
              ... on AssetCheckDefaultPartitionStatuses {
                succeededPartitions failedPartitions inProgressPartitions skippedPartitions
                executionFailedPartitions
              }
            }
          }
        }
      }
    }
  }
}
"""

_METADATA_VALUE_FIELDS = ("intValue", "floatValue", "text", "boolValue", "jsonString")


@dataclass(frozen=True)
class PartitionView:
    """An asset's partitions as the Dagster UI reads them (GraphQL).

    Attributes:
        statuses: ``materialized``, ``failed``, ``materializing``, ``unmaterialized`` -> keys.
        latest: Partition key -> the metadata of its latest materialization (JSON decoded).
        latest_run: Partition key -> the run of its latest materialization.
        checks: Check name -> ``succeeded``, ``failed``, ``inProgress``, ``skipped``,
            ``executionFailed`` -> partition keys.
    """

    statuses: dict[str, set[str]]
    latest: dict[str, dict[str, Any]]
    latest_run: dict[str, str]
    checks: dict[str, dict[str, set[str]]]


FINAL_BACKFILL_STATES = ("COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED")


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class DagsterProcesses:
    """A webserver and a daemon on one ``DAGSTER_HOME``, started with :meth:`start`.

    Attributes:
        env: The environment of both processes (``DAGSTER_HOME``, ``SUPPLIER_SYNC_*``...).
        log_dir: Where their output goes (``webserver.log``, ``daemon.log``).
        port: The webserver's port (a free one when 0).
    """

    env: Mapping[str, str]
    log_dir: Path
    port: int = 0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, *, timeout: float = 180.0) -> DagsterProcesses:
        """Starts both processes and waits until the webserver answers.

        Raises:
            RuntimeError: A process exited or the webserver did not answer in time.
        """
        self.port = self.port or free_port()
        bin_dir = Path(sys.executable).parent
        workspace = str(ROOT / "workspace.yaml")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs = [
            self._spawn(
                [
                    str(bin_dir / "dagster-webserver"),
                    *("-w", workspace, "-h", "127.0.0.1", "-p", str(self.port)),
                ],
                "webserver.log",
            ),
            self._spawn([str(bin_dir / "supplier-sync"), "daemon", "-w", workspace], "daemon.log"),
        ]
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/server_info", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the webserver did not answer: {self.tail('webserver.log')}")
            time.sleep(1)

    @property
    def url(self) -> str:
        """The webserver's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        out = (self.log_dir / log).open("wb")
        return subprocess.Popen(
            args,
            cwd=ROOT,
            env=dict(self.env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def check(self) -> None:
        """Raises RuntimeError if the webserver or the daemon has exited."""
        for proc, log in zip(self.procs, ("webserver.log", "daemon.log"), strict=False):
            if proc.poll() is not None:
                raise RuntimeError(f"{log[:-4]} exited ({proc.returncode}): {self.tail(log)}")

    def tail(self, log: str, chars: int = 3000) -> str:
        """The end of a process's output."""
        path = self.log_dir / log
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self) -> None:
        """SIGTERM to each process group, SIGKILL after 30 s."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def __enter__(self) -> DagsterProcesses:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def graphql(self, query: str, variables: Mapping[str, Any]) -> dict[str, Any]:
        """Runs a GraphQL query; raises RuntimeError on GraphQL errors."""
        response = httpx.post(
            f"{self.url}/graphql", json={"query": query, "variables": dict(variables)}, timeout=120
        )
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        if body.get("errors"):
            raise RuntimeError(f"GraphQL errors: {body['errors']}")
        return dict(body["data"])

    def launch_backfill(
        self, partition_keys: Sequence[str], *, title: str = "", assets: Sequence[str] = ASSETS
    ) -> str:
        """Launches a backfill of ``assets`` over ``partition_keys``; returns its id."""
        params = {
            "partitionNames": list(partition_keys),
            "assetSelection": [{"path": [name]} for name in assets],
            "title": title,
        }
        return self._launched(_LAUNCH_BACKFILL, "launchPartitionBackfill", params, "launched")

    def launch_job(
        self,
        job_name: str,
        *,
        tags: Mapping[str, str] | None = None,
        run_config: Mapping[str, Any] | None = None,
    ) -> str:
        """Launches a run of a job as the launchpad does (into the run queue); its id.

        Raises:
            RuntimeError: The webserver refused it (with its message).
        """
        params = {
            "selector": {**_REPOSITORY, "jobName": job_name},
            "runConfigData": dict(run_config or {}),
            "executionMetadata": {
                "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]
            },
        }
        data = self.graphql(_LAUNCH_RUN, {"params": params})["launchRun"]
        if data["__typename"] != "LaunchRunSuccess":
            raise RuntimeError(f"run of {job_name} not launched: {data}")
        return str(data["run"]["runId"])

    def reload_location(self) -> None:
        """Reloads the code location, as the UI's "Reload" does (a changed suppliers file
        makes its accounts' definitions appear).

        Raises:
            RuntimeError: The location failed to load (with its error).
        """
        data = self.graphql(_RELOAD_LOCATION, {"name": LOCATION})["reloadRepositoryLocation"]
        loaded = data.get("locationOrLoadError") or {}
        if (
            data["__typename"] != "WorkspaceLocationEntry"
            or loaded.get("__typename") == "PythonError"
        ):
            raise RuntimeError(f"code location not reloaded: {data}")

    def job_names(self) -> set[str]:
        """The jobs the webserver's code location has now."""
        data = self.graphql(_JOB_NAMES, {"selector": _REPOSITORY})["repositoryOrError"]
        if data["__typename"] != "Repository":
            raise RuntimeError(f"no repository: {data}")
        return {job["name"] for job in data["jobs"]}

    def reexecute_backfill(self, backfill_id: str, *, from_failure: bool = True) -> str:
        """Re-executes a finished backfill, as the UI's "Re-execute" does; returns the new id.

        From failure, the new backfill targets the partitions the first one did not
        materialize.
        """
        params = {
            "parentRunId": backfill_id,
            "strategy": "FROM_FAILURE" if from_failure else "ALL_STEPS",
        }
        return self._launched(
            _REEXECUTE_BACKFILL, "reexecutePartitionBackfill", params, "re-executed"
        )

    def _launched(self, mutation: str, field: str, params: dict[str, Any], what: str) -> str:
        """Runs a backfill mutation; returns the new backfill's id."""
        data = self.graphql(mutation, {"params": params})[field]
        if data["__typename"] != "LaunchBackfillSuccess":
            raise RuntimeError(f"backfill not {what}: {data}")
        return str(data["backfillId"])

    def partitions(self, asset: str, partition_keys: Sequence[str]) -> PartitionView:
        """An asset's partition statuses, latest metadata per partition and check statuses."""
        node = self.graphql(
            _PARTITION_STATUSES, {"key": {"path": [asset]}, "partitions": list(partition_keys)}
        )["assetNodeOrError"]
        if node["__typename"] != "AssetNode":
            raise RuntimeError(f"no asset {asset!r}: {node}")
        raw = node["assetPartitionStatuses"]
        statuses = _by_status(
            raw,
            "materializedPartitions",
            "failedPartitions",
            "materializingPartitions",
            "unmaterializedPartitions",
        )
        latest: dict[str, dict[str, Any]] = {}
        latest_run: dict[str, str] = {}
        for event in node["latestMaterializationByPartition"]:
            if event is None:
                continue
            values: dict[str, Any] = {}
            for entry in event["metadataEntries"]:
                for name in _METADATA_VALUE_FIELDS:
                    if name in entry:
                        value = entry[name]
                        values[entry["label"]] = (
                            json.loads(value) if name == "jsonString" else value
                        )
            latest[event["partition"]] = values
            latest_run[event["partition"]] = event["runId"]
        checks: dict[str, dict[str, set[str]]] = {}
        if node["assetChecksOrError"]["__typename"] == "AssetChecks":
            for check in node["assetChecksOrError"]["checks"]:
                found = check.get("partitionStatuses") or {}
                checks[check["name"]] = _by_status(
                    found,
                    "succeededPartitions",
                    "failedPartitions",
                    "inProgressPartitions",
                    "skippedPartitions",
                    "executionFailedPartitions",
                )
        return PartitionView(statuses, latest, latest_run, checks)

    def backfill_status(self, backfill_id: str) -> str:
        """The backfill's status (REQUESTED, COMPLETED_SUCCESS, ...)."""
        data = self.graphql(_BACKFILL_STATUS, {"id": backfill_id})["partitionBackfillOrError"]
        return str(data.get("status", data["__typename"]))

    def wait_for_backfill(
        self, instance: Any, backfill_id: str, *, timeout: float, poll: float = 1.0
    ) -> tuple[str, list[Any]]:
        """Waits until the backfill is final and each of its runs has finished.

        Args:
            instance: The Dagster instance the daemon works on.
            backfill_id: The backfill.
            timeout: Seconds to wait at most.
            poll: Seconds between looks.

        Returns:
            The backfill's final status and its runs.

        Raises:
            TimeoutError: Not finished in time (with the end of the daemon's log).
        """
        by_backfill = dg.RunsFilter(tags={"dagster/backfill": backfill_id})
        deadline = time.monotonic() + timeout
        status = ""
        while time.monotonic() < deadline:
            status = self.backfill_status(backfill_id)
            runs = instance.get_runs(filters=by_backfill)
            if status in FINAL_BACKFILL_STATES and runs and all(r.is_finished for r in runs):
                return status, list(runs)
            self.check()
            time.sleep(poll)
        raise TimeoutError(
            f"backfill {backfill_id} not finished ({status}): {self.tail('daemon.log')}"
        )


def _by_status(found: Mapping[str, Any], *fields: str) -> dict[str, set[str]]:
    """GraphQL's ``<status>Partitions`` lists as sets of keys by status (``failed``...)."""
    return {name.removesuffix("Partitions"): set(found.get(name) or ()) for name in fields}


def profile_env(*, dagster_home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus ``DAGSTER_HOME`` and ``extra`` (SUPPLIER_SYNC_*...)."""
    return {**os.environ, "DAGSTER_HOME": str(dagster_home), **(extra or {})}


def migrate_instance(env: Mapping[str, str]) -> None:
    """``dagster instance migrate`` for the instance of ``env`` (creates MySQL tables).

    Raises:
        RuntimeError: The migration failed.
    """
    done = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "instance", "migrate"],
        cwd=ROOT,
        env=dict(env),
        capture_output=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"instance migrate failed: {done.stderr.decode()[-3000:]}")
