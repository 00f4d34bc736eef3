#!/usr/bin/env bash
# The TCPStore client and torchrun's launch on the oldest supported PyTorch (2.5.1;
# `candle_rendezvous::store::OLDEST_PYTORCH`; scripts/test-torch.sh covers the newest, 2.15.0),
# then 2.4.1, older than supported, which must be refused by name (tests/torch_interop.rs). Each
# release goes into its own virtual environment under target/, removed after its tests: PyPI's
# Linux wheels are CUDA builds with NVIDIA's libraries (about 5 GB each); there is no CPU-only
# wheel on PyPI.
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
run 2.5.1 "${supported[@]}"
run 2.4.1 an_unsupported_pytorch_is_named
