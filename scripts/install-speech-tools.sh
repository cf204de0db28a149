#!/usr/bin/env bash
# espeak-ng (Debian) for tests/test_scorers_asr.py: real speech, made offline, for the built-in ASR
# scorer. Debian's package is installed when missing (its shared libraries pull in half an audio
# stack, so unpacking it beside the tree as the registry script does would not run).
set -euo pipefail
if command -v espeak-ng >/dev/null 2>&1; then
  echo "espeak-ng: $(command -v espeak-ng)"
  exit 0
fi
if ! apt-cache policy espeak-ng 2>/dev/null | grep -q 'Candidate: [0-9]'; then
  apt-get update -qq
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends espeak-ng >/dev/null
espeak-ng --version
