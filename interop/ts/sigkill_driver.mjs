// A session that outlives a SIGKILLed server, written from docs/PROTOCOL.md: submit two jobs,
// acknowledge the first delivery and wait for the heartbeat that confirms it, then print
// KILL-ME and keep reading. The test SIGKILLs the server and starts it again on the same port
// and state directory. The stream ends with a resumable code (docs/PROTOCOL.md "Ending a
// stream"); the driver reconnects with backoff, sending acked_through and the store id, gets
// the second job's delivery (the restarted server ran it again), acknowledges it and
// half-closes once a heartbeat says nothing is owed. Prints one JSON line.
//
// Usage: node sigkill_driver.mjs ADDRESS GENERATED_DIR CLIENT_ID
import { create } from "@bufbuild/protobuf";
import { createClient, ConnectError, Code } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { pathToFileURL } from "node:url";
import path from "node:path";
import { requestQueue } from "./request_queue.mjs";

const [address, genDir, clientId] = process.argv.slice(2);
const svc = await import(pathToFileURL(path.join(genDir, "rollout/v1/rollout_service_pb.js")));
const jobs = await import(pathToFileURL(path.join(genDir, "rollout/v1/job_pb.js")));
const client = createClient(svc.RolloutService, createGrpcTransport({
  baseUrl: `http://${address}`, readMaxBytes: 64 << 20, writeMaxBytes: 64 << 20,
}));
const RESUMABLE = new Set([Code.Unavailable, Code.Canceled]);

const report = { endings: [], deliveries: [], attempts: 0 };
let ackedThrough = 0n;
let storeId = "";
let submitted = false;
let done = false;

function frame(kind, value) {
  return create(svc.StreamRolloutsRequestSchema, { kind: { case: kind, value } });
}

while (!done) {
  report.attempts += 1;
  const queue = requestQueue();
  queue.push(frame("open", create(svc.OpenSessionSchema, {
    clientId, ackedThrough, storeId, heartbeatInterval: { seconds: 0n, nanos: 200_000_000 },
  })));
  if (!submitted) {
    // job 0 finishes at once; job 1 spends 3 s in RUN, so the kill finds it running
    const specs = [0, 1].map((i) => create(jobs.JobSpecSchema, {
      jobId: `kill/${i}`, environment: "scripted",
      task: i ? { reward: 1.0, sleep: { run: 3.0 } } : { reward: 0.5 },
    }));
    queue.push(frame("submit", create(svc.SubmitJobsSchema, { jobs: specs })));
    submitted = true;
  }
  try {
    for await (const f of client.streamRollouts(queue)) {
      const k = f.kind;
      if (k.case === "opened") {
        report.opened = { replaying: k.value.replaying, storeChanged: k.value.storeChanged };
        storeId = k.value.storeId;
      } else if (k.case === "trajectory") {
        const id = k.value.deliveryId;
        report.deliveries.push([f.jobId, Number(id), report.attempts]);
        queue.push(frame("ack", create(svc.AckTrajectoriesSchema, { deliveryIds: [id] })));
      } else if (k.case === "heartbeat") {
        const hb = k.value;
        if (hb.ackedThrough > ackedThrough) ackedThrough = hb.ackedThrough;
        if (report.attempts === 1 && hb.ackedThrough === 1n && !report.killRequested) {
          report.killRequested = true;
          console.log("KILL-ME");
        }
        if (report.attempts > 1 && hb.ackedThrough === 2n && hb.unacked === 0
            && hb.jobsInFlight === 0) {
          queue.end();
        }
      }
    }
    report.endings.push("OK");
    done = true;
  } catch (e) {
    const err = ConnectError.from(e);
    report.endings.push(Code[err.code]);
    if (!RESUMABLE.has(err.code) || report.attempts > 60) throw err;
    await new Promise((r) => setTimeout(r, Math.min(1000, 50 * 2 ** report.attempts)));
  }
}
console.log(JSON.stringify(report));
