#!/usr/bin/env bash
# The project's main job: the canary on its embedded default engine, clean then with one fault.
KVCANARY_EXTRAS=transformers source "$(dirname "$0")/env.sh"
kvcanary demo "$@"
