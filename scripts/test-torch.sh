#!/usr/bin/env bash
# Interoperability with PyTorch's launcher: our TCPStore client against PyTorch's TCPStore server
# (classic and libuv back-ends), and examples/rendezvous under `torchrun --nproc_per_node 2
# --no-python` (tests/torch_interop.rs, ignored in a plain `cargo test`). Installs PyTorch 2.15.0,
# the newest release, from PyPI into an ignored virtual environment (TORCH_VENV, default
# .venv-torch) when it holds another version or none: PyPI's Linux wheel is the CUDA build and
# pulls NVIDIA's libraries (several GB on disk), which `import torch` needs even without a GPU.
# scripts/test-torch-versions.sh covers the oldest supported release and one older.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TORCH_VENV:-.venv-torch}
want=2.15.0
have=$("$venv/bin/python" -c "import torch.distributed, torch; print(torch.__version__)" 2>/dev/null) || true
if [ "${have%%+*}" != "$want" ]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --no-cache-dir "torch==$want" numpy
fi
"$venv/bin/python" -c "import torch; print('PyTorch', torch.__version__)"
cargo build --example rendezvous
TORCH_PYTHON="$(cd "$venv" && pwd)/bin/python" cargo test --test torch_interop -- --ignored \
    --skip an_unsupported_pytorch_is_named
