#!/usr/bin/env bash
# $PYTHON for a script a test runs (tests/forked_cli.py: python_via_fork): `-m gputrain ARGS` runs forked from the
# test worker's preloaded server, without the 3 CPU-s of importing torch in a new interpreter; the command writes to
# this process's stdout and stderr, and its exit status is this one's (128 + N for signal N, as a shell reports it).
# Anything else runs in the real interpreter.
if [ "${1:-}" = -m ] && [ "${2:-}" = gputrain ]; then
  exec "$FORKED_PYTHON" -S -c '
import json, os, socket, sys
with socket.socket(socket.AF_UNIX) as server:
    server.connect(os.environ["FORKED_SOCKET"])
    server.sendall(json.dumps([sys.argv[1:], dict(os.environ), os.getcwd(), os.getpid()]).encode() + b"\n")
    code = int(server.makefile().readline())
sys.exit(code if code >= 0 else 128 - code)' "${@:3}"
fi
exec "$FORKED_PYTHON" "$@"
