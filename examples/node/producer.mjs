// Submit one qworker job (docs/protocol.md, "Submitting a job once"); print its id.
//   node producer.mjs "Write a haiku about queues" [field=value ...]
// e.g. max_tokens=64 temperature=0.7, or messages='[{"role":"user","content":"Hi"}]' instead of
// a prompt (pass "" as the prompt). Env: REDIS_URL (default redis://127.0.0.1:6379/0), QW_PREFIX.
import { randomUUID } from "node:crypto";
import { createClient } from "redis";

const url = process.env.REDIS_URL ?? "redis://127.0.0.1:6379/0";
const prefix = process.env.QW_PREFIX ?? "qw";
const RESULT_TTL_S = process.env.QW_RESULT_TTL ?? "3600"; // the workers' --result-ttl

// The submit script of docs/protocol.md, word for word: it queues a job id once (while its
// marker <prefix>:sub:<id> or its output stream exists), so a retried submit never runs twice.
const SUBMIT = `local result, pos = {}, 2
for k = 2, #KEYS, 2 do
  local n = tonumber(ARGV[pos])
  local first = redis.call('GET', KEYS[k + 1])
  if first or redis.call('EXISTS', KEYS[k]) == 1 then
    result[#result + 1] = {0, first or ''}
  else
    local entry = redis.call('XADD', KEYS[1], '*', unpack(ARGV, pos + 1, pos + n))
    redis.call('SET', KEYS[k + 1], entry, 'EX', ARGV[1])
    result[#result + 1] = {1, entry}
  end
  pos = pos + 1 + n
end
return result
`;

export async function submit(client, fields) {
  // Our own id: the output key qw:out:<id> is known before the submit returns, and a retried
  // submit keeps it.
  const id = fields.id ?? randomUUID().replaceAll("-", "");
  // Every value on the wire is a string: numbers in decimal, lists as JSON.
  const flat = Object.entries({ ...fields, id }).flatMap(([k, v]) => [k, String(v)]);
  const keys = [`${prefix}:jobs`, `${prefix}:out:${id}`, `${prefix}:sub:${id}`];
  const [[queued]] = await client.eval(SUBMIT, {
    keys, arguments: [RESULT_TTL_S, String(flat.length), ...flat],
  });
  if (!queued) console.error(`job ${id} was already submitted: following that one`);
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
