// Stream a qworker job's tokens (docs/protocol.md, "The read loop"): prints the text as it is
// generated, then one line of usage on stderr. Exit 0 on `done`, 1 on `error`, 2 on timeout.
//   node consumer.mjs JOB_ID        Env: REDIS_URL, QW_PREFIX, QW_TIMEOUT (seconds, default 300)
import { createClient } from "redis";

const url = process.env.REDIS_URL ?? "redis://127.0.0.1:6379/0";
const prefix = process.env.QW_PREFIX ?? "qw";
const BLOCK_MS = 5000;

export async function* events(client, jobId, timeoutS = 300) {
  const key = `${prefix}:out:${jobId}`;
  const deadline = Date.now() + timeoutS * 1000;
  let last = "0-0"; // from the first event; reading never changes the stream
  // Token indices below `next` were passed on. After Redis lost its last writes (AOF everysec,
  // a failover) the job runs again from what the stream still holds and re-appends indices we
  // have seen, maybe a second `done`: skip those, and stop at the first terminal event.
  let next = 0;
  for (;;) {
    if (Date.now() > deadline) throw new Error(`no end of ${jobId} within ${timeoutS} s`);
    let reply;
    try {
      reply = await client.xRead({ key, id: last }, { COUNT: 512, BLOCK: BLOCK_MS });
    } catch (err) {
      // dropped connection: node-redis reconnects; repeat the same XREAD from `last`
      console.error("redis:", err.message);
      await new Promise((resolve) => setTimeout(resolve, 500));
      continue;
    }
    if (!reply) continue; // nothing new within BLOCK_MS
    for (const { id, message } of reply[0].messages) {
      last = id;
      if (message.type === "token") {
        const i = Number(message.i);
        if (i < next) continue; // seen before the stream rolled back
        next = i + 1;
      }
      yield message; // { type: "token" | "done" | "error", ... }, every value a string
      if (message.type === "done" || message.type === "error") return;
    }
  }
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const jobId = process.argv[2];
  if (!jobId) {
    console.error("usage: node consumer.mjs JOB_ID");
    process.exit(64);
  }
  const client = createClient({
    url,
    // longer than BLOCK, so an idle blocking read is not taken for a dead connection
    socket: { connectTimeout: 5000, socketTimeout: BLOCK_MS + 5000 },
  });
  client.on("error", (err) => console.error("redis:", err.message));
  await client.connect();
  let code = 2;
  try {
    for await (const ev of events(client, jobId, Number(process.env.QW_TIMEOUT ?? 300))) {
      if (ev.type === "token") {
        process.stdout.write(ev.text ?? "");
      } else if (ev.type === "done") {
        process.stdout.write("\n");
        console.error(`finish_reason=${ev.finish_reason} prompt_tokens=${ev.prompt_tokens} ` +
          `completion_tokens=${ev.completion_tokens} ttft_ms=${ev.ttft_ms} total_ms=${ev.total_ms}`);
        code = 0;
      } else if (ev.type === "error") {
        console.error(`error ${ev.code}: ${ev.message}`);
        code = 1;
      }
    }
  } catch (err) {
    console.error(err.message);
  } finally {
    await client.close();
  }
  process.exit(code);
}
