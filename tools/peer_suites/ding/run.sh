#!/bin/sh
# Run DI-engine's own buffer tests against shmbuffer.compat.ding (see README.md).
# usage: tools/peer_suites/ding/run.sh [DI-engine checkout] [pytest options...]
set -e
here=$(cd "$(dirname "$0")" && pwd)
ding=${1:-../DI-engine}  # a clone of https://github.com/opendilab/DI-engine
[ $# -gt 0 ] && shift
tests="$ding/ding/data/buffer/tests"
echo "DI-engine at $(git -C "$ding" rev-parse HEAD)"
cd "$tests"
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec python -m pytest -c /dev/null --rootdir "$tests" \
    --confcutdir "$tests" --import-mode=importlib -p no:cacheprovider -p ding_as_shmbuffer \
    test_buffer.py test_middleware.py "$@"
