#!/usr/bin/env bash
# Start a teacher server (python -m opd.teachers.server) in the background on this node, wait
# until it answers /health, and print the trainer's overrides on the last line:
#
#   launch/teacher_server.sh --model DIR [--port 8800] [--max-top-k 64] [server options ...]
#   deepspeed launch/train.py --recipe R teacher.engine=served teacher.urls=[http://127.0.0.1:8800]
#
# Environment: OPD_TEACHER_PYTHON, the Python with vLLM (default: python3; .venv-vllm/bin/python
# after .ci/vllm.sh); OPD_TEACHER_LOG, the server's log (default: teacher_server.log);
# OPD_TEACHER_WAIT_S, how long to wait for the engine to load (default: 900). On a GPU node give
# the teacher its own devices: CUDA_VISIBLE_DEVICES=4,5,6,7 launch/teacher_server.sh ...
# --tensor-parallel-size 4, and the trainer the others (deepspeed --include localhost:0,1,2,3).
# Stop it with `kill PID` (printed below).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python=${OPD_TEACHER_PYTHON:-python3}
log=${OPD_TEACHER_LOG:-teacher_server.log}
wait_s=${OPD_TEACHER_WAIT_S:-900}
host=127.0.0.1
port=8800
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --host) host=${args[i + 1]} ;;
    --port) port=${args[i + 1]} ;;
  esac
done
# A server listening on every address is reached by this node's name.
[[ "$host" == "0.0.0.0" ]] && host=$(hostname)
url="http://$host:$port"

PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" nohup "$python" -m opd.teachers.server "$@" \
  >"$log" 2>&1 &
pid=$!
deadline=$((SECONDS + wait_s))
until "$python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" \
    "$url/health" 2>/dev/null; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "teacher server exited before it was ready; the end of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  if ((SECONDS >= deadline)); then
    echo "teacher server (pid $pid) did not answer $url/health within ${wait_s}s; see $log" >&2
    exit 1
  fi
  sleep 2
done
echo "teacher server ready: pid $pid, log $log"
echo "teacher.engine=served teacher.urls=[$url]"
