# Sourced by the CUDA scripts: installs nvcc 13.0 from PyPI (five pinned wheels) and cuobjdump
# (13.2, the oldest on PyPI; it reads 13.0's images) into an ignored virtual environment
# (NVCC_VENV, default .venv-nvcc) when missing, and exports CUDA_PATH and PATH for it. No GPU
# and no CUDA driver are needed.
venv=${NVCC_VENV:-.venv-nvcc}
cuda="$venv/lib/python3.11/site-packages/nvidia/cu13"
if [ ! -x "$cuda/bin/nvcc" ] || [ ! -x "$cuda/bin/cuobjdump" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
        nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 \
        nvidia-cuda-cuobjdump==13.2.51
fi
cuda=$(cd "$cuda" && pwd)
export CUDA_PATH="$cuda" PATH="$cuda/bin:$PATH"
