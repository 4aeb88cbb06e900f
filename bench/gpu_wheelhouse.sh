#!/usr/bin/env bash
# Prepare the wheelhouse that bench/gpu_check.sh installs from on a GPU machine with no
# network (docs/benchmarks.md, "GPU check"). Run here, from the repository root, after
# `make venv`:
#
#   bash bench/gpu_wheelhouse.sh [DIR]          # default .whl/ (git ignores it)
#   MODEL_PART_MIB=18 bash bench/gpu_wheelhouse.sh   # also the GGUF file, in parts
#
# DIR/wheels + DIR/requirements.txt: the packages our code imports that the GPU image lacks
# (its python is 3.12: KINDS.md of the device tool), at the versions of this venv.
# DIR/smollm2-shape: the default model's config and tokenizer (3.4 MB), from which the check
# builds seeded random weights of the same shape. DIR/model: with MODEL_PART_MIB, the
# default model's GGUF file (94 MiB) in parts of that size and its sha256, for a session
# that carries them over several calls (each call's working tree is at most 64 MiB).
set -euo pipefail

DIR=${1:-.whl}
VENV_PY=${VENV_PY:-.venv/bin/python}
PACKAGES="pydantic pydantic-core annotated-types typing-inspection typing-extensions redis PyJWT gguf"

rm -rf "$DIR/wheels" "$DIR/smollm2-shape" "$DIR/model"
mkdir -p "$DIR/wheels"
"$VENV_PY" -c "
import importlib.metadata as m
print('\n'.join(f'{name}=={m.version(name)}' for name in '$PACKAGES'.split()))
" > "$DIR/requirements.txt"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DIR/wheels" -r "$DIR/requirements.txt"
"$VENV_PY" -m bench.gpu_model export-shape "$DIR/smollm2-shape" > /dev/null 2>&1

if [ -n "${MODEL_PART_MIB:-}" ]; then
    GGUF=$("$VENV_PY" -c "
from shared import model_source
source = model_source.resolve(model_source.DEFAULT_MODEL_ID)
print(source.directory / source.gguf_file)")
    mkdir -p "$DIR/model"
    (cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")") > "$DIR/model/$(basename "$GGUF").sha256"
    split -b "${MODEL_PART_MIB}M" -d -a 2 "$GGUF" "$DIR/model/$(basename "$GGUF").part-"
fi
du -sh "$DIR"/* | sed 's/^/  /'
TREE_MIB=$(( $(git ls-files -z | xargs -0 cat | wc -c) >> 20 ))
echo "$(du -sm "$DIR" | cut -f1) MiB in $DIR; the tracked tree, which travels too, is $TREE_MIB MiB (64 a call)"
