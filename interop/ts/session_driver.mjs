// A trainer session written only from docs/PROTOCOL.md and the generated TypeScript client
// (protobuf-es + Connect over gRPC): open, submit a group, read trajectories, acknowledge,
// drop the connection abruptly, resume, confirm the acks through heartbeats, half-close,
// reconnect. Prints one JSON line with what it saw; tests/interop/test_ts_client.py checks it
// against the server.
//
// Usage: node session_driver.mjs ADDRESS GENERATED_DIR CLIENT_ID
import { create } from "@bufbuild/protobuf";
import { createClient, ConnectError, Code } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { pathToFileURL } from "node:url";
import path from "node:path";
import { requestQueue } from "./request_queue.mjs";

const [address, genDir, clientId] = process.argv.slice(2);
const svc = await import(pathToFileURL(path.join(genDir, "rollout/v1/rollout_service_pb.js")));
const jobs = await import(pathToFileURL(path.join(genDir, "rollout/v1/job_pb.js")));

// 64 MiB like the server (docs/PROTOCOL.md "Limits a client must match").
const transport = createGrpcTransport({
  baseUrl: `http://${address}`,
  readMaxBytes: 64 << 20,
  writeMaxBytes: 64 << 20,
});
const client = createClient(svc.RolloutService, transport);

/** requestQueue with frames built from (kind, value). */
function requests() {
  const q = requestQueue();
  return {
    push: (kind, value) =>
      q.push(create(svc.StreamRolloutsRequestSchema, { kind: { case: kind, value } })),
    end: () => q.end(),
    [Symbol.asyncIterator]: () => q[Symbol.asyncIterator](),
  };
}

const report = { sessions: [] };
let ackedThrough = 0n; // contiguous acknowledged prefix, sent on reopen
let storeId = "";

function open(queue, extra = {}) {
  queue.push("open", create(svc.OpenSessionSchema, {
    clientId, ackedThrough, storeId,
    heartbeatInterval: { seconds: 0n, nanos: 200_000_000 },
    ...extra,
  }));
}

function heartbeatSays(hb, { through, unacked }) {
  return hb.ackedThrough === through && hb.unacked === unacked && hb.jobsInFlight === 0;
}

// --- session 1: submit a group of 3, acknowledge 2, then drop the connection abruptly -----
{
  const queue = requests();
  const abort = new AbortController();
  const seen = { accepted: [], trajectories: [], finished: [], acked: [] };
  report.sessions.push(seen);
  open(queue);
  const group = create(jobs.GroupSpecSchema, { groupId: "ts-group", size: 3 });
  const specs = [0, 1, 2].map((i) => create(jobs.JobSpecSchema, {
    jobId: `ts-group/${i}`, environment: "scripted", task: { reward: 0.25 * (i + 1) }, group,
  }));
  queue.push("submit", create(svc.SubmitJobsSchema, { jobs: specs }));
  try {
    for await (const frame of client.streamRollouts(queue, { signal: abort.signal })) {
      const k = frame.kind;
      if (k.case === "opened") {
        storeId = k.value.storeId;
        seen.opened = { replaying: k.value.replaying, storeId: k.value.storeId };
      } else if (k.case === "accepted") {
        seen.accepted.push([frame.jobId, k.value.duplicate]);
      } else if (k.case === "trajectory") {
        const id = k.value.deliveryId;
        seen.trajectories.push([frame.jobId, Number(id), k.value.trajectory.reward]);
        if (seen.acked.length < 2) {
          queue.push("ack", create(svc.AckTrajectoriesSchema, { deliveryIds: [id] }));
          seen.acked.push(Number(id));
        }
      } else if (k.case === "finished") {
        // Always right after the job's trajectory frame.
        const last = seen.trajectories[seen.trajectories.length - 1];
        seen.finished.push([frame.jobId, last && last[0] === frame.jobId]);
      } else if (k.case === "heartbeat") {
        // Drop only once both acks are confirmed durable and all three were delivered.
        if (seen.finished.length === 3 && k.value.ackedThrough === 2n) {
          seen.confirmed = Number(k.value.ackedThrough);
          abort.abort();
        }
      }
    }
  } catch (e) {
    seen.endedWith = ConnectError.from(e).code === Code.Canceled ? "aborted" : String(e);
  }
  ackedThrough = 2n;
}

// --- session 2: resume; the unacknowledged third is replayed; ack it, then half-close -------
{
  const queue = requests();
  const seen = { trajectories: [], finished: [] };
  report.sessions.push(seen);
  open(queue);
  for await (const frame of client.streamRollouts(queue)) {
    const k = frame.kind;
    if (k.case === "opened") {
      seen.opened = { replaying: k.value.replaying, storeId: k.value.storeId,
                      storeChanged: k.value.storeChanged,
                      ackedThrough: Number(k.value.ackedThrough) };
    } else if (k.case === "trajectory") {
      seen.trajectories.push([frame.jobId, Number(k.value.deliveryId)]);
      queue.push("ack", create(svc.AckTrajectoriesSchema, { deliveryIds: [k.value.deliveryId] }));
    } else if (k.case === "finished") {
      seen.finished.push(frame.jobId);
    } else if (k.case === "heartbeat" && heartbeatSays(k.value, { through: 3n, unacked: 0 })) {
      // The server owes nothing and has every ack: half-close, the call then ends with OK.
      seen.halfClosedAt = Number(k.value.ackedThrough);
      queue.end();
    }
  }
  seen.endedWith = "ok";
  ackedThrough = 3n;
}

// --- session 3: a plain reconnect replays nothing; a re-submit with REPLAY resends one -----
{
  const queue = requests();
  const seen = { trajectories: [], accepted: [], rejected: [] };
  report.sessions.push(seen);
  open(queue);
  queue.push("submit", create(svc.SubmitJobsSchema, {
    jobs: [create(jobs.JobSpecSchema, { jobId: "ts-group/0", environment: "scripted",
                                        task: { reward: 0.25 } })],
    ifFinished: svc.FinishedJobPolicy.REPLAY,
  }));
  queue.push("cancel", create(svc.CancelJobsSchema, { groupIds: ["no-such-group"] }));
  for await (const frame of client.streamRollouts(queue)) {
    const k = frame.kind;
    if (k.case === "opened") {
      seen.opened = { replaying: k.value.replaying };
    } else if (k.case === "accepted") {
      seen.accepted.push([frame.jobId, k.value.duplicate, jobs.Job_State[k.value.state]]);
    } else if (k.case === "rejected") {
      seen.rejected.push([k.value.code, k.value.reason]);
    } else if (k.case === "trajectory") {
      seen.trajectories.push([frame.jobId, Number(k.value.deliveryId), k.value.resubmitted]);
      queue.push("ack", create(svc.AckTrajectoriesSchema, { deliveryIds: [k.value.deliveryId] }));
    } else if (k.case === "heartbeat" && seen.trajectories.length === 1
               && heartbeatSays(k.value, { through: 4n, unacked: 0 })) {
      queue.end();
    }
  }
}

// --- unary: a bad request carries its reason in google.rpc.ErrorInfo ------------------------
try {
  await client.getJob({ jobId: "bad id!" });
} catch (e) {
  const err = ConnectError.from(e);
  report.unaryError = { code: Code[err.code], message: err.rawMessage };
}
console.log(JSON.stringify(report));
