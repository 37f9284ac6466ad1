// Submit one qworker job with plain XADD (docs/protocol.md, "Submitting a job"); print its id.
//   node producer.mjs "Write a haiku about queues" [field=value ...]
// e.g. max_tokens=64 temperature=0.7, or messages='[{"role":"user","content":"Hi"}]' instead of
// a prompt (pass "" as the prompt). Env: REDIS_URL (default redis://127.0.0.1:6379/0), QW_PREFIX.
import { randomUUID } from "node:crypto";
import { createClient } from "redis";

const url = process.env.REDIS_URL ?? "redis://127.0.0.1:6379/0";
const prefix = process.env.QW_PREFIX ?? "qw";

export async function submit(client, fields) {
  // Our own id: the output key qw:out:<id> is known before XADD returns, and a retried
  // submit keeps it.
  const id = fields.id ?? randomUUID().replaceAll("-", "");
  // Every value on the wire is a string: numbers in decimal, lists as JSON.
  const wire = Object.fromEntries(Object.entries({ ...fields, id }).map(([k, v]) => [k, String(v)]));
  await client.xAdd(`${prefix}:jobs`, "*", wire);
  return id;
}

function parseArgs(argv) {
  const [prompt, ...rest] = argv;
  const fields = prompt ? { prompt } : {};
  for (const arg of rest) {
    const eq = arg.indexOf("=");
    if (eq < 1) throw new Error(`expected field=value, got ${JSON.stringify(arg)}`);
    fields[arg.slice(0, eq)] = arg.slice(eq + 1);
  }
  return fields;
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const client = createClient({ url });
  client.on("error", (err) => console.error("redis:", err.message));
  await client.connect();
  try {
    console.log(await submit(client, { max_tokens: 64, ...parseArgs(process.argv.slice(2)) }));
  } finally {
    await client.close();
  }
}
