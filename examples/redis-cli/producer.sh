#!/usr/bin/env bash
# Submit one qworker job with plain redis-cli (docs/protocol.md, "Submitting a job"); prints its id.
#   ./producer.sh "Write a haiku about queues" [field value ...]
# e.g. ./producer.sh "Hi" max_tokens 32 temperature 0
# Env: REDIS_URL (default redis://127.0.0.1:6379/0), QW_PREFIX (default qw).
set -euo pipefail
url=${REDIS_URL:-redis://127.0.0.1:6379/0}
prefix=${QW_PREFIX:-qw}
prompt=${1:?usage: producer.sh PROMPT [field value ...]}
shift
# Our own id: the output key <prefix>:out:<id> is known before XADD returns.
id="sh$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
reply=$(redis-cli -u "$url" --csv XADD "$prefix:jobs" '*' id "$id" prompt "$prompt" "$@")
case $reply in
  \"*-*\") echo "$id" ;;
  *) echo "XADD failed: $reply" >&2; exit 1 ;;
esac
