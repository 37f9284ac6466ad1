#!/usr/bin/env bash
# Stream a qworker job's tokens with plain redis-cli (docs/protocol.md, "The read loop"): prints
# the text as it is generated, then one line of usage on stderr. Exit 0 on `done`, 1 on `error`,
# 2 on timeout.
#   ./consumer.sh JOB_ID
# Env: REDIS_URL (default redis://127.0.0.1:6379/0), QW_PREFIX (default qw), QW_TIMEOUT (300 s).
#
# redis-cli --csv prints a whole reply on one line, each string quoted with C-style escapes
# ("a\"b\n", bytes outside ASCII as \xNN), so no value can break the parsing.
set -euo pipefail
url=${REDIS_URL:-redis://127.0.0.1:6379/0}
prefix=${QW_PREFIX:-qw}
job=${1:?usage: consumer.sh JOB_ID}
key="$prefix:out:$job"
deadline=$(( $(date +%s) + ${QW_TIMEOUT:-300} ))
csv_value='^"(([^"\\]|\\.)*)"(,|$)'
entry_id='^[0-9]+-[0-9]+$'

# Split one --csv line into the array `values` (still escaped).
split_csv() {
  local line=$1
  values=()
  while [[ $line =~ $csv_value ]]; do
    values+=("${BASH_REMATCH[1]}")
    line=${line:${#BASH_REMATCH[0]}}
  done
}

# Print an escaped value as the bytes it stands for.
unescape() {
  local s=${1//\\\"/\\x22}
  printf '%b' "$s"
}

# Token indices below $next were printed. After Redis lost its last writes (AOF everysec, a
# failover) the job runs again from what the stream still holds and re-appends indices we have
# seen, maybe a second `done`: skip those, and stop at the first terminal event.
next=0

# One event: its fields are in the associative array `ev`.
handle() {
  case ${ev[type]} in
    token)
      local i=${ev[i]:-}
      if [[ $i =~ ^[0-9]{1,18}$ ]]; then
        if (( 10#$i < next )); then return; fi  # seen before the stream rolled back
        next=$(( 10#$i + 1 ))
      fi
      unescape "${ev[text]:-}" ;;
    done)
      echo
      echo "finish_reason=${ev[finish_reason]} prompt_tokens=${ev[prompt_tokens]}" \
           "completion_tokens=${ev[completion_tokens]} ttft_ms=${ev[ttft_ms]}" \
           "total_ms=${ev[total_ms]}" >&2
      exit 0 ;;
    error)
      echo "error ${ev[code]}: $(unescape "${ev[message]}")" >&2
      exit 1 ;;
  esac
}

last=0-0  # from the first event; reading never changes the stream
declare -A ev
while (( $(date +%s) < deadline )); do
  if ! reply=$(redis-cli -u "$url" --csv XREAD COUNT 512 BLOCK 5000 STREAMS "$key" "$last"); then
    sleep 1  # connection problem: retry the same read from $last
    continue
  fi
  case $reply in
    NULL) continue ;;  # nothing new within 5 s
    ERROR,*) echo "redis: $reply" >&2; sleep 1; continue ;;
  esac
  split_csv "$reply"
  # values: key, then for each entry its id and its field/value pairs
  i=1
  while (( i < ${#values[@]} )); do
    last=${values[i]}
    ev=()
    i=$(( i + 1 ))
    while (( i + 1 < ${#values[@]} )) && ! [[ ${values[i]} =~ $entry_id ]]; do
      ev[${values[i]}]=${values[i+1]}
      i=$(( i + 2 ))
    done
    handle
  done
done
echo "no end of job $job within ${QW_TIMEOUT:-300} s" >&2
exit 2
