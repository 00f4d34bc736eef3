#!/usr/bin/env bash
# The TCPStore client and torchrun's launch across PyTorch releases (tests/torch_interop.rs):
# the oldest supported (2.5.1; `candle_rendezvous::store::OLDEST_PYTORCH`), and the newest on PyPI
# when this list was last updated (2.15.0, 2026-11-25); scripts/test-torch.sh covers 2.9.1 in
# the middle. Then 2.4.1, older than supported, must be refused by name. Each release goes into
# its own virtual environment under target/, removed after its tests: PyPI's Linux wheels are
# CUDA builds with NVIDIA's libraries (about 5 GB each); there is no CPU-only wheel on PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --example rendezvous
run() { # version, test filter...
    local v=$1; shift
    local venv="target/torch-$v"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --no-cache-dir "torch==$v" numpy
    "$venv/bin/python" -c "import torch; print('PyTorch', torch.__version__)"
    TORCH_PYTHON="$(cd "$venv" && pwd)/bin/python" cargo test --test torch_interop -- --ignored --exact "$@"
    rm -rf "$venv"
}
supported=(our_client_speaks_pytorchs_tcpstore share_bytes_through_a_pytorch_store torchrun_launches_our_binary)
for v in 2.5.1 2.15.0; do
    run "$v" "${supported[@]}"
done
run 2.4.1 an_unsupported_pytorch_is_named
